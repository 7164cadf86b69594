"""``predict`` streams its input (``StreamedWindows``): a file is read a block, and encoded a
window, at a time, so a long file is never held whole, for both tasks; the output keeps the
input's order (``InputOrder``), the ``<unk>`` counts stay whole; the window's batching done
plainly."""

import json
import logging

import lightning as L
import pytest

import datamodules.text_source as text_source
from app.callbacks import PredictionWriter
from datamodules import LanguageModelingDataModule
from tests.datamodules.test_translation_predict_order import _file_order, _mixed_sentences, _setting

LINES = 600  # lines of the generated file: ~20 blocks of the shrunken BATCH_BYTES below
WINDOW = 16


def _lines_read(monkeypatch) -> list[int]:
    """Shrinks the file blocks to 256 bytes and counts the lines each block of the predict
    file gives."""
    monkeypatch.setattr(text_source, "BATCH_BYTES", 256)
    read: list[int] = []
    line_batches = text_source.TextFiles.line_batches

    def counted(self, part, desc=None):
        for lines in line_batches(self, part, desc):
            if part == "predict":
                read.append(len(lines))
            yield lines

    monkeypatch.setattr(text_source.TextFiles, "line_batches", counted)
    return read


def _lm(tmp_path, **options) -> LanguageModelingDataModule:
    (tmp_path / "corpus").mkdir()
    for split in ("train", "valid", "test"):
        (tmp_path / "corpus" / f"{split}.txt").write_text("a b c d\nb c d a\n" * 10)
    return LanguageModelingDataModule(path=str(tmp_path / "corpus"),
                                      cache_dir=str(tmp_path / "c"), **options)  # fmt: skip


def test_lm_predict_reads_a_long_file_a_window_at_a_time(tmp_path, monkeypatch):
    """The first batch comes after a window and a block of the file, not the whole file;
    every line comes once, in windows; the file's lines, in order, by ``input_lines``."""
    lines = [" ".join("abcd"[(i + j) % 4] for j in range(1 + i % 7)) for i in range(LINES)]
    (tmp_path / "prompts.txt").write_text("\n".join(lines) + "\n")
    data = _lm(tmp_path, predict_file=str(tmp_path / "prompts.txt"), predict_batch_size=4,
               predict_window=WINDOW)  # fmt: skip
    read = _lines_read(monkeypatch)
    batches = iter(data.predict_dataloader())
    first = next(batches)
    assert 0 < sum(read) <= 2 * WINDOW + max(read), read  # (one batch read ahead)
    seen = first["input_lines"] + [i for b in batches for i in b["input_lines"]]
    assert sum(read) == LINES and len(read) > 10
    assert sorted(seen) == list(range(LINES))
    assert all(min(seen[a : a + 4]) // WINDOW == max(seen[a : a + 4]) // WINDOW
               for a in range(0, LINES, 4))  # fmt: skip


def test_translation_predict_reads_a_long_file_a_window_at_a_time(tmp_path, monkeypatch):
    """The same for translation, whose translations then come out in the file's order,
    each the one of the sorted batching over the whole file (line for line)."""
    sentences = _mixed_sentences(120)
    model, data = _setting(tmp_path, sentences, beam=1, window=WINDOW)
    path = tmp_path / "sources.txt"
    path.write_text("".join(s + "\n" for s in sentences))
    data.hparams.predict_sentences, data.hparams.predict_file = None, str(path)
    read = _lines_read(monkeypatch)
    next(iter(data.predict_dataloader()))
    assert 0 < sum(read) <= 2 * WINDOW + max(read), read
    read.clear()
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    rows = [row for batch in trainer.predict(model, data) for row in batch]
    assert sum(read) == len(sentences)
    assert [r["source"] for r in rows] == sentences
    assert [r["translation"] for r in rows] == _file_order(model, data, sentences)


def test_translation_limited_predict_writes_what_it_translated_in_order(tmp_path, capsys):
    """``limit_predict_batches`` ends the run inside a window: the last batch run writes
    every translation held back, in the input's order, and the ``<unk>`` line counts the
    lines translated."""
    sentences = _mixed_sentences(60)
    model, data = _setting(tmp_path, sentences, beam=1, window=20)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PredictionWriter()], limit_predict_batches=3)  # fmt: skip
    trainer.predict(model, data)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    batches = [b["input_lines"] for b in list(data.predict_dataloader())[:3]]
    done = sorted(i for b in batches for i in b)
    assert [r["source"] for r in printed] == [sentences[i] for i in done]
    assert model._unknown.total_lines == len(done)


def test_window_batches_plainly():
    """Sorted by length (stable), cut by the token budget, then into ``max_lines``."""
    from datamodules.pair_batches import window_batches

    lengths = [5, 2, 9, 2, 3, 1, 1]
    assert window_batches(lengths, None, 3) == [[5, 6, 1], [3, 4, 0], [2]]
    # 1 1 2 2 (4 x 2), 3 5 (2 x 5), 9
    assert window_batches(lengths, 10, None) == [[5, 6, 1, 3], [4, 0], [2]]
    assert window_batches(lengths, 10, 2) == [[5, 6], [1, 3], [4, 0], [2]]
    assert window_batches([], None, 3) == []


def test_streamed_windows_and_input_order_plainly():
    """Windows cut across the input's blocks; each batch numbered by input line; the last
    batch marked; the results put back in the input's order as soon as they continue it."""
    from datamodules.pair_batches import InputOrder, StreamedWindows

    blocks = [["aaa", "b"], ["cc", "dddd", "e", "ff"], ["g"]]
    stream = StreamedWindows(lambda: iter(blocks),
                             lambda lines: (lines, [len(s) for s in lines]),
                             lambda items, lines, numbers: {"lines": lines},
                             window=3, max_lines=2)  # fmt: skip
    batches = list(stream)
    assert [b["input_lines"] for b in batches] == [[1, 2], [0], [4, 5], [3], [6]]
    assert [b["lines"] for b in batches] == [["b", "cc"], ["aaa"], ["e", "ff"], ["dddd"], ["g"]]
    assert [b["last"] for b in batches] == [False] * 4 + [True]
    order = InputOrder()
    out = [order.put(b["input_lines"], b["lines"], b["last"]) for b in batches]
    assert out == [[], ["aaa", "b", "cc"], [], ["dddd", "e", "ff"], ["g"]]
    assert order.put([2, 5], ["x", "y"], last=True) == ["x", "y"]  # (a limited run's end)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_an_empty_or_blank_file(tmp_path, caplog, content):
    """An empty file gives no batch, and says so (it ended the run without a word); blank
    lines are prompts of <eos> alone, each answered."""
    (tmp_path / "p.txt").write_bytes(content)
    data = _lm(tmp_path, predict_file=str(tmp_path / "p.txt"))
    with caplog.at_level(logging.WARNING):
        batches = list(data.predict_dataloader())
    assert sum(len(b["prompt"]) for b in batches) == content.count(b"\n")
    said = [r.getMessage() for r in caplog.records if "nothing to predict" in r.getMessage()]
    assert said == ([f"warning: predict: data.predict_file {str(tmp_path / 'p.txt')!r} has no "
                     "line: nothing to predict"] if not content else [])  # fmt: skip
