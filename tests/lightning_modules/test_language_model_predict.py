"""``predict`` of a language model: what its top-k lists, checked against the head's
distribution computed plainly."""

import math

import lightning as L
import pytest
import torch

from datamodules import LanguageModelingDataModule
from heads import DSSoftmaxHead, SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone


@pytest.fixture
def data(tmp_path):
    words = [f"w{i}" for i in range(12)]
    lines = [" ".join(words[(i + j) % 12] for j in range(6)) for i in range(20)]
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n")
    return LanguageModelingDataModule(
        path=str(tmp_path), cache_dir=str(tmp_path / "c"), predict_prompts=["w1 w2", "w7"]
    )


def _predict(model: LanguageModel, data: LanguageModelingDataModule) -> list[dict]:
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    return [row for batch in trainer.predict(model.eval(), data) for row in batch]


def _last_hidden(model: LanguageModel, data, prompt: str) -> torch.Tensor:
    ids = torch.tensor([data.vocab.encode_line(prompt, add_eos=False)])
    with torch.no_grad():
        hidden, _ = model.backbone(ids)
    return hidden[0, -1].double()


def test_a_ds_expert_smaller_than_k_lists_only_its_classes(data):
    """The selected DS-Softmax expert holds 3 classes and 6 are asked for: the top-k is its 3
    classes with their probabilities (a softmax over the expert's logits, Eq. 2, computed
    here), not 3 more classes outside it at probability 0."""
    data.prepare_data()
    data.setup("predict")
    torch.manual_seed(0)
    size, classes = data.vocab_size, torch.tensor([0, 3, 5])
    head = DSSoftmaxHead(8, size, num_experts=1, bias=False)
    weight = torch.randn(3, head.row_size)
    head.set_structure(weight, classes, [3], torch.zeros(1, 8))
    model = LanguageModel(LSTMBackbone(size, embedding_size=8, hidden_size=8), head,
                          predict_top_k=6)  # fmt: skip
    for row in _predict(model, data):
        hidden = _last_hidden(model, data, row["prompt"])
        gate = 1.0  # one expert: G_1(h) = softmax over one gate = 1
        probs = (gate * weight.double() @ hidden).softmax(0).tolist()
        expected = sorted(zip(probs, classes.tolist(), strict=True), reverse=True)
        assert [t["token"] for t in row["top_k"]] == [data.vocab.itos[c] for _, c in expected]
        assert [t["prob"] for t in row["top_k"]] == pytest.approx([p for p, _ in expected],
                                                                   rel=1e-5)  # fmt: skip


def test_small_probabilities_keep_their_digits(data):
    """A deep top-k's tail (here every class, down to probabilities near 1e-9) is reported
    with 6 significant digits, not rounded to 6 decimals (which read 0.0 below 5e-7)."""
    data.prepare_data()
    data.setup("predict")
    torch.manual_seed(0)
    size = data.vocab_size
    head = SoftmaxHead(8, size)
    with torch.no_grad():  # a steep distribution: classes spread over 10 orders of magnitude
        head.bias.copy_(torch.linspace(0.0, -21.0, size))
    model = LanguageModel(LSTMBackbone(size, embedding_size=8, hidden_size=8), head,
                          predict_top_k=size)  # fmt: skip
    for row in _predict(model, data):
        hidden = _last_hidden(model, data, row["prompt"])
        logits = head.weight.double() @ hidden + head.bias.double()
        probs, ids = logits.softmax(0).sort(descending=True)
        assert probs[-1] < 1e-8  # the test's premise: a tail below 6 decimals
        assert [t["token"] for t in row["top_k"]] == [data.vocab.itos[i] for i in ids.tolist()]
        got = [t["prob"] for t in row["top_k"]]
        assert got == pytest.approx(probs.tolist(), rel=1e-5)
        assert all(p > 0 for p in got)


@pytest.mark.slow  # ~40 s: a draw a backbone step
def test_sampling_draws_from_the_distribution_at_the_temperature(data):
    """The first sampled token's frequencies over many draws match ``softmax(log p / T)`` of
    the model's next-token distribution, computed here (T = 0.5 sharpens it: the frequencies
    do not match the distribution at T = 1)."""
    data.prepare_data()
    data.setup("predict")
    torch.manual_seed(0)
    size = data.vocab_size
    backbone = LSTMBackbone(size, embedding_size=8, hidden_size=8)
    model = LanguageModel(backbone, SoftmaxHead(8, size), generate_tokens=1, temperature=0.5)
    model.eval()
    ids = torch.tensor([data.vocab.encode_line("w1 w2", add_eos=False)])
    draws = 4000
    counts = torch.zeros(size, dtype=torch.float64)
    with torch.no_grad():
        hidden, state = model.backbone(ids)
        for _ in range(draws):
            counts[model._sample(ids, hidden[:, -1], state, None)[0]] += 1
        log_p = model.head.log_prob(hidden[:, -1])[0].double()
    expected = (log_p / 0.5).softmax(0)
    # 4 standard deviations of a binomial frequency, per class
    tolerance = 4 * (expected * (1 - expected) / draws).sqrt() + 1e-9
    assert ((counts / draws - expected).abs() <= tolerance).all()
    assert ((counts / draws - log_p.exp()).abs() > tolerance).any()
    assert math.isclose(float(expected.sum()), 1.0, rel_tol=1e-9)
