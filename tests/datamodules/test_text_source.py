import bz2
import gzip
import lzma
import os
import time
from pathlib import Path

import datasets.config
import huggingface_hub.constants
import pytest
from datasets import Dataset, load_dataset

import datamodules.text_source as text_source
from datamodules.errors import DataConfigError, DataFormatError, DataPathError
from datamodules.text_source import (
    HubDataset,
    TextFiles,
    count_lines,
    file_identity,
    find_split_files,
    has_text,
    local_or_hub,
    resolve_file,
)

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


@pytest.mark.parametrize("batch_bytes", [3, 1 << 20])
def test_a_byte_order_mark_is_not_part_of_the_first_word(tmp_path, monkeypatch, batch_bytes):
    """Windows editors start UTF-8 files with U+FEFF; read as text it would make the first
    word a vocabulary entry of its own ('\\ufeffthe' beside 'the'). A mark later in the file
    is text and stays."""
    monkeypatch.setattr(text_source, "BATCH_BYTES", batch_bytes)
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_bytes(TRICKY.encode())
    marked.write_bytes(("\ufeff" + TRICKY + "\n\ufeffb").encode())
    lines = TextFiles({"train": marked}, label="c").lines("train")
    assert lines == [*TextFiles({"train": plain}, label="c").lines("train"), "\ufeffb"]
    assert count_lines(marked) == len(lines)
    (tmp_path / "mark_only.txt").write_bytes("\ufeff\n \n".encode())
    assert not has_text(tmp_path / "mark_only.txt")


def test_a_file_that_is_not_utf8_is_one_clear_error(tmp_path):
    path = tmp_path / "c.train.txt"
    path.write_bytes(b"fine line\n\xff\xfe broken\n")
    with pytest.raises(DataFormatError, match=r"c.train.txt' is not UTF-8 text"):
        TextFiles({"train": path}, label="c").lines("train")


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_a_utf16_or_utf32_file_is_named_with_the_fix(tmp_path, encoding):
    """Windows Notepad's "Unicode" is UTF-16 with a byte-order mark: the error names it."""
    path = tmp_path / "c.train.txt"
    text = "a b\nc d\n"
    path.write_bytes(("\ufeff" + text if encoding.endswith("-be") else text).encode(encoding))
    name = encoding.split("-be")[0].upper()
    fix = rf"c.train.txt' is {name} text, not UTF-8: save it as UTF-8 \(.*`iconv -f {name} "
    with pytest.raises(DataFormatError, match=fix):
        has_text(path)
    with pytest.raises(DataFormatError, match=fix):
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


# -- compressed files: one code path, the same lines ---------------------------------------------
COMPRESSORS = {".xz": lzma.compress, ".gz": gzip.compress, ".bz2": bz2.compress}


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
@pytest.mark.parametrize("batch_bytes", [3, 1 << 20])
def test_compressed_files_read_as_their_text(tmp_path, monkeypatch, suffix, batch_bytes):
    monkeypatch.setattr(text_source, "BATCH_BYTES", batch_bytes)
    plain = tmp_path / "c.txt"
    plain.write_bytes(TRICKY.encode())
    packed = tmp_path / f"c.txt{suffix}"
    packed.write_bytes(COMPRESSORS[suffix](TRICKY.encode()))
    expected = TextFiles({"train": plain}, label="c").lines("train")
    assert TextFiles({"train": packed}, label="c").lines("train") == expected
    assert count_lines(packed) == count_lines(plain) == len(expected)
    assert has_text(packed)
    assert resolve_file(tmp_path / "c.txt") == plain  # the plain file when it is there
    plain.unlink()
    assert resolve_file(tmp_path / "c.txt") == packed


