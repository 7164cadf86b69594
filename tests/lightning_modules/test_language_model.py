import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from datamodules.bptt import BPTTBatches
from heads import AdaptiveSoftmaxHead, SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone
from lightning_modules.errors import ModelConfigError

VOCAB = 40


def make_model(**kwargs) -> LanguageModel:
    torch.manual_seed(0)
    backbone = LSTMBackbone(VOCAB, embedding_size=8, hidden_size=8, input_dropout=0.0,
                            hidden_dropout=0.0, output_dropout=0.0)  # fmt: skip
    return LanguageModel(backbone, SoftmaxHead(8, VOCAB), **kwargs)


def test_perplexity_is_token_weighted_over_the_split():
    """exp(total NLL / total tokens), with an uneven last window (7 windows of 7 steps, then
    one of 1), recomputed by hand: not a mean of the windows' means."""
    model = make_model().eval()
    tokens = torch.randint(0, VOCAB, (207,), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(BPTTBatches(tokens, batch_size=4, bptt=7), batch_size=None)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    (result,) = trainer.validate(model, loader)

    total_nll, total_tokens, state = 0.0, 0, None
    with torch.no_grad():
        for x, y in BPTTBatches(tokens, batch_size=4, bptt=7):
            hidden, state = model.backbone(x, state)  # state carried across windows
            log_probs = model.head.log_prob(hidden.reshape(-1, 8))
            total_nll -= log_probs.gather(1, y.reshape(-1, 1)).sum().item()
            total_tokens += y.numel()
    assert total_tokens == 4 * (207 // 4 - 1) == 4 * (7 * 7 + 1)
    assert result["val/ppl"] == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-5)
    assert result["val/loss"] == pytest.approx(total_nll / total_tokens, rel=1e-6)


def test_state_is_carried_and_detached_in_training():
    model = make_model()
    batches = list(BPTTBatches(torch.randint(0, VOCAB, (200,)), batch_size=2, bptt=5))
    model._step(batches[0], "train")
    carried = model._state["train"]
    assert carried is not None and not carried[0][0].requires_grad
    loss = model._step(batches[1], "train")
    loss.backward()  # would fail if the graph of window 0 were still attached and freed
    model.on_train_epoch_start()
    assert "train" not in model._state


def test_tying_and_size_checks():
    model = make_model(tie_weights=True)
    assert model.head.weight is model.backbone.embedding.weight
    with pytest.raises(ValueError, match="must equal the backbone's output size"):
        LanguageModel(LSTMBackbone(VOCAB, hidden_size=8), SoftmaxHead(9, VOCAB))


def test_a_head_that_cannot_be_tied_names_the_option_that_unties_it():
    backbone = LSTMBackbone(VOCAB, embedding_size=8, hidden_size=8)
    head = AdaptiveSoftmaxHead(8, VOCAB, cutoffs=[5])
    with pytest.raises(ModelConfigError, match="AdaptiveSoftmaxHead does not support weight "
                       "tying: set model.tie_weights false"):  # fmt: skip
        LanguageModel(backbone, head, tie_weights=True)
    assert LanguageModel(backbone, head, tie_weights=False).head is head


def test_non_finite_loss_stops_with_the_head_named():
    model = make_model()
    with torch.no_grad():
        model.head.bias[0] = float("nan")
    batch = next(iter(BPTTBatches(torch.randint(0, VOCAB, (100,)), 2, 5)))
    with pytest.raises(FloatingPointError, match="SoftmaxHead"):
        model._step(batch, "train")


def test_model_summary_counts_the_flops_of_a_training_batch(tmp_path):
    """The summary's FLOPs column (Lightning fills it from ``example_input_array``, which
    ``setup("fit")`` builds from this rank's first training batch): the LSTM's and the
    softmax's matrix products, not zeros."""
    from lightning.pytorch.utilities.model_summary import ModelSummary

    from datamodules import LanguageModelingDataModule

    for split in ("train", "valid", "test"):
        (tmp_path / f"c.{split}.txt").write_text("a b c d e f g h i j\n" * 30)
    data = LanguageModelingDataModule(path=str(tmp_path), batch_size=3, bptt=5,
                                      cache_dir=str(tmp_path / "cache"))  # fmt: skip
    vocab, d = data.vocab_size, 8
    model = LanguageModel(LSTMBackbone(vocab, embedding_size=d, hidden_size=d, num_layers=2),
                          SoftmaxHead(d, vocab))  # fmt: skip
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, datamodule=data)
    inputs, targets = model.example_input_array
    assert inputs.shape == targets.shape == (3, 5)
    tokens = 3 * 5
    lstm = 2 * 2 * tokens * 4 * d * (d + d)  # two layers, W_ih and W_hh at every step
    softmax = 2 * tokens * d * vocab  # the logits (the fused loss's product)
    summary = ModelSummary(model, max_depth=1)
    flops = dict(zip(summary.layer_names, (sum(c.values()) for c in summary.flop_counts.values()),
                     strict=True))  # fmt: skip
    assert flops["backbone"] == lstm
    assert (flops["backbone"], flops["head"]) == (lstm, softmax)
    assert summary.total_flops == lstm + softmax


