"""Prepared corpora on disk: vocabularies and int32 token ids, built once, memory-mapped after.

As ``fairseq-preprocess`` binarises a corpus once and every training run memory-maps the result,
a data module prepares its corpus into a cache *entry*: a folder keyed by the identity of the
data (file sizes, modification times and sampled hashes, or a hub dataset's cache files) and by
the options that change the result (vocabulary type and sizes, tokenizers version, this module's
format version). A changed file or option gives another key, hence a new entry; nothing is ever
rebuilt in place.

An entry holds ``vocab.json`` (the vocabulary's ``state_dict``) and, per part (a split, or a
split's side), ``<part>.ids`` (raw little-endian int32, one stream) with ``<part>.json``
(counts, such as the tokens that became ``<unk>``; written last, so its presence means the part
is complete). Files are written under
temporary names and renamed into place, and each build runs under a file lock (``filelock``,
which ``datasets`` ships): ranks that start together wait for the first one's build and then
read it, and a killed build leaves no half-written file that a later run would trust.

Where: ``data.cache_dir``, else ``data/`` below the project's cache root (``heads/user_cache.py``:
``$OUTPUT_HEADS_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/output-heads``). Entries are never
deleted automatically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from filelock import FileLock, Timeout

from datamodules.errors import DataCacheError, DataConfigError
from heads.user_cache import CACHE_ENV
from heads.user_cache import cache_root as user_cache_root

log = logging.getLogger(__name__)

# The splits each Trainer entry point reads: ``test`` never touches the training split.
STAGE_SPLITS = {
    "fit": ("train", "valid"),
    "validate": ("valid",),
    "test": ("test",),
    "predict": (),
}
ALL_SPLITS = ("train", "valid", "test")

# Bump when what an entry holds, or how it is computed, changes: old entries are then ignored.
FORMAT_VERSION = 3  # 2: a text file's byte-order mark dropped; 3: BPE <unk_char>, spaces
IDS_DTYPE = np.dtype("<i4")
# Ids re-mapped at a time (:meth:`CacheEntry.remap`).
_REMAP_CHUNK = 1 << 24
# Ends the name of a file being written (:meth:`CacheEntry._atomic`).
_TEMP_SUFFIX = ".tmp"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder that holds the entries (see the module docstring)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return user_cache_root("data")


def vocab_options(
    level: str, bpe_vocab_size: int, max_vocab_size: int | None, min_freq: int = 1
) -> dict[str, Any]:
    """The vocabulary options a cache entry is keyed by: ``level`` ``bpe`` (size, tokenizers
    version) or ``word`` (maximum size, and the minimum count when it is not 1)."""
    if level == "bpe":
        return {"type": "bpe", "size": bpe_vocab_size, "tokenizers": tokenizers.__version__}
    options: dict[str, Any] = {"type": "word", "max_size": max_vocab_size}
    if min_freq != 1:  # keyed only when set: the default keeps the entries made before it
        options["min_freq"] = min_freq
    return options


def check_min_freq(min_freq: int, vocab: str) -> None:
    """Raises ``DataConfigError`` for a ``data.min_freq`` that cannot work: below 1, or set
    (not 1) for a BPE vocabulary, which it does not apply to (BPE has no ``<unk>`` words)."""
    if isinstance(min_freq, bool) or not isinstance(min_freq, int) or min_freq < 1:
        raise DataConfigError(f"data.min_freq must be an integer >= 1, got {min_freq!r}")
    if vocab == "bpe" and min_freq != 1:
        raise DataConfigError(
            f"data.min_freq={min_freq} applies to word vocabularies (data.vocab word or "
            "hybrid_lightrnn); a BPE vocabulary is sized by data.bpe_vocab_size"
        )


def min_freq_text(min_freq: int) -> str:
    """The minimum count for a vocabulary log line ("" for the default 1)."""
    if min_freq == 1:
        return ""
    return f" (data.min_freq={min_freq}: words seen under {min_freq} times in training are <unk>)"


class SourceIdentities:
    """For a data module with a ``source`` (``datamodules/text_source.py``) and an
    ``_identity`` dict: each part's identity, read once."""

    source: Any
    _identity: dict[str, dict[str, Any]]

    def _identity_of(self, part: str) -> dict[str, Any]:
        """As the entry's JSON gives it back (a hub's ``("translation", "de")`` column reads
        back a list, which never equalled the tuple: every run re-tokenised every part)."""
        if part not in self._identity:
            self._identity[part] = json.loads(json.dumps(self.source.identity(part)))
        return self._identity[part]