def test_compressed_blank_and_broken_files_are_one_clear_error(tmp_path):
    blank = tmp_path / "blank.txt.xz"
    blank.write_bytes(lzma.compress(b"\n \n\t\n"))
    assert not has_text(blank)
    broken = tmp_path / "c.train.txt.gz"
    broken.write_bytes(gzip.compress(b"fine line\n\xff\xfe broken\n"))
    with pytest.raises(DataFormatError, match=r"c.train.txt.gz' is not UTF-8 text"):
        TextFiles({"train": broken}, label="c").lines("train")


def test_split_files_are_found_compressed_and_by_given_names(tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"c.{split}.txt.xz").write_bytes(lzma.compress(b"a b\n"))
    found = find_split_files(tmp_path, None, shipped="PTB")
    assert found["valid"].name == "c.valid.txt.xz"
    named = find_split_files(tmp_path, {"test": "c.test.txt"}, shipped="PTB")  # suffix left out
    assert named["test"].name == "c.test.txt.xz"
    with pytest.raises(DataPathError, match="leave both unset for the shipped PTB$"):
        find_split_files(tmp_path / "nope", None, shipped="PTB")


# -- hub datasets: loaded through datasets.load_dataset, as from the hub ----------------------
def write_hub_layout(folder: Path, configs: dict[str, dict[str, list[str]]]) -> str:
    """A dataset repository as the hub lays it out (WikiText's ``Salesforce/wikitext``): per
    configuration a folder of ``<split>-00000-of-00001.parquet`` files with a ``text`` column,
    and the README's YAML header that names the configurations and their files."""
    header = ["---", "configs:"]
    for config, splits in configs.items():
        (folder / config).mkdir(parents=True)
        header += [f"- config_name: {config}", "  data_files:"]
        for split, rows in splits.items():
            Dataset.from_dict({"text": rows}).to_parquet(
                str(folder / config / f"{split}-00000-of-00001.parquet")
            )
            header += [f"  - split: {split}", f"    path: {config}/{split}-*"]
    (folder / "README.md").write_text("\n".join([*header, "---", "# a test dataset", ""]))
    return str(folder)


WIKI_ROWS = ["", " = Valkyria Chronicles = \n", "", " the <unk> game , released in N .\n"]


def test_hub_layout_loads_by_name_revision_and_splits(tmp_path, monkeypatch):
    folder = write_hub_layout(
        tmp_path / "wikitext",
        {"wikitext-2-v1": {s: WIKI_ROWS for s in ("train", "validation", "test")}},
    )
    seen = []

    def recording_load(hub, name, revision):
        seen.append((hub, name, revision))
        return load_dataset(hub, name, revision=revision, cache_dir=str(tmp_path / "hf"))

    monkeypatch.setattr(text_source, "load_dataset", recording_load)
    hub = HubDataset(folder, "wikitext-2-v1", revision="main")
    splits = hub.load()
    assert seen == [(folder, "wikitext-2-v1", "main")]
    assert list(splits) == ["train", "valid", "test"]
    assert splits["valid"]["text"] == WIKI_ROWS
    assert hub.label == "wikitext-wikitext-2-v1-main"
    source = text_source.text_source(tmp_path, hub)
    assert source.lines("test") == WIKI_ROWS
    with pytest.raises(DataPathError, match=r"no split\(s\) \['dev'\] .*set data.hub_splits"):
        HubDataset(folder, "wikitext-2-v1", splits={"valid": "dev"}).load()
    with pytest.raises(DataPathError, match=r"\(train\) has no column 'line'.*data.text_column"):
        text_source.text_source(tmp_path, hub, text_column="line")
    with pytest.raises(DataPathError, match=r"'wikitext-3-v1'.*; set data.name$"):
        HubDataset(folder, "wikitext-3-v1").load()


