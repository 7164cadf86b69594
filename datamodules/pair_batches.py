"""Batches of parallel lines: the encoded pairs of a split, their length-sorted order, batches
cut to a token budget (shared out over DDP ranks), and their padding into tensors."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, Sampler

from datamodules.errors import DataConfigError
from heads import IGNORE_INDEX

log = logging.getLogger(__name__)


class EncodedPairs(torch.utils.data.Dataset):
    """Encoded parallel lines over memory-mapped token files: item ``i`` is line ``index[i]``
    of the split, ``{"source_ids", "target_ids"}`` (int32 arrays, each ending in ``<eos>``)
    and ``"index"`` (the line number)."""

    def __init__(
        self,
        source: np.ndarray,
        source_offsets: np.ndarray,
        target: np.ndarray,
        target_offsets: np.ndarray,
        index: np.ndarray,
    ) -> None:
        self.source, self.source_offsets = source, source_offsets
        self.target, self.target_offsets = target, target_offsets
        self.index = index
        self.source_lengths = np.diff(source_offsets)[index]
        self.target_lengths = np.diff(target_offsets)[index]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        line = int(self.index[i])
        so, to = self.source_offsets, self.target_offsets
        return {
            "source_ids": self.source[so[line] : so[line + 1]],
            "target_ids": self.target[to[line] : to[line + 1]],
            "index": line,
        }


class LengthSortedSampler(Sampler[int]):
    """Indices sorted by (source, target) length; with ``shuffle``, equal lengths are ordered
    at random anew each epoch (from ``seed + epoch``), or with ``epochs_alike`` in epoch 0's
    order every epoch (``trainer.overfit_batches``: the same few batches, drawn at random).

    Lightning calls ``set_epoch`` on the ``sampler`` of a DataLoader's batch sampler at every
    epoch start, which is how :class:`TokenBucketBatchSampler` learns the epoch.

    The lengths are kept as int64 arrays and the order is one ``np.lexsort``: a Python
    ``sorted`` with a tuple key per pair took 10 s an epoch for 400k pairs (on every rank,
    before the epoch's first step), and a list of ints and one of floats per pair.
    """

    def __init__(
        self,
        source_lengths: Sequence[int] | np.ndarray,
        target_lengths: Sequence[int] | np.ndarray,
        shuffle: bool,
        seed: int = 0,
        epochs_alike: bool = False,
    ) -> None:
        self.source_lengths = np.asarray(source_lengths, dtype=np.int64)
        self.target_lengths = np.asarray(target_lengths, dtype=np.int64)
        if self.source_lengths.shape != self.target_lengths.shape:
            raise ValueError("source and target lengths must be as many")
        self.shuffle = shuffle
        self.seed = seed
        self.epochs_alike = epochs_alike
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        if not self.epochs_alike:
            self.epoch = epoch

    def rng(self) -> random.Random:
        return random.Random(self.seed + self.epoch)

    def order(self) -> np.ndarray:
        """The epoch's order (int64 line indices): by source length, then target length, then
        (with ``shuffle``) a random tie-breaker, else the line number (a stable sort)."""
        src, tgt = self.source_lengths, self.target_lengths
        if not self.shuffle:
            return np.lexsort((tgt, src))
        # random tie-breaker so equal-length pairs meet different neighbours each epoch
        return np.lexsort((uniform_draws(self.rng(), len(src)), tgt, src))

    def __iter__(self) -> Iterator[int]:
        yield from self.order().tolist()

    def __len__(self) -> int:
        return len(self.source_lengths)


def uniform_draws(rng: random.Random, count: int) -> np.ndarray:
    """``[rng.random() for _ in range(count)]`` as float64, bit for bit, without a Python
    float per draw: ``random()`` is ``(a >> 5) * 2**26 + (b >> 6)`` over ``2**53`` for the
    generator's next two 32-bit words ``a, b``, which ``getrandbits(64 * count)`` returns in
    order, least significant first (so an epoch's order is the one earlier versions drew, and
    a mid-epoch checkpoint resumes in it; tested against ``random()``)."""
    if count == 0:
        return np.zeros(0)
    words = np.frombuffer(rng.getrandbits(64 * count).to_bytes(8 * count, "little"), "<u4")
    words = words.astype(np.uint64)
    return ((words[0::2] >> 5) * 67108864 + (words[1::2] >> 6)) / 9007199254740992.0


class TokenBucketBatchSampler(Sampler[list[int]]):
    """Batches of similar-length pairs holding at most ``max_tokens`` padded tokens per side.

    The length-sorted order of ``sampler`` is cut into batches whose ``count * longest`` stays
    within ``max_tokens``, so padding is small. With a shuffling sampler the order of the
    batches is shuffled anew each epoch too. Under DDP each rank takes every
    ``world_size``-th batch: in training the last few batches are dropped so that every rank
    runs the same number of steps, and a split cut into fewer batches than there are ranks
    is cut instead into one batch per rank, of balanced cost (an epoch of one step; a split
    of fewer pairs than ranks is one clear error). In evaluation every line is kept, in
    ``ceil(batches / ranks)`` rounds of one batch per rank: the length-sorted order is cut
    into that many batches per rank, contiguous, of balanced cost (:func:`balanced_batches`:
    the ranks' padded tokens within a few percent of each other, where cutting by the budget
    and dealing left one rank with up to 1.7 times the mean); each is within the budget, and
    the lines and their results are those of one process. The ranks may still evaluate
    different numbers of batches (a split of fewer lines than rounds x ranks): evaluation
    has no collective per batch (the metrics and translations are gathered at the epoch's
    end; fit's DDP wrapper syncs buffers in the first batch only, which every rank has). A
    pair longer than ``max_tokens`` is refused in training (the budget bounds a step's
    memory); with ``longer_alone`` (evaluation, which keeps every line) it is a batch of its
    own.
    """

    def __init__(
        self,
        sampler: LengthSortedSampler,
        max_tokens: int,
        rank: int = 0,
        world_size: int = 1,
        longer_alone: bool = False,
    ) -> None:
        longest = int(
            max(sampler.source_lengths.max(initial=0), sampler.target_lengths.max(initial=0))
        )
        if max_tokens < longest and not longer_alone:
            raise DataConfigError(
                f"data.max_tokens ({max_tokens}) must hold the longest sequence ({longest} tokens)"
            )
        lines = len(sampler.source_lengths)
        if lines < world_size:
            split = "a training split of" if sampler.shuffle else "an evaluation split of"
            raise DataConfigError(
                f"{split} {lines} lines cannot give each of {world_size} DDP ranks a batch: "
                f"run on at most {lines} devices (trainer.devices)"
            )
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.rank = rank
        self.world_size = world_size
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _batches(self) -> list[list[int]]:
        # Lightning asks for len() several times per epoch: cut the batches once per epoch
        epoch = self.sampler.epoch
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._cut_batches())
        return self._cache[1]

    def _cut_batches(self) -> list[list[int]]:
        src, tgt = self.sampler.source_lengths, self.sampler.target_lengths
        order = self.sampler.order()
        sizes = np.maximum(src, tgt)[order]
        batches = _pieces(order, _greedy_cuts(sizes, self.max_tokens))
        shuffle, world = self.sampler.shuffle, self.world_size
        if world > 1 and (not shuffle or len(batches) < world):
            # rounds of one batch per rank, balanced: other batches than one process's cut
            # (limit_*_batches=k on each of n ranks keeps the first k * n of these)
            rounds = -(-len(batches) // world)
            batches = balanced_batches(order, sizes, min(rounds * world, len(order)))
        if shuffle:
            # a different stream than the tie-breaker's
            random.Random(self.sampler.seed + self.sampler.epoch + 7919).shuffle(batches)
        if world > 1:
            if shuffle:
                batches = batches[: len(batches) - len(batches) % world]
            batches = batches[self.rank :: world]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._batches()

    def __len__(self) -> int:
        return len(self._batches())


def check_window(window: Any) -> None:
    """``data.predict_window``: a positive number of lines."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise DataConfigError(f"data.predict_window must be a positive integer, got {window!r}")


def window_batches(
    lengths: Sequence[int] | np.ndarray, max_tokens: float | None, max_lines: int | None = None
) -> list[list[int]]:
    """One window's batches (positions in it): sorted by length (a stable sort: equal lengths
    keep the input's order), cut by the token budget (``lines x longest <= max_tokens``, a
    longer line alone) and into at most ``max_lines`` lines."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    ends = _greedy_cuts(lengths[order], max_tokens) if max_tokens is not None else [len(order)]
    batches = _pieces(order, ends) if len(order) else []
    if max_lines is not None:
        batches = [b[a : a + max_lines] for b in batches for a in range(0, len(b), max_lines)]
    return batches


class StreamedWindows(IterableDataset):
    """``predict``'s batches over a stream of lines, one window in memory at a time: the
    lines (``line_batches()``: lists of lines in input order, e.g. a file's blocks) are taken
    ``window`` at a time; ``encode(lines)`` gives the window's items and their lengths
    (encoded in input order), :func:`window_batches` sorts and cuts them, and
    ``collate(items, lines, numbers)`` makes each batch (``numbers``: each line's number in
    the input), to which ``input_lines`` (those numbers, a list that stays on the host) and
    ``last`` (whether it is the input's last batch: :class:`InputOrder` then gives every
    result it holds) are added.

    A window sorted by length (fairseq-interactive's buffer): batching in file order padded
    every batch to its longest line and decoded it for as many steps as its longest output, so
    one long line among short ones cost its whole batch; sorted, a batch holds lines of about
    one length. Reading the whole input first held every line as a Python string and every line's
    encoding at once (a 2M-line file of prompts: 750 MB); here memory holds one window and
    one block of the file. Its length is not known before the input is read (a progress bar
    counts batches, without a total; ``limit_predict_batches`` takes a count, not a share).
    """

    def __init__(
        self,
        line_batches: Callable[[], Iterable[list[str]]],
        encode: Callable[[list[str]], tuple[list[Any], Sequence[int]]],
        collate: Callable[[list[Any], list[str], list[int]], dict[str, Any]],
        window: int,
        max_tokens: float | None = None,
        max_lines: int | None = None,
        name: str = "the input",
    ) -> None:
        check_window(window)
        self.line_batches, self.encode, self.collate = line_batches, encode, collate
        self.window, self.max_tokens, self.max_lines = window, max_tokens, max_lines
        self.name = name  # what the input is, for the line said when it has no line

    def windows(self) -> Iterator[list[str]]:
        """The input's lines, ``window`` at a time (the last window may be shorter)."""
        pending: list[str] = []
        for lines in self.line_batches():
            start = 0
            while len(pending) + len(lines) - start >= self.window:
                take = self.window - len(pending)
                yield pending + lines[start : start + take]
                pending, start = [], start + take
            pending += lines[start:]
        if pending:
            yield pending

    def _batches(self) -> Iterator[dict[str, Any]]:
        first = 0  # the window's first line in the input
        for lines in self.windows():
            items, lengths = self.encode(lines)
            for piece in window_batches(lengths, self.max_tokens, self.max_lines):
                numbers = [first + j for j in piece]
                batch = self.collate([items[j] for j in piece], [lines[j] for j in piece], numbers)
                yield {**batch, "input_lines": numbers}
            first += len(lines)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # one batch read ahead, to tell the last one
        previous = None
        for batch in self._batches():
            if previous is not None:
                yield {**previous, "last": False}
            previous = batch
        if previous is not None:
            yield {**previous, "last": True}
        else:  # (an empty file ended the run without a word)
            log.warning("warning: predict: %s has no line: nothing to predict", self.name)


class InputOrder:
    """Results of batches whose lines are scattered (sorted within windows), given back in
    the input's order: :meth:`put` keeps a batch's results and returns those that now
    continue the order (line 0, 1, ... as far as every line is done; none, or several
    batches' worth); at the ``last`` batch, every result still held, in order (all of them,
    unless ``limit_predict_batches`` left lines out). At most one window of results waits."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._held: dict[int, Any] = {}
        self._next = 0

    @property
    def written(self) -> int:
        """How many of the input's first lines have been given back."""
        return self._next

    @property
    def held(self) -> int:
        """How many results wait for an earlier line."""
        return len(self._held)

    def put(self, indices: Sequence[int], results: Sequence[Any], last: bool) -> list[Any]:
        for i, result in zip(indices, results, strict=True):
            self._held[int(i)] = result
        if last:
            ready = [self._held[i] for i in sorted(self._held)]
            self._held, self._next = {}, max(self._held, default=self._next - 1) + 1
            return ready
        ready = []
        while self._next in self._held:
            ready.append(self._held.pop(self._next))
            self._next += 1
        return ready


def _greedy_cuts(sizes: Sequence[int] | np.ndarray, budget: float) -> list[int]:
    """Where the token-budget cut ends each batch of ``sizes`` (in order): a batch grows while
    ``lines x longest`` stays within ``budget`` (a line over it alone).

    One numpy pass per batch, not a Python step per line: a batch starting with a line of
    ``s`` tokens holds at most ``budget // s`` lines (its longest is at least ``s``), so only
    that window is read, and the running maximum finds where ``lines x longest`` first
    passes the budget. (Bisection in :func:`balanced_batches` runs this some 30 times.)"""
    sizes = np.asarray(sizes, dtype=np.int64)
    n, ends, start = len(sizes), [], 0
    while start < n:
        window = sizes[start : start + int(budget // max(sizes[start], 1)) + 1]
        lines = np.arange(1, len(window) + 1)
        over = np.flatnonzero(lines * np.maximum.accumulate(window) > budget)
        # the first line always joins; the batch ends before the first line that passes it
        start += max(int(over[0]), 1) if len(over) else len(window)
        ends.append(start)
    return ends


def _pieces(order: np.ndarray | list[int], ends: list[int]) -> list[list[int]]:
    order = np.asarray(order)
    return [order[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def balanced_batches(
    order: np.ndarray | list[int], sizes: Sequence[int] | np.ndarray, count: int
) -> list[list[int]]:
    """``order`` (length-sorted; ``sizes`` its lines' longer sides) cut into ``count``
    contiguous batches (``count <= len(order)``) whose costliest (``lines x longest``, the
    padded tokens) costs the least possible: the smallest budget whose token-budget cut
    needs at most ``count`` batches (found by bisection: the cut's batch count only falls as
    the budget grows), then the costliest batches cut in two until there are ``count``.
    Dealt in turn, each rank's rounds then cost about the same. No batch costs more than in
    a cut into fewer batches by any budget (``max_tokens`` included)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    longest = int(sizes.max())
    low, high = longest, len(sizes) * longest  # one line alone; everything in one
    while low < high:
        middle = (low + high) // 2
        if len(_greedy_cuts(sizes, middle)) <= count:
            high = middle
        else:
            low = middle + 1
    ends = _greedy_cuts(sizes, low)
    batches = _pieces(order, ends)
    parts = [sizes[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    while len(batches) < count:
        _cut_costliest(batches, parts)
    return batches


def _cut_costliest(batches: list[list[int]], sizes: list[list[int]]) -> None:
    """Cut the costliest batch of several lines in two, in place in the order: at the cut
    whose costlier side is the cheapest (not always the middle: the sizes are sorted by
    source length, the target's may be longer)."""
    j = max(
        (j for j, b in enumerate(sizes) if len(b) > 1),
        key=lambda j: len(sizes[j]) * max(sizes[j]),
    )
    batch, size = batches[j], sizes[j]
    head = list(itertools.accumulate(size, max))
    tail = list(itertools.accumulate(reversed(size), max))[::-1]
    n = len(size)
    cut = min(range(1, n), key=lambda k: max(k * head[k - 1], (n - k) * tail[k]))
    batches[j : j + 1] = [batch[:cut], batch[cut:]]
    sizes[j : j + 1] = [size[:cut], size[cut:]]


def collate_pairs(items: list[dict[str, Any]], pad_id: int, bos_id: int) -> dict[str, torch.Tensor]:
    """Pad a list of encoded pairs into a batch.

    ``source [B, S]`` with ``source_padding [B, S]`` (True at padding: masked in attention),
    ``target_input [B, T]`` = BOS + target without its last token (teacher forcing),
    ``target_output [B, T]`` = target ending in EOS, ``-100`` at padding (ignored by heads),
    ``index [B]`` = line number in the split. Padding ids only fill masked or ignored
    positions, so any id works; ``pad_id`` is an ordinary token of the frequency-sorted
    vocabulary and needs no slot of its own.
    """
    batch = len(items)
    src_len = max(len(it["source_ids"]) for it in items)
    tgt_len = max(len(it["target_ids"]) for it in items)
    source = torch.full((batch, src_len), pad_id, dtype=torch.long)
    padding = torch.ones((batch, src_len), dtype=torch.bool)
    target_input = torch.full((batch, tgt_len), pad_id, dtype=torch.long)
    target_output = torch.full((batch, tgt_len), IGNORE_INDEX, dtype=torch.long)
    for row, it in enumerate(items):
        src, tgt = it["source_ids"], it["target_ids"]
        source[row, : len(src)] = torch.as_tensor(src)
        padding[row, : len(src)] = False
        target_input[row, 0] = bos_id
        target_input[row, 1 : len(tgt)] = torch.as_tensor(tgt[:-1])
        target_output[row, : len(tgt)] = torch.as_tensor(tgt)
    index = torch.as_tensor([it["index"] for it in items], dtype=torch.long)
    return {
        "source": source,
        "source_padding": padding,
        "target_input": target_input,
        "target_output": target_output,
        "index": index,
    }