@pytest.fixture()
def coded(tmp_path):
    """A data module over Hybrid-LightRNN codes (5 frequent words, a 4 x 8 table) and an
    untrained LSTM model over its codes whose head prefers a column code anywhere."""
    from datamodules import LanguageModelingDataModule

    lines = [" ".join(f"w{i}" for i in range(30) if i <= j) for j in range(30)]
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n")
    data = LanguageModelingDataModule(
        path=str(tmp_path), vocab="hybrid_lightrnn", lightrnn_frequent=5, lightrnn_rows=4,
        lightrnn_cols=8, predict_prompts=["w1 w2 w20", "w0"], cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    torch.manual_seed(0)
    size = data.vocab_size
    model = LanguageModel(LSTMBackbone(size, embedding_size=8, hidden_size=8), SoftmaxHead(8, size),
                          predict_top_k=6, generate_tokens=40)  # fmt: skip
    with torch.no_grad():
        model.head.bias[data.vocab.col_codes] += 4.0
    return data, model.eval()


def test_predict_over_lightrnn_codes_reports_the_top_words(coded):
    """The top-k of words, not codes (a `<row3>` names nothing): a rare word's probability is
    its row's times its column's after the row, checked by a plain enumeration."""
    data, model = coded
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    rows = [row for batch in trainer.predict(model, data) for row in batch]
    vocab = data.vocab
    for row in rows:
        ids = torch.tensor([vocab.encode_line(row["prompt"], add_eos=False)])
        with torch.no_grad():
            hidden, state = model.backbone(ids)
            first = model.head.log_prob(hidden[:, -1])[0]
            scores = {}
            for word in range(len(vocab.words)):
                code, column = vocab.word_codes[word].tolist()
                score = float(first[code])
                if column >= 0:
                    after, _ = model.backbone(torch.tensor([[code]]), state)
                    score += float(model.head.log_prob(after[:, -1])[0, column])
                scores[vocab.words.itos[word]] = math.exp(score)
        expected = sorted(scores.items(), key=lambda item: -item[1])[:6]
        assert [t["token"] for t in row["top_k"]] == [word for word, _ in expected]
        assert [t["prob"] for t in row["top_k"]] == pytest.approx([p for _, p in expected],
                                                                   abs=1e-6)  # fmt: skip
        assert len(row["sample"].split()) == 40  # 40 words, some of two codes


def test_sampling_over_lightrnn_codes_draws_only_valid_pairs(coded):
    """The head prefers a column anywhere: unrestricted, most draws would be broken pairs
    (<unk>); restricted, every code follows the one before as the table allows."""
    data, model = coded
    vocab = data.vocab
    ids = torch.tensor([vocab.encode_line("w1 w2", add_eos=False)])
    with torch.no_grad():
        hidden, state = model.backbone(ids)
        codes = model._sample(ids, hidden[:, -1], state, vocab.grammar())
        broken = model._sample(ids, hidden[:, -1], state, None)  # no grammar
    words = vocab.decode_word_ids(codes)
    assert len(words) == 40 and vocab.encode_word_ids(torch.tensor(words)).tolist() == codes
    assert sum(vocab.itos[c].startswith("<row") for c in codes) > 10  # rare words drawn
    unrestricted = vocab.decode_word_ids(broken)
    assert vocab.encode_word_ids(torch.tensor(unrestricted)).tolist() != broken


def test_a_sample_over_bpe_pieces_reads_as_words(tmp_path):
    """``generate_tokens`` draws pieces; the sample joins them into words (no ``▁``
    marker, no space inside a word), as the tokenizer would write the text."""
    from datamodules import LanguageModelingDataModule

    lines = ["the catdog sat on the mat", "a dog met the catalogue"] * 20
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n")
    data = LanguageModelingDataModule(
        path=str(tmp_path),
        vocab="bpe",
        bpe_vocab_size=30,
        predict_prompts=["the cat"],
        cache_dir=str(tmp_path / "c"),
    )
    data.prepare_data()
    data.setup("predict")
    vocab = data.vocab
    torch.manual_seed(0)
    model = LanguageModel(LSTMBackbone(len(vocab), embedding_size=8, hidden_size=8),
                          SoftmaxHead(8, len(vocab)), generate_tokens=60).eval()  # fmt: skip
    ids = torch.tensor([vocab.encode_line("the cat", add_eos=False)])
    with torch.no_grad():
        hidden, state = model.backbone(ids)
        pieces = model._sample(ids, hidden[:, -1], state, None)
    assert len(vocab.decode_words(pieces)) < len(pieces)  # some pieces continue a word
    # reference: the tokenizer's own decoder on each stretch between special tokens
    expected, stretch = [], []
    for i in [*pieces, vocab.eos_id]:
        if i in vocab.special_ids:
            expected += vocab.tokenizer.decode([vocab._theirs[j] for j in stretch]).split()
            expected.append(vocab.itos[i])
            stretch = []
        else:
            stretch.append(i)
    assert vocab.decode_words([*pieces, vocab.eos_id]) == expected
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    ((row,),) = trainer.predict(model, data)
    assert "\u2581" not in row["sample"] and len(row["sample"].split()) <= 60


def test_predict_with_a_transformer_reads_the_last_max_length_tokens(tmp_path):
    """A prompt longer than a Transformer LM's learnt position table, and a sample that runs
    past it: the model reads the last ``max_length`` tokens (what it was built for), so the
    top-k after the long prompt equals the top-k after its last ``max_length`` tokens."""
    from datamodules import LanguageModelingDataModule
    from lightning_modules.backbones import TransformerBackbone

    words = [f"w{i}" for i in range(12)]
    lines = [" ".join(words[(i + j) % 12] for j in range(8)) for i in range(30)]
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n")
    long_prompt = " ".join(words * 3)  # 36 tokens, table of 8
    prompts = [long_prompt, " ".join(words[-8:])]
    data = LanguageModelingDataModule(
        path=str(tmp_path), cache_dir=str(tmp_path / "c"), predict_prompts=prompts
    )
    data.prepare_data()
    data.setup("predict")
    torch.manual_seed(0)
    backbone = TransformerBackbone(data.vocab_size, embedding_size=8, num_heads=2, num_layers=1,
                                   feedforward_size=16, dropout=0.0, max_length=8)  # fmt: skip
    model = LanguageModel(backbone, SoftmaxHead(8, data.vocab_size), predict_top_k=3,
                          generate_tokens=20).eval()  # fmt: skip
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    ((long_row, window_row),) = trainer.predict(model, data)
    assert long_row["top_k"] == window_row["top_k"]
    assert len(long_row["sample"].split()) == 20