def no_network(monkeypatch) -> None:
    """A machine whose connections fail at once (as DNS does without network)."""

    def refuse(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(text_source.socket, "create_connection", refuse)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_an_unreachable_hub_fails_fast_and_says_how_to_use_local_files(monkeypatch):
    """No answer from the hub's host: HF's cache is read in offline mode (no ~25 s of
    retries), and with nothing cached the error is one line naming the way out."""
    no_network(monkeypatch)
    assert not text_source.hub_reachable()
    modes = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    start = time.perf_counter()
    with pytest.raises(DataPathError) as error:
        HubDataset("someone/never-cached-corpus", "v1").load()
    assert time.perf_counter() - start < 10
    message = str(error.value)
    assert message.startswith("cannot load hub dataset 'someone/never-cached-corpus' (")
    assert "OfflineModeIsEnabled" in message and "Point data.path at a local folder" in message
    assert "\n" not in message
    # offline for that one load only
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == modes


def test_behind_a_proxy_the_hub_is_tried(monkeypatch):
    no_network(monkeypatch)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert text_source.hub_reachable()


def test_path_and_hub_are_one_or_the_other(tmp_path):
    shipped = tmp_path / "shipped"
    assert local_or_hub(None, shipped, None, None, None, None) == (shipped, None)
    folder, hub = local_or_hub(None, shipped, "a/b", "c", "v2", {"train": "t"})
    assert hub == HubDataset("a/b", "c", "v2", {"train": "t"})
    with pytest.raises(
        DataConfigError, match=r"set one of them \(local files: add --data.hub null\)"
    ):
        local_or_hub(str(tmp_path), shipped, "a/b", None, None, None)
    # a config that names the hub's configuration too (configs/data/wikitext103.yaml)
    with pytest.raises(DataConfigError, match="--data.hub null --data.name null"):
        local_or_hub(str(tmp_path), shipped, "a/b", "c", None, None)
    with pytest.raises(DataConfigError, match="need data.hub"):
        local_or_hub(None, shipped, None, "wikitext-2-v1", None, None)


@pytest.mark.parametrize("spelling", ["valid", "validation", "val", "dev"])
def test_each_spelling_of_the_validation_split_is_found_by_file_name(tmp_path, spelling):
    for name in ("train", spelling, "test"):
        (tmp_path / f"{name}.txt").write_text("a b\n")
    assert find_split_files(tmp_path, None, "PTB")["valid"] == tmp_path / f"{spelling}.txt"


@pytest.mark.parametrize("key", ["valid", "validation", "val", "dev", "Validation"])
def test_each_spelling_of_the_validation_split_is_a_files_key(tmp_path, key):
    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.txt").write_text("a b\n")
    files = {"train": "a.txt", key: "b.txt", "test": "c.txt"}
    found = find_split_files(tmp_path, files, "PTB")
    assert found == {"train": tmp_path / "a.txt", "valid": tmp_path / "b.txt",
                     "test": tmp_path / "c.txt"}  # fmt: skip


def test_an_unknown_files_key_is_refused_naming_the_accepted_ones(tmp_path):
    (tmp_path / "a.txt").write_text("a b\n")
    with pytest.raises(DataConfigError) as raised:
        find_split_files(tmp_path, {"train": "a.txt", "eval": "a.txt", "test": "a.txt"}, "PTB")
    assert str(raised.value) == (
        "data.files has an unknown split 'eval'; use train, valid (or validation, val, dev) "
        "and test"
    )
    with pytest.raises(DataConfigError, match="names the valid split twice"):
        find_split_files(tmp_path, {"valid": "a.txt", "dev": "a.txt"}, "PTB")


def _numbered(path: Path, count: int) -> list[str]:
    lines = [f"line {i} of {count}" for i in range(count)]
    path.write_text("\n".join(lines) + "\n")
    return lines


@pytest.mark.parametrize("batch_bytes", [3, 1 << 20])
def test_held_out_splits_are_contiguous_blocks_cut_from_the_end_of_train(
    tmp_path, monkeypatch, batch_bytes
):
    """One training file, ``held_out`` 0.1: valid and test are its last two blocks of 10% of
    the lines, training the 80% before them; read in blocks that cut lines too."""
    monkeypatch.setattr(text_source, "BATCH_BYTES", batch_bytes)
    counted = []  # the training file's lines are counted once, however many splits are read
    count = text_source.count_lines
    monkeypatch.setattr(text_source, "count_lines", lambda p: counted.append(p) or count(p))
    lines = _numbered(tmp_path / "corpus.train.txt", 103)
    with pytest.raises(DataPathError, match=r"valid file .*or hold out .* --data.held_out 0.05"):
        text_source.text_source(tmp_path, None)
    source = text_source.text_source(tmp_path, None, held_out=0.1)
    assert source.lines("train") == lines[:83]
    assert source.lines("valid") == lines[83:93]
    assert source.lines("test") == lines[93:]
    assert [source.num_lines(s) for s in ("train", "valid", "test")] == [83, 10, 10]
    assert source.describe("valid").endswith("corpus.train.txt (lines 84-93)")
    assert "valid and test are 10% of the training lines each" in source.summary()
    # each split, and each cut, is its own cache identity (the file's alone is none of them)
    plain = file_identity(tmp_path / "corpus.train.txt")
    identities = [source.identity(s) for s in ("train", "valid", "test")]
    identities.append(text_source.text_source(tmp_path, None, held_out=0.2).identity("train"))
    assert len({repr(sorted(i.items())) for i in [plain, *identities]}) == 5
    assert len(counted) == 1


def test_only_the_missing_split_is_held_out(tmp_path):
    lines = _numbered(tmp_path / "train.txt", 40)
    valid = _numbered(tmp_path / "valid.txt", 7)
    source = text_source.text_source(tmp_path, None, held_out=0.25)
    assert source.lines("valid") == valid
    assert source.lines("train") == lines[:30] and source.lines("test") == lines[30:]
    assert source.identity("valid") == file_identity(tmp_path / "valid.txt")


def test_held_out_refuses_what_cannot_work(tmp_path):
    _numbered(tmp_path / "train.txt", 3)
    for share in (0, 0.5, -0.1, "a"):
        with pytest.raises(DataConfigError, match="data.held_out must be a share .* got"):
            text_source.text_source(tmp_path, None, held_out=share)
    source = text_source.text_source(tmp_path, None, held_out=0.4)  # 1 line each: 1 left
    assert source.lines("train") == ["line 0 of 3"]
    _numbered(tmp_path / "train.txt", 2)
    source = text_source.text_source(tmp_path, None, held_out=0.4)
    with pytest.raises(DataPathError, match=r"has 2 lines: too few to hold out 2 split\(s\)"):
        source.lines("train")
    _numbered(tmp_path / "valid.txt", 2)
    _numbered(tmp_path / "test.txt", 2)
    with pytest.raises(DataConfigError, match="data.held_out is set, but .* has every split"):
        text_source.text_source(tmp_path, None, held_out=0.1)


def test_a_hub_dataset_with_only_a_training_split_is_cut_with_held_out(tmp_path, monkeypatch):
    rows = [f"row {i}" for i in range(20)]
    folder = write_hub_layout(tmp_path / "one", {"default": {"train": rows}})
    monkeypatch.setattr(
        text_source,
        "load_dataset",
        lambda hub, name, revision: load_dataset(hub, name, cache_dir=str(tmp_path / "hf")),
    )
    hub = HubDataset(folder, "default")
    with pytest.raises(DataPathError, match=r"no split\(s\) \['validation', 'test'\].*held_out"):
        hub.load()
    partial = HubDataset(folder, "default", splits={"train": "train"})
    with pytest.raises(DataPathError, match=r"has no valid or test split: .*data.held_out"):
        text_source.text_source(tmp_path, partial)
    source = text_source.text_source(tmp_path, hub, held_out=0.25)
    assert source.lines("train") == rows[:10]
    assert source.lines("valid") == rows[10:15] and source.lines("test") == rows[15:]
