"""Where the text comes from: local files or a Hugging Face hub dataset, read in batches of lines.

A source has named *parts* (``train``, ``valid``, ``test`` for language modelling; ``train.source``,
``train.target``... for translation). Each part is read as batches of lines (a few MiB of text
at a time, never the whole corpus as Python strings) and has an *identity*: what the prepared-data
cache (``datamodules/cache.py``) keys on, so that a changed file gets prepared anew.

Local files are read directly, with the line rules of HuggingFace's ``text`` builder (universal
newlines, one example per ``\\n``-separated line, the line break dropped; tested equal): converting
a 500 MB corpus to Arrow first would cost more than preparing it. Compressed files (``.xz``,
``.gz``, ``.bz2``, by suffix) are read through fsspec's codecs, the ones HuggingFace ``datasets``
reads its own files with, on the same code path. A hub dataset loads through
``datasets.load_dataset`` (network on the first use, HF's Arrow cache after) and is read in Arrow
record batches.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import io
import os
import re
import socket
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

import datasets.config
import huggingface_hub.constants
import pyarrow.compute as pc
from datasets import Dataset, DatasetDict, load_dataset
from datasets.exceptions import DatasetNotFoundError
from datasets.utils import are_progress_bars_disabled, tqdm
from fsspec.compression import compr
from fsspec.utils import infer_compression

from datamodules.errors import DataConfigError, DataFormatError, DataPathError

SPLITS = ("train", "valid", "test")
# The corpora shipped with the project (``corpora/README.md``): the data modules' defaults.
CORPORA = Path(__file__).resolve().parent / "corpora"
# The names users give each split: file-name fragments in a local folder and keys of
# ``data.files`` (the hub calls our ``valid`` ``validation``).
_SPLIT_PATTERNS = {
    "train": ("train",),
    "valid": ("valid", "validation", "val", "dev"),
    "test": ("test",),
}
# Text read per batch: big enough that per-batch overhead vanishes, small enough that the
# batch's words as Python strings stay ~100 MB.
BATCH_BYTES = 4 << 20
# Rows per Arrow batch of a hub dataset.
BATCH_ROWS = 20_000
# Seconds to wait for the hub's host before a hub dataset is read from HF's cache only.
HUB_PROBE_SECONDS = 3.0
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
# Suffixes of the compressed files a local folder may hold (``ptb.train.txt.xz``).
COMPRESSED_SUFFIXES = (".xz", ".gz", ".bz2")
# A file's identity hashes its first and last MiB (plus size and mtime), not all of it: a
# WikiText-103-size file is identified in milliseconds on every launch.
_SAMPLE_BYTES = 1 << 20


def _name_parts(name: str) -> list[str]:
    return re.split(r"[^a-z0-9]+", name.lower())


def require_folder(folder: Path, shipped: str) -> None:
    """Raise the data-path error unless ``folder`` is a folder; ``shipped`` names the corpus the
    data module reads when ``data.path`` is left unset."""
    if not folder.is_dir():
        raise DataPathError(
            f"data path {str(folder)!r} does not exist or is not a folder; set data.path to a "
            f"local folder, data.hub to a Hugging Face dataset name, or leave both unset for "
            f"the shipped {shipped}"
        )


def resolve_file(path: Path) -> Path:
    """``path``, or the one compressed file beside it of that name (``val.de`` ->
    ``val.de.xz``); ``path`` itself when neither exists."""
    if path.exists():
        return path
    packed = [p for p in (path.with_name(path.name + s) for s in COMPRESSED_SUFFIXES) if p.exists()]
    return packed[0] if len(packed) == 1 else path


@contextmanager
def open_text_bytes(path: Path) -> Iterator[tuple[Any, Any]]:
    """``(text bytes, file on disk)``: the decompressed stream of a compressed file (by suffix)
    or the file itself; the second tells how far into the file on disk reading has come."""
    with path.open("rb") as raw:
        codec = infer_compression(str(path))
        if codec is None:
            yield raw, raw
        else:
            with compr[codec](raw, mode="rb") as stream:
                yield stream, raw


def split_files_option(files: dict[str, str] | None) -> dict[str, str]:
    """``data.files`` keyed by our split names: ``validation``, ``val`` and ``dev`` are
    ``valid``; an unknown key, or two keys for one split, is refused rather than ignored."""
    by_alias = {alias: split for split, aliases in _SPLIT_PATTERNS.items() for alias in aliases}
    named: dict[str, str] = {}
    for key, value in (files or {}).items():
        split = by_alias.get(str(key).lower())
        if split is None:
            raise DataConfigError(
                f"data.files has an unknown split {key!r}; use train, valid (or validation, "
                f"val, dev) and test"
            )
        if split in named:
            raise DataConfigError(f"data.files names the {split} split twice ({key!r})")
        named[split] = value
    return named


def find_split_files(
    folder: Path, files: dict[str, str] | None, shipped: str, held_out: float | None = None
) -> dict[str, Path]:
    """Map each split to its file inside ``folder`` (given names, or found by name; a given
    name may leave out a compression suffix). With ``held_out``, a validation or test file
    that is neither named nor found is left out (:class:`HeldOutSplits` cuts it from train)."""
    files = split_files_option(files)
    require_folder(folder, shipped)
    found: dict[str, Path] = {}
    for split in SPLITS:
        if split in files:
            candidate = resolve_file(folder / files[split])
        else:
            matches = sorted(
                p
                for p in folder.iterdir()
                if p.is_file() and set(_name_parts(p.name)) & set(_SPLIT_PATTERNS[split])
            )
            if not matches and held_out is not None and split != "train":
                continue
            if len(matches) != 1:
                hint = ", or hold out a share of the training lines with --data.held_out 0.05"
                if split == "train" or matches:
                    hint = ""
                raise DataPathError(
                    f"cannot find exactly one {split} file in {str(folder)!r} (found "
                    f"{[m.name for m in matches]}); name them with data.files, e.g. "
                    f"{{train: ptb.train.txt, valid: ptb.valid.txt, test: ptb.test.txt}}{hint}"
                )
            candidate = matches[0]
        if not candidate.is_file():
            raise DataPathError(f"{split} file {str(candidate)!r} does not exist")
        if not has_text(candidate):
            raise DataPathError(f"{split} file {str(candidate)!r} is empty")
        found[split] = candidate
    return found


@functools.cache
def _stdin_lines() -> bytes:
    """Standard input's text, read once (a second read of a pipe finds it empty) and checked
    to be UTF-8: kept as its bytes, its lines made a block at a time as predict reads them
    (a tuple of every line as a Python string took several times the text's size)."""
    text = sys.stdin.buffer.read()
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:  # checked in pieces: no string of the whole text
        for start in range(0, len(text), BATCH_BYTES):
            decoder.decode(text[start : start + BATCH_BYTES])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as exc:
        raise DataFormatError(
            f"data.predict_file -: standard input is not UTF-8 text ({exc.reason})"
        ) from exc
    return text


def _stdin_line_batches() -> Iterator[list[str]]:
    """Standard input's lines (:func:`_stdin_lines`), a block of about ``BATCH_BYTES`` at a
    time, cut as the corpora's lines are."""
    first = True
    for block in _blocks(io.BytesIO(_stdin_lines())):
        yield split_text_lines(block.decode("utf-8-sig" if first else "utf-8"))
        first = False


@dataclass(frozen=True)
class PredictInput:
    """What ``predict`` reads, as batches of lines in the input's order, read as they are
    needed (a file a block of about ``BATCH_BYTES`` at a time): ``given`` lines, or those
    of the file ``path``, or of standard input (``stdin``). A second pass reads again."""

    given: tuple[str, ...] = ()
    path: Path | None = None
    stdin: bool = False

    @property
    def name(self) -> str:
        """What the input is, for messages."""
        if self.path is not None:
            return f"data.predict_file {str(self.path)!r}"
        return "standard input" if self.stdin else "the given list"

    def line_batches(self) -> Iterator[list[str]]:
        if self.path is not None:
            yield from TextFiles({"predict": self.path}, label=self.path.name).line_batches(
                "predict"
            )
        elif self.stdin:
            yield from _stdin_line_batches()
        else:
            for start in range(0, len(self.given), BATCH_ROWS):
                yield list(self.given[start : start + BATCH_ROWS])


def predict_input(
    given: list[str] | None, file: str | None, what: str, example: str
) -> PredictInput:
    """What ``predict`` reads: ``data.predict_<what>`` or the lines of ``data.predict_file``
    (UTF-8, plain or compressed, read as the corpora are; ``-``: standard input), one or the
    other; checked now, read as it is used."""
    if given and file:
        raise DataConfigError(
            f"data.predict_{what} and data.predict_file are both set; set one of them"
        )
    if file == "-":  # a pipe: ``cat sentences.de | python cli.py predict ...``
        _stdin_lines()  # (read and checked now: a mistake is said before the model runs)
        return PredictInput(stdin=True)
    if file:
        path = resolve_file(Path(file).expanduser())
        if not path.is_file():
            problem = "is not a file" if path.exists() else "does not exist"
            raise DataPathError(f"data.predict_file {str(path)!r} {problem}")
        return PredictInput(path=path)
    if not given:
        raise DataConfigError(
            f"predict needs {what}: set data.predict_{what}, e.g. --data.predict_{what} "
            f"'[\"{example}\"]', or data.predict_file, a text file of one a line"
        )
    return PredictInput(given=tuple(given))


# byte-order marks of the encodings editors save "Unicode" text in, longest first
_OTHER_UNICODE_MARKS = {
    codecs.BOM_UTF32_LE: "UTF-32",
    codecs.BOM_UTF32_BE: "UTF-32",
    codecs.BOM_UTF16_LE: "UTF-16",
    codecs.BOM_UTF16_BE: "UTF-16",
}


def _not_utf8(what: str, path: Path, detail: str) -> DataFormatError:
    """The error for a file that does not decode, naming its encoding where its first bytes
    are another Unicode encoding's byte-order mark (Windows Notepad's "Unicode" is UTF-16)."""
    with open_text_bytes(path) as (stream, _):
        start = stream.read(4)
    for mark, encoding in _OTHER_UNICODE_MARKS.items():
        if start.startswith(mark):
            return DataFormatError(
                f"{what} is {encoding} text, not UTF-8: save it as UTF-8 (for example "
                f"`iconv -f {encoding} -t UTF-8 FILE > FILE.utf8`)"
            )
    return DataFormatError(f"{what} is not UTF-8 text ({detail})")


def has_text(path: Path) -> bool:
    """Whether any line holds more than whitespace (reads only up to the first such line)."""
    try:
        with open_text_bytes(path) as (stream, _):
            # utf-8-sig: a byte-order mark alone is no text
            return any(line.strip() for line in io.TextIOWrapper(stream, encoding="utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise _not_utf8(repr(str(path)), path, exc.reason) from exc


def file_identity(path: Path) -> dict[str, Any]:
    """Name, size, modification time and a hash of the first and last MiB of a file."""
    stat = path.stat()
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as handle:
        digest.update(handle.read(_SAMPLE_BYTES))
        if stat.st_size > _SAMPLE_BYTES:
            handle.seek(max(_SAMPLE_BYTES, stat.st_size - _SAMPLE_BYTES))
            digest.update(handle.read())
    return {
        "name": path.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sample": digest.hexdigest(),
    }


def _blocks(handle) -> Iterator[bytes]:
    """A binary file in blocks of about ``BATCH_BYTES`` that end at a ``\n`` (or the end of the
    file): no line, ``\r\n`` pair or UTF-8 character is cut in two."""
    while block := handle.read(BATCH_BYTES):
        yield block + handle.readline()


def count_lines(path: Path) -> int:
    """Lines of a text file as :func:`split_text_lines` cuts them, without decoding it."""
    count, last = 0, b"\n"
    with open_text_bytes(path) as (handle, _):
        for block in _blocks(handle):
            if b"\r" in block:
                block = block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def split_text_lines(text: str) -> list[str]:
    """Lines of a decoded block that ends at a line break (or at the end of the file), as the
    ``text`` builder cuts them: ``\\r\\n`` and ``\\r`` are line breaks too (universal newlines),
    only ``\\n`` separates lines after that, and a final line break ends the last line."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines


class TextSource(Protocol):
    """Named parts of text, each read as batches of lines."""

    label: str  # short readable name (cache folder names, log lines)

    def identity(self, part: str) -> dict[str, Any]: ...

    def describe(self, part: str) -> str: ...

    def line_batches(self, part: str, desc: str | None = None) -> Iterator[list[str]]: ...

    def num_lines(self, part: str) -> int: ...


def tokenizers_progress() -> bool:
    """Whether the tokenizers library shows its own bars (BPE training): on a terminal,
    unless HuggingFace's bars are turned off."""
    return sys.stderr.isatty() and not are_progress_bars_disabled()


def _progress(total: int, desc: str | None, unit: str):
    # HuggingFace's tqdm: hidden by HF_DATASETS_DISABLE_PROGRESS_BARS / disable_progress_bars()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=desc is None)


class _LineBatches:
    """What every source builds on its ``line_batches``."""

    def line_batches(self, part: str, desc: str | None = None) -> Iterator[list[str]]:
        raise NotImplementedError

    def lines(self, part: str) -> list[str]:
        """All lines of a part, in order."""
        return [line for batch in self.line_batches(part) for line in batch]


@dataclass(frozen=True)
class TextFiles(_LineBatches):
    """Local UTF-8 text files, one example per line."""

    files: dict[str, Path]
    label: str

    def identity(self, part: str) -> dict[str, Any]:
        return file_identity(self.files[part])

    def describe(self, part: str) -> str:
        return str(self.files[part])

    def num_lines(self, part: str) -> int:
        return count_lines(self.files[part])

    def line_batches(self, part: str, desc: str | None = None) -> Iterator[list[str]]:
        path = self.files[part]
        # the bar counts bytes of the file on disk (compressed files: compressed bytes)
        with (
            open_text_bytes(path) as (handle, raw),
            _progress(path.stat().st_size, desc, "B") as bar,
        ):
            decoded = 0  # text bytes before this block
            for block in _blocks(handle):
                bar.update(raw.tell() - bar.n)
                try:
                    # utf-8-sig at the start: an editor's byte-order mark (Windows Notepad's
                    # UTF-8) is not part of the first word
                    text = block.decode("utf-8-sig" if decoded == 0 else "utf-8")
                except UnicodeDecodeError as exc:
                    raise _not_utf8(
                        f"{part} file {str(path)!r}",
                        path,
                        f"{exc.reason} near byte {decoded + exc.start} of its text",
                    ) from exc
                decoded += len(block)
                yield split_text_lines(text)


@dataclass(frozen=True)
class HubColumns(_LineBatches):
    """Parts of HuggingFace datasets: ``part -> (dataset, column)``, where the column is a
    name or a ``(struct column, field)`` pair (WMT's ``translation: {de: ..., en: ...}``)."""

    parts: dict[str, tuple[Dataset, str | tuple[str, str]]]
    label: str

    def identity(self, part: str) -> dict[str, Any]:
        dataset, column = self.parts[part]
        files = [
            {"name": Path(f["filename"]).name, **_stat(Path(f["filename"]))}
            for f in dataset.cache_files
        ]
        # HF's own fingerprint identifies an in-memory dataset; cache files a loaded one
        return {
            "rows": dataset.num_rows,
            "column": column,
            "files": files or None,
            "fingerprint": None if files else dataset._fingerprint,
        }

    def describe(self, part: str) -> str:
        return f"{self.label} {part}"

    def num_lines(self, part: str) -> int:
        return self.parts[part][0].num_rows

    def line_batches(self, part: str, desc: str | None = None) -> Iterator[list[str]]:
        dataset, column = self.parts[part]
        with _progress(dataset.num_rows, desc, " lines") as bar:
            for table in dataset.with_format("arrow").iter(batch_size=BATCH_ROWS):
                if isinstance(column, str):
                    values = table.column(column)
                else:
                    values = pc.struct_field(table.column(column[0]), column[1])
                rows = values.to_pylist()
                bar.update(len(rows))
                yield [row if row is not None else "" for row in rows]


def check_held_out(held_out: float | None) -> None:
    """``data.held_out``: unset, or a share of the training lines in (0, 0.5)."""
    if held_out is not None and not (isinstance(held_out, float | int) and 0 < held_out < 0.5):
        raise DataConfigError(
            f"data.held_out must be a share of the training lines between 0 and 0.5 (0.05: "
            f"5% for each missing split), got {held_out!r}"
        )


def _split_of(part: str) -> tuple[str, str]:
    """``valid.source`` -> (``valid``, ``.source``); ``valid`` -> (``valid``, ``''``)."""
    split, dot, side = part.partition(".")
    return split, dot + side


@dataclass(frozen=True)
class HeldOutSplits(_LineBatches):
    """A corpus that lacks validation or test text (one file of it, a hub dataset with only a
    ``train`` split): each missing split is ``share`` of the training lines, taken from the
    end of the training text in the order valid, test, and the training split is what comes
    before them. Contiguous blocks, as PTB's and WikiText's splits are: no held-out sentence
    has its neighbours in training. Parts are named as ``source``'s (``valid`` or
    ``valid.source``)."""

    source: TextFiles | HubColumns
    missing: tuple[str, ...]  # the splits cut from the training text, in SPLITS order
    share: float
    # side ("" or ".source") -> the training text's lines, where the caller has counted them
    # already (translation checks its sides align): counted again here, a large corpus's
    # first launch read its training files twice
    counts: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def label(self) -> str:  # (the cache folders of another cut are other entries anyway)
        return self.source.label

    def summary(self) -> str:
        """One line for the log: what was cut."""
        each = " each" if len(self.missing) > 1 else ""
        kept = 100 - self.share * 100 * len(self.missing)
        return (
            f"data.held_out: {' and '.join(self.missing)} are {self.share * 100:.4g}% of the "
            f"training lines{each}, cut from their end; training reads the first {kept:.4g}%"
        )

    def _base(self, part: str) -> str:
        split, side = _split_of(part)
        return f"train{side}" if split == "train" or split in self.missing else part

    def lines_of(self, part: str) -> tuple[int, int] | None:
        """``[first, end)`` of ``part`` in its training text; None where the corpus has it."""
        split, side = _split_of(part)
        if split != "train" and split not in self.missing:
            return None
        counts = self._line_counts
        if side not in counts:  # (one count a side: it reads the whole file)
            counts[side] = self.source.num_lines(f"train{side}")
        total = counts[side]
        each = max(1, round(total * self.share))
        train_end = total - each * len(self.missing)
        if train_end < 1:
            raise DataPathError(
                f"{self.source.describe(f'train{side}')} has {total:,} lines: too few to hold "
                f"out {len(self.missing)} split(s) of {each:,} lines and train on the rest; "
                f"give the {'/'.join(self.missing)} split(s) as files, or more text"
            )
        if split == "train":
            return 0, train_end
        first = train_end + each * self.missing.index(split)
        return first, first + each

    @property
    def _line_counts(self) -> dict[str, int]:  # (a frozen dataclass: counted once, kept here)
        return self.counts

    def identity(self, part: str) -> dict[str, Any]:
        # the training text and the cut; no line count (that would read the file every run)
        identity = self.source.identity(self._base(part))
        split, _ = _split_of(part)
        if split == "train" or split in self.missing:
            identity = {**identity, "held_out": self.share, "missing": list(self.missing)}
            identity["part"] = split
        return identity

    def describe(self, part: str) -> str:
        lines = self.lines_of(part)
        if lines is None:
            return self.source.describe(part)
        return f"{self.source.describe(self._base(part))} (lines {lines[0] + 1:,}-{lines[1]:,})"

    def num_lines(self, part: str) -> int:
        lines = self.lines_of(part)
        return self.source.num_lines(part) if lines is None else lines[1] - lines[0]

    def line_batches(self, part: str, desc: str | None = None) -> Iterator[list[str]]:
        lines = self.lines_of(part)
        if lines is None:
            yield from self.source.line_batches(part, desc)
            return
        first, end = lines
        seen = 0  # lines of the training text before this batch
        for batch in self.source.line_batches(self._base(part), desc):
            if seen + len(batch) > first:
                yield batch[max(first - seen, 0) : end - seen]
            seen += len(batch)
            if seen >= end:
                return


def _stat(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def hub_reachable(timeout: float = HUB_PROBE_SECONDS) -> bool:
    """Whether a connection to the Hugging Face hub's host opens within ``timeout`` (behind a
    proxy, which this cannot see through, the hub is assumed reachable)."""
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return True
    endpoint = urlparse(huggingface_hub.constants.ENDPOINT)
    try:
        with socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout):
            return True
    except OSError:
        return False


@contextmanager
def hf_offline() -> Iterator[None]:
    """HuggingFace's offline mode (``HF_HUB_OFFLINE``) for one load: cached copies only."""
    saved = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved


@dataclass(frozen=True)
class HubDataset:
    """A Hugging Face dataset: ``hub`` is its name (``Salesforce/wikitext``) or a local folder
    in the hub's layout (a downloaded copy), ``name`` its configuration, ``revision`` a branch,
    tag or commit, ``splits`` our split -> theirs (default ``train``/``validation``/``test``)."""

    hub: str
    name: str | None = None
    revision: str | None = None
    splits: dict[str, str] | None = None

    @property
    def label(self) -> str:
        """Readable name for cache folders and log lines."""
        local = Path(self.hub).expanduser()
        base = local.resolve().name if local.is_dir() else self.hub.replace("/", "_")
        return "-".join(part for part in (base, self.name, self.revision) if part)

    def load(self, held_out: float | None = None) -> DatasetDict:
        """Our split names -> the dataset's splits; one-line errors for what cannot load. With
        ``held_out``, a missing validation or test split is left out (cut from train later)."""
        splits = self.splits or {"train": "train", "valid": "validation", "test": "test"}
        # without network huggingface_hub retries for ~25 s: ask its host first, and if it does
        # not answer read HF's cache in offline mode (a copy used before still loads)
        offline = not Path(self.hub).expanduser().is_dir() and not hub_reachable()
        try:
            with hf_offline() if offline else nullcontext():
                raw = load_dataset(self.hub, self.name, revision=self.revision)
        except ConnectionError as exc:  # also HF's offline mode without a cached copy
            raise DataPathError(
                f"cannot load hub dataset {self.hub!r} ({_first_line(exc)}): no network? Point "
                f"data.path at a local folder of train/valid/test text files instead (and "
                f"leave data.hub unset), or data.hub at a downloaded copy of the dataset"
            ) from exc
        except DatasetNotFoundError as exc:
            raise DataPathError(
                f"hub dataset {self.hub!r} not found ({_first_line(exc)}); check data.hub"
            ) from exc
        except ValueError as exc:  # a configuration that is not there, or none given
            raise DataPathError(
                f"hub dataset {self.hub!r}: {_first_line(exc)}; set data.name"
            ) from exc
        missing = [theirs for theirs in splits.values() if theirs not in raw]
        if held_out is not None:
            missing = [
                theirs for ours, theirs in splits.items() if ours == "train" and theirs in missing
            ]
        if missing:
            raise DataPathError(
                f"hub dataset {self.hub!r} has no split(s) {missing} (it has {list(raw)}); "
                f"set data.hub_splits, e.g. {{train: train, valid: validation, test: test}}, "
                f"or hold out a share of the training rows with --data.held_out 0.05"
            )
        return DatasetDict({ours: raw[theirs] for ours, theirs in splits.items() if theirs in raw})


def local_or_hub(
    path: str | None,
    shipped: Path,
    hub: str | None,
    name: str | None,
    revision: str | None,
    hub_splits: dict[str, str] | None,
) -> tuple[Path, HubDataset | None]:
    """The local folder (``path``, or the shipped corpus when unset) and the hub dataset, if
    ``hub`` names one; a data module reads the hub dataset when there is one."""
    if hub is not None and path is not None:
        raise DataConfigError(
            f"data.path ({path!r}) and data.hub ({hub!r}) are both set; set one of them "
            "(local files: add --data.hub null"
            + (" --data.name null" if name is not None else "")
            + ")"
        )
    if hub is None and (name is not None or revision is not None):
        raise DataConfigError("data.name and data.revision need data.hub (a hub dataset name)")
    folder = shipped if path is None else Path(path).expanduser()
    return folder, (None if hub is None else HubDataset(hub, name, revision, hub_splits))


def data_location(folder: Path, hub: HubDataset | None) -> str:
    """``path='...'`` or ``hub='...'`` (with its configuration), for messages."""
    if hub is None:
        return f"path={str(folder)!r}"
    return f"hub={hub.hub!r}" + (f" ({hub.name})" if hub.name else "")


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def with_held_out(
    source: TextFiles | HubColumns,
    present: Iterable[str],
    held_out: float | None,
    where: str,
    counts: dict[str, int] | None = None,
) -> TextFiles | HubColumns | HeldOutSplits:
    """``source``, with the splits it lacks cut from its training text where ``held_out`` is
    set (``present``: the splits it has; ``counts``: the training text's lines by side, ``""``
    or ``".source"``/``".target"``, where the caller has counted them)."""
    missing = tuple(split for split in SPLITS if split not in set(present))
    if held_out is None:
        if missing:  # (a hub_splits mapping that leaves a split out)
            raise DataPathError(
                f"the data at {where} has no {' or '.join(missing)} split: name it with "
                f"data.hub_splits, or cut it from the training text with --data.held_out 0.05"
            )
        return source
    if not missing:
        raise DataConfigError(
            f"data.held_out is set, but the data at {where} has every split: unset it, or "
            f"leave a split out of data.files / data.hub_splits to cut it from train"
        )
    return HeldOutSplits(source, missing, float(held_out), dict(counts or {}))


def text_source(
    path: Path,
    hub: HubDataset | None,
    files: dict[str, str] | None = None,
    text_column: str = "text",
    shipped: str = "Penn Treebank (as configs/data/ptb*.yaml do)",
    held_out: float | None = None,
) -> TextFiles | HubColumns | HeldOutSplits:
    """The three language-modelling splits of a hub dataset or, without one, a local folder
    (splits it lacks cut from the training text with ``held_out``)."""
    check_held_out(held_out)
    if hub is None:
        found = find_split_files(path, files, shipped, held_out)
        source = TextFiles(found, label=path.resolve().name)
        return with_held_out(source, found, held_out, data_location(path, None))
    splits = hub.load(held_out)
    for split, dataset in splits.items():
        if text_column not in dataset.column_names:
            raise DataPathError(
                f"hub dataset {hub.hub!r} ({split}) has no column {text_column!r} (columns: "
                f"{dataset.column_names}); set data.text_column"
            )
    parts = {split: (splits[split], text_column) for split in splits}
    source = HubColumns(parts, label=hub.label)
    return with_held_out(source, splits, held_out, data_location(path, hub))
