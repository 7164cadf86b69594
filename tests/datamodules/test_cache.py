"""The prepared-data cache through its users: built once, found again, never trusted stale."""

import logging
from pathlib import Path

import numpy as np
import pytest

import datamodules.language_modeling as lm_module
import datamodules.text_source as text_source
from datamodules import LanguageModelingDataModule
from datamodules.cache import CACHE_ENV, CacheEntry, cache_root
from datamodules.vocab import WordVocab


def write_corpus(folder, train="a b c\nb c\nc\n", valid="a c\n", test="b\n"):
    folder.mkdir(parents=True, exist_ok=True)
    for split, text in (("train", train), ("valid", valid), ("test", test)):
        (folder / f"c.{split}.txt").write_text(text)
    return str(folder)


@pytest.fixture
def cache_log(caplog):
    caplog.set_level(logging.INFO, logger="datamodules")

    def lines(kind: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if f"data cache {kind}" in r.getMessage()]

    return lines


def prepared(path, cache, **options) -> LanguageModelingDataModule:
    data = LanguageModelingDataModule(path=path, cache_dir=str(cache), batch_size=1, bptt=2,
                                      eval_batch_size=1, **options)  # fmt: skip
    data.prepare_data()
    return data


def test_a_second_run_reads_the_cache_and_computes_nothing(tmp_path, cache_log, monkeypatch):
    path = write_corpus(tmp_path / "c")
    first = prepared(path, tmp_path / "cache")
    assert len(cache_log("miss")) == 4 and not cache_log("hit")  # vocabulary + 3 splits

    def fail(*args, **kwargs):
        raise AssertionError("recomputed although cached")

    monkeypatch.setattr(lm_module, "count_words", fail)
    for encode in ("encode_batch", "encode_batch_unknown"):
        monkeypatch.setattr(WordVocab, encode, fail)
    second = prepared(path, tmp_path / "cache")
    assert len(cache_log("hit")) == 4 and len(cache_log("miss")) == 4
    assert second.vocab == first.vocab and second.vocab.counts == first.vocab.counts
    for split in ("train", "valid", "test"):
        assert np.array_equal(second.split_tokens(split).numpy(), first.split_tokens(split).numpy())


def test_a_changed_file_or_option_is_prepared_anew(tmp_path, cache_log):
    path, cache = write_corpus(tmp_path / "c"), tmp_path / "cache"
    first = prepared(path, cache)
    other = prepared(path, cache, max_vocab_size=3)  # another option: another entry
    assert other.cache.path != first.cache.path and len(other.vocab) == 3
    assert len(cache_log("miss")) == 8

    (tmp_path / "c" / "c.valid.txt").write_text("c c a\n")  # valid changed: only it
    again = prepared(path, cache)
    assert again.cache.path == first.cache.path
    assert [line.split(":")[1].split(" from")[0] for line in cache_log("hit")[-3:]] == [
        " the word vocabulary of 'c'",
        " train token ids",
        " test token ids",
    ]
    assert "valid token ids" in cache_log("miss")[-1]
    assert again.vocab.decode(again.split_tokens("valid").tolist()) == ["c", "c", "a", "<eos>"]

    (tmp_path / "c" / "c.train.txt").write_text("a b c\nb c\nc\nd d d d d\n")  # train changed
    changed = prepared(path, cache)
    assert changed.cache.path != first.cache.path
    assert changed.vocab.itos[0] == "d" and "d" not in first.vocab.itos


def test_a_failed_preparation_leaves_nothing_to_trust(tmp_path, monkeypatch):
    path, cache = write_corpus(tmp_path / "c"), tmp_path / "cache"
    monkeypatch.setattr(text_source, "BATCH_BYTES", 4)  # a batch per line
    # the language-modelling data module encodes with encode_batch_unknown
    real, calls = WordVocab.encode_batch_unknown, []

    def interrupted(self, lines):
        calls.append(lines)
        if len(calls) == 2:  # killed after a batch was written
            raise KeyboardInterrupt
        return real(self, lines)

    monkeypatch.setattr(WordVocab, "encode_batch_unknown", interrupted)
    data = LanguageModelingDataModule(path=path, cache_dir=str(cache))
    with pytest.raises(KeyboardInterrupt):
        data.split_tokens("train")
    entry = data.cache.path
    assert sorted(p.name for p in entry.iterdir()) == ["key.json", "vocab.json"]  # no ids
    monkeypatch.setattr(WordVocab, "encode_batch_unknown", real)
    fresh = LanguageModelingDataModule(path=path, cache_dir=str(cache))
    assert fresh.split_tokens("train").tolist() == fresh.vocab.encode_line("a b c") + \
        fresh.vocab.encode_line("b c") + fresh.vocab.encode_line("c")  # fmt: skip


def test_a_killed_preparations_temporary_file_is_removed_by_the_next(tmp_path):
    # SIGKILL or SIGTERM runs no `finally`: the part being written stays as a temporary file
    # (400 MB for WikiText-103's training ids), which the next build in the entry removes
    path, cache = write_corpus(tmp_path / "c"), tmp_path / "cache"
    data = LanguageModelingDataModule(path=path, cache_dir=str(cache))
    _ = data.vocab
    orphan = data.cache.path / ".train.ids.0123456789abcdef0123456789abcdef.tmp"
    orphan.write_bytes(b"\0" * 64)
    kept = data.cache.path / "notes.txt"  # not the cache's: left alone
    kept.write_text("mine")
    fresh = LanguageModelingDataModule(path=path, cache_dir=str(cache))
    assert fresh.split_tokens("train").tolist() == fresh.vocab.encode_line("a b c") + \
        fresh.vocab.encode_line("b c") + fresh.vocab.encode_line("c")  # fmt: skip
    assert not orphan.exists() and kept.read_text() == "mine"
    assert not list(data.cache.path.glob(".*"))


def test_cache_location(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env" / "data"
    assert cache_root(str(tmp_path / "option")) == tmp_path / "option"  # data.cache_dir first
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "output-heads" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "output-heads" / "data"
    entry = CacheEntry(tmp_path, "corpus", {"a": 1})
    assert entry.key == CacheEntry(tmp_path, "other label", {"a": 1}).key
    assert entry.key != CacheEntry(tmp_path, "corpus", {"a": 2}).key


def test_an_unwritable_cache_is_one_clear_error(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    data = LanguageModelingDataModule(path=write_corpus(tmp_path / "c"), cache_dir=str(blocked))
    with pytest.raises(lm_module.DataConfigError, match="cannot create the data cache folder"):
        _ = data.vocab_size
