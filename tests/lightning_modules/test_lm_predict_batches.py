"""``predict`` of a language model reads its prompts in batches (``data.predict_batch_size``):
the same top-k as each prompt alone, computed plainly here in float64 (prompts of different
lengths, one token, wholly unknown, empty, longer than a Transformer's position table), for an
LSTM, a Transformer and an n-gram backbone and over Hybrid-LightRNN codes; continuations from
each prompt's own state; the ``<unk>`` count; each prompt encoded once."""

import logging
import math

import lightning as L
import pytest
import torch

from datamodules import LanguageModelingDataModule
from datamodules.vocab.word import WordVocab
from heads import SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone, NGramBackbone, TransformerBackbone

D = 8
K = 4
MAX_LENGTH = 6  # the Transformer's position table: the longest prompt is read by its last 6
PROMPTS = [
    "w1 w2 w3 w4 w5",
    "w7",  # one token
    "abc def",  # wholly unknown
    "",  # empty: <eos> alone
    "w3 w4 w5 w6 w7 w8 w9 w10 w11 w0 w1",  # longer than MAX_LENGTH
    "w2 xyz w3",
    "w9 w10",
]


def _data(tmp_path, vocab: str, batch_size: int, prompts=PROMPTS) -> LanguageModelingDataModule:
    words = [f"w{i}" for i in range(12)]
    lines = [" ".join(words[(i + j) % 12] for j in range(6)) for i in range(20)]
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n")
    data = LanguageModelingDataModule(
        path=str(tmp_path), cache_dir=str(tmp_path / "c"), predict_prompts=prompts,
        predict_batch_size=batch_size, vocab=vocab, lightrnn_frequent=4, lightrnn_rows=3,
    )  # fmt: skip
    data.prepare_data()
    data.setup("predict")
    return data


def _model(kind: str, size: int, dtype=torch.float64, **options) -> LanguageModel:
    torch.manual_seed(0)
    if kind == "lstm":
        backbone = LSTMBackbone(size, embedding_size=D, hidden_size=D)
    elif kind == "transformer":
        backbone = TransformerBackbone(size, embedding_size=D, num_heads=2, num_layers=1,
                                       feedforward_size=16, max_length=MAX_LENGTH)  # fmt: skip
    else:
        backbone = NGramBackbone(size, output_size=D, order=3, hidden_layers=1)
    head = SoftmaxHead(D, size)
    with torch.no_grad():  # a spread distribution: the ranks are not decided by ties
        head.weight.mul_(20)
    return LanguageModel(backbone, head, predict_top_k=K, **options).to(dtype).eval()


def _predict(model: LanguageModel, data: LanguageModelingDataModule) -> list[dict]:
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    batches = trainer.predict(model, data)
    return [row for batch in batches for row in (batch if isinstance(batch, list) else [batch])]


def _hidden(model: LanguageModel, ids: list[int]) -> torch.Tensor:
    """The context vector after ``ids``, the prompt read alone (a Transformer: its last
    ``max_length`` tokens)."""
    tokens = torch.tensor([ids])
    if isinstance(model.backbone, TransformerBackbone):
        tokens = tokens[:, -MAX_LENGTH:]
    with torch.no_grad():
        return model.backbone(tokens)[0][:, -1]


def _plain_top_k(model: LanguageModel, data, prompt: str) -> list[dict]:
    """The top-k of one prompt alone: every next word's probability enumerated (over
    Hybrid-LightRNN codes, a rare word's row and then its column after the row read)."""
    vocab = data.vocab
    words = getattr(vocab, "words", None)
    ids = vocab.encode_line(prompt, add_eos=False) or [vocab.eos_id]
    with torch.no_grad():
        log_p = model.head.log_prob(_hidden(model, ids))[0].double()
        if words is None:
            scores = {vocab.itos[i]: float(log_p[i]) for i in range(len(vocab))}
        else:
            scores = {}
            for word in range(len(words)):
                first, second = vocab.word_codes[word].tolist()
                score = float(log_p[first])
                if second >= 0:
                    after = model.head.log_prob(_hidden(model, ids + [first]))[0].double()
                    score += float(after[second])
                scores[words.itos[word]] = score
    best = sorted(scores.items(), key=lambda item: -item[1])[:K]
    return [{"token": w, "prob": float(f"{math.exp(lp):.6g}")} for w, lp in best]


@pytest.mark.parametrize("vocab", ["word", "hybrid_lightrnn"])
@pytest.mark.parametrize("kind", ["lstm", "transformer", "ngram"])
def test_batched_top_k_is_each_prompt_alone(tmp_path, kind, vocab):
    """Batches of 3 (the last one short) give each prompt, in order, the top-k it has alone,
    computed plainly (float64: the 6 significant digits agree exactly)."""
    data = _data(tmp_path, vocab, batch_size=3)
    model = _model(kind, data.vocab_size)
    rows = _predict(model, data)
    assert [row["prompt"] for row in rows] == PROMPTS
    for row in rows:
        assert row["top_k"] == _plain_top_k(model, data, row["prompt"]), row["prompt"]


