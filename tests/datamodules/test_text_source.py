import os

import pytest
from datasets import load_dataset

import datamodules.text_source as text_source
from datamodules.errors import DataFormatError
from datamodules.text_source import TextFiles, count_lines, file_identity

# Line breaks of every kind, blank and whitespace-only lines, Unicode spaces, a literal <eos>,
# no final line break.
TRICKY = "a b\r\nc\rd  e\n\n \t\nx<eos>y \u00a0z\u2028w\n\u00e9t\u00e9 \x1c end"


@pytest.mark.parametrize("batch_bytes", [3, 1 << 20])
def test_lines_are_the_text_builders(tmp_path, monkeypatch, batch_bytes):
    """The local reader cuts lines as HuggingFace's ``text`` builder does (it replaces it for
    speed), also when its blocks end inside a line or a \\r\\n pair."""
    monkeypatch.setattr(text_source, "BATCH_BYTES", batch_bytes)
    path = tmp_path / "c.txt"
    path.write_bytes(TRICKY.encode())
    expected = load_dataset("text", data_files=str(path), cache_dir=str(tmp_path / "hf"))["train"]
    source = TextFiles({"train": path}, label="c")
    assert source.lines("train") == expected["text"]
    assert count_lines(path) == len(expected)
    path.write_bytes((TRICKY + "\n").encode())  # a final line break adds no line
    assert source.lines("train") == expected["text"] and count_lines(path) == len(expected)


def test_a_file_that_is_not_utf8_is_one_clear_error(tmp_path):
    path = tmp_path / "c.train.txt"
    path.write_bytes(b"fine line\n\xff\xfe broken\n")
    with pytest.raises(DataFormatError, match=r"c.train.txt' is not UTF-8 text"):
        TextFiles({"train": path}, label="c").lines("train")


def test_file_identity_follows_content_and_modification_time(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("x" * 3_000_000)
    first = file_identity(path)
    assert file_identity(path) == first
    with path.open("r+b") as handle:  # same size, a byte changed in the last MiB
        handle.seek(2_999_000)
        handle.write(b"y")
    os.utime(path, ns=(first["mtime_ns"], first["mtime_ns"]))  # even with the old mtime
    assert file_identity(path)["sample"] != first["sample"]
    os.utime(path, ns=(first["mtime_ns"] + 10**9,) * 2)
    assert file_identity(path)["mtime_ns"] != first["mtime_ns"]