def splits_to_prepare(trainer: Any, stage: str | None = None) -> tuple[str, ...]:
    """The splits a run reads: those of ``stage`` (``setup``'s argument), else of the trainer's
    entry point (``prepare_data`` has no argument), else all three (no trainer)."""
    if stage is None and trainer is not None and trainer.state.fn is not None:
        stage = trainer.state.fn.value
    return STAGE_SPLITS.get(stage, ALL_SPLITS) if stage else ALL_SPLITS


def process_rank() -> int | None:
    """This process's rank when a launcher said so (as Lightning reads it), else None."""
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return None


def _say(message: str, *args: Any) -> None:
    rank = process_rank()
    log.info(("" if rank is None else f"[rank {rank}] ") + message, *args)


class CacheEntry:
    """One prepared corpus: a folder of vocabulary and token files (see the module docstring).

    Args:
        root: the cache folder (:func:`cache_root`).
        label: a readable name (the corpus), the start of the folder's name.
        material: everything the content depends on (JSON-serialisable); its hash ends the
            folder's name.
    """

    def __init__(self, root: Path, label: str, material: dict[str, Any]) -> None:
        self.material = {"format": FORMAT_VERSION, **material}
        text = json.dumps(self.material, sort_keys=True, default=str)
        self.key = hashlib.sha256(text.encode()).hexdigest()[:16]
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:60] or "corpus"
        self.root = root
        self.path = root / f"{safe}-{self.key}"

    # -- reading --------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    def has_ids(self, part: str) -> bool:
        """``part``'s ids are complete (the count file is written last)."""
        if not self.has(f"{part}.json"):
            return False
        meta = self.read_json(f"{part}.json")
        ids = self.path / f"{part}.ids"
        return ids.is_file() and ids.stat().st_size == meta["tokens"] * IDS_DTYPE.itemsize

    def read_json(self, name: str) -> Any:
        return json.loads((self.path / name).read_text())

    def ids(self, part: str) -> np.ndarray:
        """``part``'s token ids, memory-mapped (int32): pages are read when touched and shared
        with every other process that maps the file. Copy-on-write, so torch can wrap it
        (a read-only map would warn), but nothing here writes to it."""
        count = self.read_json(f"{part}.json")["tokens"]
        if count == 0:
            return np.empty(0, dtype=IDS_DTYPE)
        return np.memmap(self.path / f"{part}.ids", dtype=IDS_DTYPE, mode="c", shape=(count,))

    def offsets(self, part: str) -> np.ndarray:
        """Start of each line of ``part`` in its ids, and the end (``lines + 1`` int64)."""
        return np.load(self.path / f"{part}.offsets.npy", mmap_mode="r")

    # -- writing ----------------------------------------------------------------------------
    def _make_folder(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DataCacheError(
                f"cannot create the data cache folder {str(self.path)!r} ({exc.strerror}); set "
                f"data.cache_dir or ${CACHE_ENV} to a writable folder"
            ) from exc
        if not os.access(self.path, os.W_OK):
            raise DataCacheError(
                f"the data cache folder {str(self.path)!r} is not writable; set data.cache_dir "
                f"or ${CACHE_ENV} to a writable folder"
            )

    @contextmanager
    def _atomic(self, name: str) -> Iterator[Path]:
        """A temporary path that becomes ``name`` if the block succeeds (removed otherwise)."""
        temp = self.path / f".{name}.{uuid.uuid4().hex}{_TEMP_SUFFIX}"
        try:
            yield temp
            os.replace(temp, self.path / name)
        finally:
            temp.unlink(missing_ok=True)

    def write_json(self, name: str, value: Any) -> None:
        with self._atomic(name) as temp:
            temp.write_text(json.dumps(value))

    def write_ids(
        self,
        part: str,
        chunks: Iterable[np.ndarray | tuple[np.ndarray, np.ndarray]],
        offsets: np.ndarray | None = None,
        counted: Callable[[], dict[str, Any]] | None = None,
        **meta: Any,
    ) -> int:
        """Write a part's ids from int32 chunks, then its count file (``meta`` goes in it too,
        and ``counted()``: what the chunks' producer counted while they were consumed, e.g.
        unknown words). Chunks given as ``(ids, line_lengths)``, or ``offsets``, also store
        where each line starts (:meth:`offsets`). Returns the number of ids."""
        count, lengths = 0, []
        with self._atomic(f"{part}.ids") as temp:
            with temp.open("wb") as out:
                for chunk in chunks:
                    if isinstance(chunk, tuple):
                        chunk, line_lengths = chunk
                        lengths.append(np.asarray(line_lengths, dtype=np.int64))
                    out.write(np.ascontiguousarray(chunk, dtype=IDS_DTYPE).tobytes())
                    count += len(chunk)
            if lengths:
                offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))])
            if offsets is not None:
                if offsets[-1] != count:
                    raise AssertionError(f"{part}: line offsets end at {offsets[-1]}, not {count}")
                with self._atomic(f"{part}.offsets.npy") as offsets_temp:
                    with offsets_temp.open("wb") as handle:
                        np.save(handle, np.asarray(offsets, dtype=np.int64))
                meta["lines"] = len(offsets) - 1
        if counted is not None:
            meta.update(counted())
        self.write_json(f"{part}.json", {"tokens": count, **meta})
        return count

    def remap(
        self, temp: str, part: str, mapping: Callable[[np.ndarray], np.ndarray], **meta: Any
    ) -> int:
        """Write ``part`` as ``mapping`` of the temporary part ``temp``'s ids (a chunk at a
        time; its line offsets kept, if it has them), then delete ``temp``. Returns the number
        of ids."""
        ids = self.ids(temp)
        offsets = np.array(self.offsets(temp)) if self.has(f"{temp}.offsets.npy") else None
        chunks = (mapping(ids[i : i + _REMAP_CHUNK]) for i in range(0, len(ids), _REMAP_CHUNK))
        count = self.write_ids(part, chunks, offsets=offsets, **meta)
        del ids, chunks
        self.remove(temp)
        return count

    def _remove_orphans(self) -> None:
        """Delete the temporary files of a build that was killed (SIGKILL, or SIGTERM, which
        runs no ``finally``): every write happens under the lock, which the caller holds, so
        none of them is being written. One was left per kill, as large as the split it wrote
        (400 MB for WikiText-103's training ids), and nothing else ever removed it."""
        for temp in self.path.glob(f".*{_TEMP_SUFFIX}"):
            temp.unlink(missing_ok=True)

    def remove(self, part: str) -> None:
        """Delete a part's files (temporary parts of a build)."""
        for suffix in (".json", ".ids", ".offsets.npy"):
            (self.path / f"{part}{suffix}").unlink(missing_ok=True)

    # -- building once ----------------------------------------------------------------------
    @contextmanager
    def lock(self, what: str) -> Iterator[None]:
        """Exclusive right to build in this entry (other processes wait here)."""
        self._make_folder()
        lock = FileLock(str(self.path) + ".lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            _say("waiting for another process to prepare %s (%s)", what, self.path)
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    def ensure(self, done: Callable[[], bool], build: Callable[[], Any], what: str) -> bool:
        """Run ``build`` unless ``done()`` (checked again under the lock, so that only one
        process builds). Returns whether this call built. Logs a line either way."""
        if done():
            _say("data cache hit: %s from %s", what, self.path)
            return False
        with self.lock(what):
            if done():
                _say("data cache hit: %s from %s (prepared by another process)", what, self.path)
                return False
            _say("data cache miss: preparing %s into %s", what, self.path)
            self._remove_orphans()
            start = time.perf_counter()
            if not self.has("key.json"):
                self.write_json("key.json", self.material)  # what this entry is, for people
            build()
            _say("prepared %s in %.1f s", what, time.perf_counter() - start)
            return True
