"""``predict`` on a file of mixed lengths: the lines batched sorted by length within windows
(``StreamedWindows``), the translations identical, line for line, to those of the
file-order batching (64 lines a batch) that it replaced, written in the file's order, with
far fewer padded tokens."""

import json
import random

import lightning as L
import pytest
import torch

from app.callbacks import PredictionWriter
from datamodules import TranslationDataModule
from datamodules.errors import DataConfigError
from datamodules.pair_batches import collate_pairs
from heads import SoftmaxHead
from lightning_modules import Translation
from lightning_modules.backbones import Seq2SeqTransformer
from lightning_modules.decoding import DecodeConfig, beam_search, greedy_decode
from tests.datamodules.test_translation import write_corpus

D = 16
# 30 words a side, so that a random model says various things
PAIRS = [(f"s{i % 30} s{i * 7 % 30}", f"t{i % 30} t{i * 11 % 30} t{i % 17}") for i in range(60)]
WORDS = [f"s{i}" for i in range(30)] + ["Schnee", "Wiese"]  # two unknown


def _mixed_sentences(count: int = 60) -> list[str]:
    """Short and long lines in random order, blank and whitespace lines, two lines longer
    than the backbone's position table and the token budget (each a batch of its own)."""
    rng = random.Random(0)
    lines = []
    for i in range(count):
        if i % 13 == 5:
            lines.append("" if i % 2 else "   ")
        else:
            length = rng.choice([1, 2, 3, 4, 6, 9, 14])
            lines.append(" ".join(rng.choice(WORDS) for _ in range(length)))
    lines[20] = " ".join(rng.choice(WORDS) for _ in range(44))
    lines[47] = " ".join(rng.choice(WORDS) for _ in range(36))
    return lines


def _setting(tmp_path, sentences: list[str], beam: int, window: int = 20):
    path = write_corpus(tmp_path, {"train": PAIRS, "val": PAIRS[:3], "test_2016_flickr": PAIRS[:2]})
    data = TranslationDataModule(path=path, max_tokens=40, predict_sentences=sentences,
                                 cache_dir=str(tmp_path / "c"))  # fmt: skip
    data.hparams.predict_window = window  # (set so: the code before it runs this file too)
    torch.manual_seed(0)
    # float64: no batch composition changes a sum enough to flip a choice
    backbone = Seq2SeqTransformer(data.src_vocab_size, data.vocab_size, model_size=D,
                                  num_heads=2, encoder_layers=1, decoder_layers=1,
                                  feedforward_size=32, dropout=0.0, max_length=32)  # fmt: skip
    decode = DecodeConfig(beam_size=beam, max_length_a=0.5, max_length_b=3)
    # no Zipf prior on the bias: <eos>, the most frequent id, would end every beam at once
    head = SoftmaxHead(D, data.vocab_size, zipf_bias_init=False)
    model = Translation(backbone, head, decode=decode)
    return model.double().eval(), data


def _file_order(model: Translation, data: TranslationDataModule, sentences: list[str]):
    """The earlier predict: the lines in file order, 64 a batch, decoded as they come."""
    vocab, eos, out = data.source_vocab, data.bos_id, []
    for start in range(0, len(sentences), 64):
        chunk = sentences[start : start + 64]
        items = [{"source_ids": vocab.encode_line(s), "target_ids": [eos], "index": 0}
                 for s in chunk]  # fmt: skip
        batch = collate_pairs(items, pad_id=eos, bos_id=eos)
        args = (model.backbone, model.head, batch["source"], batch["source_padding"],
                model.decode, eos, data.target_vocab.eos_id)  # fmt: skip
        if model.decode.beam_size == 1:
            hypotheses = greedy_decode(*args)
        else:
            hypotheses = beam_search(*args, beam_size=model.decode.beam_size)
        out += [
            data.detokenize(h) if s.strip() else "" for s, h in zip(chunk, hypotheses, strict=True)
        ]
    return out


@pytest.mark.parametrize("beam", [1, 3])
def test_predict_matches_file_order_batching_line_for_line(tmp_path, capsys, beam):
    sentences = _mixed_sentences()
    model, data = _setting(tmp_path, sentences, beam)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PredictionWriter()])  # fmt: skip
    returned = [row for batch in trainer.predict(model, data) for row in batch]
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = _file_order(model, data, sentences)
    assert any(expected) and len(set(expected)) > 15  # the model says various things
    for rows in (printed, returned):
        assert [r["source"] for r in rows] == sentences  # the file's order
        assert [r["translation"] for r in rows] == expected


def _padded_tokens(batches: list[list[int]]) -> int:
    return sum(len(b) * max(b) - sum(b) for b in batches)


def test_predict_batches_pad_less_than_file_order(tmp_path):
    """The padded source tokens of predict's batches: under a quarter of the file-order
    batching's on mixed lengths; every line once; a window's lines stay in the window."""
    sentences = _mixed_sentences(300)
    _, data = _setting(tmp_path, sentences, beam=1)
    loader = data.predict_dataloader()
    batches = [batch["index"].tolist() for batch in loader]
    lengths = [len(data.source_vocab.encode_line(s)) for s in sentences]
    assert sorted(i for b in batches for i in b) == list(range(len(sentences)))
    padded = _padded_tokens([[lengths[i] for i in b] for b in batches])
    file_order = _padded_tokens([lengths[a : a + 64] for a in range(0, len(lengths), 64)])
    real = sum((~batch["source_padding"]).sum().item() for batch in data.predict_dataloader())
    assert real == sum(lengths)
    assert padded * 4 < file_order, (padded, file_order)
    windows = [{i // 20 for i in b} for b in batches]
    assert all(len(w) == 1 for w in windows)
    assert [min(w) for w in windows] == sorted(min(w) for w in windows)


def test_windowed_batches_plainly():
    """Each window stably sorted by length, cut where ``lines x longest`` passes the budget;
    a line over the budget alone."""
    from datamodules.pair_batches import check_window, window_batches

    # window [5, 2, 9, 2] sorted: 1, 3 (2, 2), 0 (5), 2 (9); then [30, 3, 1, 1]: 2, 3, 1, 0
    assert window_batches([5, 2, 9, 2], max_tokens=10) == [[1, 3], [0], [2]]
    assert window_batches([30, 3, 1, 1], max_tokens=10) == [[2, 3, 1], [0]]
    assert window_batches([1, 1, 1], max_tokens=None, max_lines=2) == [[0, 1], [2]]
    with pytest.raises(DataConfigError, match="predict_window"):
        check_window(0)