@pytest.mark.parametrize("vocab", ["word", "hybrid_lightrnn"])
@pytest.mark.parametrize("kind", ["lstm", "transformer"])
def test_float32_batches_give_the_tokens_of_one_prompt_at_a_time(tmp_path, kind, vocab):
    """In float32 a batch's shapes round differently from one prompt's (a Transformer's last
    digit may move): the same tokens, the probabilities within float32's rounding."""
    one = _predict(_model(kind, _data(tmp_path, vocab, 1).vocab_size, torch.float32),
                   _data(tmp_path, vocab, 1))  # fmt: skip
    data = _data(tmp_path, vocab, 64)
    batched = _predict(_model(kind, data.vocab_size, torch.float32), data)
    for alone, together in zip(one, batched, strict=True):
        assert [t["token"] for t in together["top_k"]] == [t["token"] for t in alone["top_k"]]
        assert [t["prob"] for t in together["top_k"]] == pytest.approx(
            [t["prob"] for t in alone["top_k"]], rel=1e-5
        )


@pytest.mark.parametrize("vocab", ["word", "hybrid_lightrnn"])
@pytest.mark.parametrize("kind", ["lstm", "transformer", "ngram"])
def test_continuations_start_from_each_prompts_own_state(tmp_path, kind, vocab):
    """Sampled at a temperature that makes each draw the likeliest token: a batch's
    continuations are those of each prompt alone (a state read after the padding, or a
    context with the padding in it, would continue another text); over codes, each sample is
    ``generate_tokens`` words. A seed's draws at temperature 1 are the same on a second run."""
    options = {"generate_tokens": 4, "temperature": 1e-4}
    one = _predict(_model(kind, _data(tmp_path, vocab, 1).vocab_size, **options),
                   _data(tmp_path, vocab, 1))  # fmt: skip
    data = _data(tmp_path, vocab, 4)
    batched = _predict(_model(kind, data.vocab_size, **options), data)
    assert [r["sample"] for r in batched] == [r["sample"] for r in one]
    assert all(len(r["sample"].split()) == 4 for r in batched)
    options["temperature"] = 1.0
    draws = []
    for _ in range(2):
        model = _model(kind, data.vocab_size, **options)
        torch.manual_seed(7)
        draws.append([r["sample"] for r in _predict(model, data)])
    assert draws[0] == draws[1]
    assert all(len(sample.split()) == 4 for sample in draws[0])


def _count_encoding(monkeypatch) -> list[str]:
    """The lines a word vocabulary (also Hybrid-LightRNN's) looks up, as they are."""
    calls = []
    encode = WordVocab.encode_line

    def counted(self, line, add_eos=True):
        calls.append(line)
        return encode(self, line, add_eos)

    monkeypatch.setattr(WordVocab, "encode_line", counted)
    return calls


@pytest.mark.parametrize("vocab", ["word", "hybrid_lightrnn"])
def test_each_prompt_is_encoded_once_and_unk_is_counted_as_before(tmp_path, monkeypatch, caplog,
                                                                   vocab):  # fmt: skip
    """The words of each prompt are looked up once (the loader's encoding gives the model
    its ``<unk>`` counts; the old path looked each up three times), and the run's end says
    the same count: 3 of 24 words (abc, def, xyz), in 2 of 7 lines."""
    data = _data(tmp_path, vocab, batch_size=3)
    model = _model("lstm", data.vocab_size)
    calls = _count_encoding(monkeypatch)
    with caplog.at_level(logging.WARNING):
        rows = _predict(model, data)
    assert len(rows) == len(PROMPTS)
    assert sorted(calls) == sorted(PROMPTS)
    said = [r.getMessage() for r in caplog.records if "read as <unk>" in r.getMessage()]
    assert said == [
        "warning: predict: 3 of 24 prompt tokens (12.50%), in 2 of 7 lines, were read as "
        "<unk> (not in the vocabulary, or written <unk>)"
    ]


def test_a_batch_is_right_padded_with_each_prompts_length(tmp_path, monkeypatch):
    """Batches of prompts, right-padded with <eos>, each prompt's length and counts beside;
    nothing encoded before its window is read (a long file's memory stays flat). The window
    (every prompt here) is sorted by length (a stable sort), each batch's prompts carry
    their line in the input."""
    data = _data(tmp_path, "word", batch_size=4)
    calls = _count_encoding(monkeypatch)
    loader = data.predict_dataloader()
    assert calls == []
    first, second = list(loader)
    assert calls == PROMPTS  # encoded in the input's order
    vocab = data.vocab
    # lengths 5, 1, 2, 1 (empty: <eos>), 11, 3, 2: sorted 1, 1, 2, 2 | 3, 5, 11
    assert first["input_lines"] == [1, 3, 2, 6] and second["input_lines"] == [5, 0, 4]
    assert first["prompt"] == [PROMPTS[i] for i in (1, 3, 2, 6)]
    assert (first["last"], second["last"]) == (False, True)
    assert first["lengths"] == [1, 1, 2, 2]
    assert first["ids"].shape == (4, 2) and second["ids"].shape == (3, 11)
    for batch in (first, second):
        for row, prompt, length in zip(batch["ids"], batch["prompt"], batch["lengths"],
                                       strict=True):  # fmt: skip
            ids = vocab.encode_line(prompt, add_eos=False) or [vocab.eos_id]
            assert row[:length].tolist() == ids
            assert (row[length:] == vocab.eos_id).all()
    assert first["unknown"] == [0, 0, 2, 0] and first["tokens"] == [1, 0, 2, 2]


