"""``predict`` as a user of trained models meets it on a long file: one output per input in
its order (blank and long lines, several batches), and the input words read as ``<unk>``
counted and said once at the end (nothing in the JSON lines says a prompt or a sentence was
read as less than was written)."""

import logging

import lightning as L
import torch

from app.callbacks import PredictionWriter
from datamodules import LanguageModelingDataModule, TranslationDataModule
from heads import SoftmaxHead
from lightning_modules import LanguageModel, Translation
from lightning_modules.backbones import LSTMBackbone, Seq2SeqTransformer
from lightning_modules.decoding import DecodeConfig
from tests.datamodules.test_translation import TINY, write_corpus

D = 16


def _trainer() -> L.Trainer:
    return L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[PredictionWriter()])  # fmt: skip


def _translation(tmp_path, sentences: list[str]) -> tuple[Translation, TranslationDataModule]:
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY[:3], "test_2016_flickr": TINY[:2]})
    data = TranslationDataModule(path=path, max_tokens=12, predict_sentences=sentences)
    torch.manual_seed(0)
    backbone = Seq2SeqTransformer(data.src_vocab_size, data.vocab_size, model_size=D,
                                  num_heads=2, encoder_layers=1, decoder_layers=1,
                                  feedforward_size=32, dropout=0.0)  # fmt: skip
    model = Translation(backbone, SoftmaxHead(D, data.vocab_size),
                        decode=DecodeConfig(beam_size=2, max_length_b=3))  # fmt: skip
    return model, data


def _language_model(
    tmp_path, prompts: list[str]
) -> tuple[LanguageModel, LanguageModelingDataModule]:
    words = [f"w{i}" for i in range(12)]
    lines = [" ".join(words[(i + j) % 12] for j in range(6)) for i in range(20)]
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n")
    data = LanguageModelingDataModule(path=str(tmp_path), cache_dir=str(tmp_path / "c"),
                                      predict_prompts=prompts)  # fmt: skip
    data.prepare_data()
    data.setup("predict")
    torch.manual_seed(0)
    size = data.vocab_size
    model = LanguageModel(LSTMBackbone(size, embedding_size=8, hidden_size=8),
                          SoftmaxHead(8, size), predict_top_k=3)  # fmt: skip
    return model, data


def test_a_translation_file_gets_one_line_per_input_in_its_order(tmp_path, capsys):
    """150 lines (three batches), blank and whitespace lines and one long line among them:
    as many JSON lines as inputs, each naming its own source, the blank ones blank."""
    base = [s for s, _ in TINY[:3]]
    sentences = [base[i % 3] if i % 7 else ("" if i % 2 else "  ") for i in range(150)]
    sentences[100] = " ".join(["ein Hund"] * 60)
    model, data = _translation(tmp_path, sentences)
    rows = [r for batch in _trainer().predict(model.eval(), data) for r in batch]
    printed = capsys.readouterr().out.splitlines()
    assert len(rows) == len(printed) == len(sentences)
    assert [r["source"] for r in rows] == sentences
    assert all(
        r["translation"] == "" for r, s in zip(rows, sentences, strict=True) if not s.strip()
    )


def test_translation_says_how_many_source_words_were_read_as_unk(tmp_path, caplog):
    """5 of the 11 source words are not in the vocabulary (in 2 of the 4 lines): one warning
    line at predict's end says so; with every word known, none."""
    sentences = ["ein Hund", "ein Pferd rennt", "", "zwei Hunde . Schnee Wiese Katzen"]
    model, data = _translation(tmp_path, sentences)
    with caplog.at_level(logging.WARNING):
        _trainer().predict(model.eval(), data)
    said = [r.getMessage() for r in caplog.records if "read as <unk>" in r.getMessage()]
    assert said == [
        "warning: predict: 5 of 11 source tokens (45.45%), in 2 of 4 lines, were read as "
        "<unk> (not in the vocabulary, or written <unk>)"
    ]
    caplog.clear()
    data.hparams.predict_sentences = ["ein Hund", "eine Katze"]
    with caplog.at_level(logging.WARNING):
        _trainer().predict(model.eval(), data)
    assert not [r for r in caplog.records if "read as <unk>" in r.getMessage()]


def test_language_model_says_how_many_prompt_words_were_read_as_unk(tmp_path, caplog):
    """A prompt partly unknown (here 'xyz' in 'w1 xyz w2') is predicted from less than was
    written; the data module warned only of prompts wholly unknown. The run's end counts
    them all: 3 of 6 prompt words in 2 of 3 prompts."""
    model, data = _language_model(tmp_path, ["w1 xyz w2", "w3", "abc def"])
    with caplog.at_level(logging.WARNING):
        rows = [r for batch in _trainer().predict(model.eval(), data) for r in batch]
    assert [r["prompt"] for r in rows] == ["w1 xyz w2", "w3", "abc def"]
    said = [r.getMessage() for r in caplog.records if "read as <unk>" in r.getMessage()]
    assert said == [
        "warning: predict: 3 of 6 prompt tokens (50.00%), in 2 of 3 lines, were read as "
        "<unk> (not in the vocabulary, or written <unk>)"
    ]
