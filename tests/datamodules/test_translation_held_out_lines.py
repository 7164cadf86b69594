"""``data.held_out`` on a parallel corpus: the training files' line counts (their alignment
check, which the cut needs) are counted once and kept under the files' identity, not at every
launch (4M pairs: 9 s on every DDP rank); a changed file is counted again and caught."""

import os

import pytest

import datamodules.text_source as text_source
import datamodules.translation as translation
from datamodules import TranslationDataModule
from datamodules.translation import ParallelDataError
from tests.datamodules.test_translation import write_corpus

PAIRS = [(f"de{i % 3}", f"en{i % 4}") for i in range(36)] + [("neu", "new")] * 4


def _counting(monkeypatch) -> list[str]:
    """The files whose lines are counted from now on (by the alignment check or the cut)."""
    counted: list[str] = []
    real = text_source.count_lines

    def count(path):
        counted.append(path.name)
        return real(path)

    monkeypatch.setattr(translation, "count_lines", count)
    monkeypatch.setattr(text_source, "count_lines", count)
    return counted


def test_held_out_line_counts_are_read_once_per_file(tmp_path, monkeypatch):
    path = write_corpus(tmp_path, {"train": PAIRS})
    counted = _counting(monkeypatch)
    cache = str(tmp_path / "c")
    first = TranslationDataModule(path=path, held_out=0.05, cache_dir=cache)
    _ = first.source
    assert sorted(counted) == ["train.de", "train.en"]
    first.setup("fit")  # prepares the corpus (the cut counts the lines it cuts by)
    first.setup("test")
    counted.clear()
    again = TranslationDataModule(path=path, held_out=0.05, cache_dir=cache)  # a new launch
    again.setup("fit")
    again.setup("test")
    assert counted == []
    test = again.encoded("test")
    assert len(test) == 2 and again.source_vocab.decode(test[1]["source_ids"][:-1]) == ["<unk>"]


def test_a_changed_training_file_is_counted_again_and_caught(tmp_path, monkeypatch):
    path = write_corpus(tmp_path, {"train": PAIRS})
    cache = str(tmp_path / "c")
    _ = TranslationDataModule(path=path, held_out=0.05, cache_dir=cache).source
    counted = _counting(monkeypatch)
    target = tmp_path / "train.en"
    stat = target.stat()
    # one line more, the same modification time: the size (and sampled hash) tell it
    target.write_text(target.read_text() + "one more\n")
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ParallelDataError, match="misaligned parallel train files.*41"):
        _ = TranslationDataModule(path=path, held_out=0.05, cache_dir=cache).source
    assert counted == ["train.en"]


def test_cached_line_count_plainly(tmp_path):
    """The count is the file's line count; the same size and time with other text (the
    sampled hash) is counted again; without a folder, counted every time."""
    from datamodules.translation import cached_line_count

    file = tmp_path / "a.txt"
    file.write_text("x\ny\nz")  # no final line break: three lines
    folder = tmp_path / "counts"
    assert cached_line_count(file, folder) == 3
    assert len(list(folder.glob("*.json"))) == 1
    stat = file.stat()
    file.write_text("x\n\n\n\n\n")  # as many bytes, five lines
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert cached_line_count(file, folder) == 5
    assert cached_line_count(file, None) == 5