def test_a_bpe_prompts_unseen_character_counts_as_unknown(tmp_path):
    """A character the BPE never saw is a ``<unk_char>`` piece: read as unknown and counted
    (the count took ``<unk>`` alone, so 'é' went unsaid), as is a written ``<unk>``: 2 of
    the 4 pieces of 'the caté <unk>', by the loader and by ``UnknownInput.add`` alike."""
    from lightning_modules.unknown_input import UnknownInput

    lines = ["the catdog sat on the mat", "a dog met the catalogue"] * 20
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n")
    data = LanguageModelingDataModule(
        path=str(tmp_path), vocab="bpe", bpe_vocab_size=30, cache_dir=str(tmp_path / "c"),
        predict_prompts=["the cat", "the caté <unk>"],
    )  # fmt: skip
    data.prepare_data()
    data.setup("predict")
    counted = UnknownInput("prompt")
    counted.add(data.vocab, "the caté <unk>")
    assert (counted.unknown, counted.tokens) == (2, 4)
    (batch,) = list(data.predict_dataloader())
    assert batch["unknown"] == [0, 2] and batch["tokens"] == [2, 4]


# -- windows sorted by length (data.predict_window) ------------------------------------------
MIXED = [
    " ".join(f"w{(i * 5 + j) % 12}" for j in range(n))
    for i, n in enumerate([1, 9, 2, 0, 12, 3, 1, 7, 2, 4, 1, 10, 5, 2, 3])
]


@pytest.mark.parametrize("kind", ["lstm", "transformer", "ngram"])
def test_sorted_windows_keep_the_input_order_and_each_prompts_top_k(tmp_path, kind):
    """Windows of 6 prompts sorted by length, batches of 4: the output is the input's order
    (a window's results held back until the earlier lines are out), each prompt's top-k the
    one it has alone (float64, computed plainly), and greedy continuations each prompt's own;
    the padding is a fraction of the input-order batching's."""
    data = _data(tmp_path, "word", batch_size=4, prompts=MIXED)
    data.hparams.predict_window = 6
    options = {"generate_tokens": 3, "temperature": 1e-4}
    model = _model(kind, data.vocab_size, **options)
    rows = _predict(model, data)
    assert [row["prompt"] for row in rows] == MIXED
    for row in rows:
        assert row["top_k"] == _plain_top_k(model, data, row["prompt"]), row["prompt"]
    alone = _data(tmp_path, "word", batch_size=1, prompts=MIXED)
    assert [r["sample"] for r in rows] == [r["sample"] for r in _predict(model, alone)]
    lengths = [max(len(p.split()), 1) for p in MIXED]
    padded = sum(b["ids"].numel() for b in data.predict_dataloader())
    in_order = sum(len(lengths[a : a + 4]) * max(lengths[a : a + 4]) for a in range(0, 15, 4))
    assert sum(len(b["prompt"]) for b in data.predict_dataloader()) == len(MIXED)
    # windows [1 9 2 1 12 3] [1 7 2 4 1 10] [5 2 3]: 4x3 + 2x12, 4x4 + 2x10, 3x5 against
    # 4x9 + 4x12 + 4x10 + 3x5 in the input's order
    assert (padded, in_order) == (87, 139)


@pytest.mark.parametrize("task", ["top_k", "sample"])
def test_a_limited_predict_writes_every_prompt_it_read_in_order(tmp_path, task):
    """``limit_predict_batches`` ends the run inside a window: the last batch run gives
    every result still held back, in the input's order (prompts of later batches of the
    window are not read)."""
    data = _data(tmp_path, "word", batch_size=2, prompts=MIXED)
    data.hparams.predict_window = 8
    model = _model("lstm", data.vocab_size, generate_tokens=2 if task == "sample" else 0)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_predict_batches=2)  # fmt: skip
    rows = [row for batch in trainer.predict(model, data) for row in batch]
    # window 1 lengths 1 9 2 1 12 3 1 7: sorted batches [0 3] [6 2] ...
    assert [row["prompt"] for row in rows] == [MIXED[i] for i in (0, 2, 3, 6)]


def test_a_bad_window_is_named():
    from datamodules.errors import DataConfigError

    with pytest.raises(DataConfigError, match="data.predict_window must be a positive integer"):
        LanguageModelingDataModule(predict_window=0)
