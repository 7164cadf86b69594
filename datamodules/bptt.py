"""Contiguous truncated-BPTT batches: ``batch_size`` parallel streams x ``bptt`` steps, or
AWD-LSTM's variable windows (:class:`WindowSchedule`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import IterableDataset


def stream_layout(
    num_tokens: int, batch_size: int, rank: int = 0, world_size: int = 1, uneven: bool = False
):
    """Where a rank's streams lie in a token stream: ``(start, streams, stream_len)``, its
    ``streams`` rows of ``stream_len`` tokens being ``tokens[start : start + streams *
    stream_len]`` (a contiguous block: the global ``[batch_size, stream_len]`` layout is row
    major). ``uneven`` (evaluation): ``batch_size`` need not divide by ``world_size``, the
    first ``batch_size % world_size`` ranks take one stream more (10 on 4 ranks: 3, 3, 2, 2;
    every rank still walks the same windows, and the metrics weigh tokens, not ranks).
    Training keeps equal shares: DDP averages the ranks' gradients with equal weights. Raises
    ``ValueError`` for sizes that cannot work."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if batch_size % world_size and not uneven:
        raise ValueError(
            f"batch_size {batch_size} must be divisible by the number of processes "
            f"{world_size}: the streams are split evenly across ranks"
        )
    if batch_size < world_size:
        raise ValueError(
            f"batch_size {batch_size} must be at least the number of processes {world_size}: "
            f"each rank walks at least one stream"
        )
    stream_len = num_tokens // batch_size
    if stream_len < 2:
        raise ValueError(f"{num_tokens} tokens are too few for {batch_size} streams of at least 2")
    per_rank, extra = divmod(batch_size, world_size)
    first = rank * per_rank + min(rank, extra)  # the rank's first stream
    return first * stream_len, per_rank + (rank < extra), stream_len


def num_windows(stream_len: int, bptt: int) -> int:
    return math.ceil((stream_len - 1) / bptt)


@dataclass(frozen=True)
class WindowSchedule:
    """AWD-LSTM's variable BPTT windows (Merity et al. 2018, Sec. 4.1; salesforce/awd-lstm-lm
    ``main.py`` ``train()``; zihangdai/mos ``main.py`` adds the cap): each training window's
    length is drawn as

        bptt' = bptt if u < 1 - half_prob else bptt / 2,   u ~ U[0, 1)
        T = min(max(min_len, int(N(bptt', std))), max_len)

    and the next window starts T tokens later. The last window is cut to the targets left,
    so every target of a stream is predicted once per pass (the reference's loop,
    ``while i < len - 1 - 1``, skips a last window of one target).

    The draws come from a generator of their own, ``numpy.random.default_rng([seed, epoch])``
    (the reference draws from numpy's global one; the global generators are not touched here,
    so dropout draws the masks a fixed-window run would): the lengths are a function of
    ``(seed, epoch)`` and the stream's length, alike on every DDP rank (the ranks' streams are
    equally long), so the ranks run the same number of steps.
    """

    bptt: int
    seed: int
    std: float = 5.0
    half_prob: float = 0.05
    min_len: int = 5
    max_len: int | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def lengths(self, stream_len: int, epoch: int) -> list[int]:
        """The window lengths of one pass over streams of ``stream_len`` tokens (``stream_len
        - 1`` targets), in order; they sum to ``stream_len - 1``."""
        key = (stream_len, epoch)
        if key not in self._cache:
            if len(self._cache) > 4:  # a pass asks a few times (len, iter): keep the recent
                self._cache.clear()
            self._cache[key] = self._draw(stream_len - 1, epoch)
        return self._cache[key]

    def count(self, stream_len: int, epoch: int) -> int:
        """The number of windows of one pass (``len(lengths(...))``), drawn without keeping
        them: what a schedule sized over many epochs reads."""
        lengths = self._cache.get((stream_len, epoch))
        return len(lengths if lengths is not None else self._draw(stream_len - 1, epoch))

    def _draw(self, targets: int, epoch: int) -> list[int]:
        rng = np.random.default_rng([self.seed, epoch])
        lengths, done = [], 0
        while done < targets:
            # the reference's two draws per window, in its order (awd-lstm-lm main.py train())
            base = self.bptt if rng.random() < 1 - self.half_prob else self.bptt / 2
            length = max(self.min_len, int(rng.normal(base, self.std)))
            if self.max_len is not None:  # MoS main.py: min(seq_len, bptt + max_seq_len_delta)
                length = min(length, self.max_len)
            length = min(length, targets - done)
            lengths.append(length)
            done += length
        return lengths


class BPTTBatches(IterableDataset):
    """Cuts a token stream into ``batch_size`` contiguous streams and walks them in windows.

    Batch i holds tokens ``[i*bptt, (i+1)*bptt)`` of every stream and their successors as
    targets, so a recurrent state carried from batch i to i+1 continues the same text.
    Under DDP each rank takes its own contiguous block of streams (the global batch is
    ``batch_size``): no text is duplicated or dropped across ranks beyond the tail that
    does not fill a stream.

    The streams are a view of ``tokens`` (a memory-mapped int32 file stays one: a rank reads
    only its own block's pages); each window is widened to int64 as it is served.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        batch_size: int,
        bptt: int,
        rank: int = 0,
        world_size: int = 1,
        lengths: Sequence[int] | None = None,
    ) -> None:
        """``lengths``: the windows' lengths in order (summing to the stream's targets,
        ``stream_len - 1``: :meth:`WindowSchedule.lengths`) instead of ``bptt`` each."""
        super().__init__()
        if batch_size <= 0 or bptt <= 0:
            raise ValueError(f"batch_size and bptt must be positive, got {batch_size} and {bptt}")
        start, streams, stream_len = stream_layout(tokens.numel(), batch_size, rank, world_size)
        self.streams = tokens[start : start + streams * stream_len].view(streams, stream_len)
        self.bptt = bptt
        if lengths is not None and sum(lengths) != stream_len - 1:
            raise ValueError(
                f"window lengths sum to {sum(lengths)}, not the streams' {stream_len - 1} targets"
            )
        self.lengths = lengths

    def __len__(self) -> int:
        if self.lengths is not None:
            return len(self.lengths)
        return num_windows(self.streams.size(1), self.bptt)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        length = self.streams.size(1) - 1
        if self.lengths is None:
            starts = range(0, length, self.bptt)
            stops = (min(start + self.bptt, length) for start in starts)
        else:
            stops = np.cumsum(self.lengths).tolist()
            starts = [0, *stops[:-1]]
        for start, stop in zip(starts, stops, strict=True):
            yield (
                self.streams[:, start:stop].long(),
                self.streams[:, start + 1 : stop + 1].long(),
            )


class StreamWindows(IterableDataset):
    """Contiguous BPTT batches over one split of a data module, this rank's share of the
    ``batch_size`` streams, re-read at every pass (``data.rank_streams``). ``tokens``: the
    split's length; ``before_pass``: called as each pass starts (a vocabulary's scheduled
    state takes effect there); ``schedule``: variable windows, those of the pass ``epoch()``
    (read when the length is asked and when a pass starts)."""

    def __init__(self, data, split: str, batch_size: int, bptt: int, tokens: int,
                 before_pass=None, schedule: WindowSchedule | None = None,
                 epoch: Callable[[], int] | None = None) -> None:  # fmt: skip
        from datamodules.errors import DataConfigError

        super().__init__()
        trainer = data.trainer
        self.rank, self.world_size = (
            (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        )
        self.data, self.split, self.batch_size, self.bptt = data, split, batch_size, bptt
        self.before_pass = before_pass
        # evaluation shares streams unevenly where the data module's rank_streams does
        uneven = split != "train" and getattr(data, "uneven_eval_streams", False)
        try:
            _, _, stream_len = stream_layout(
                tokens, batch_size, self.rank, self.world_size, uneven=uneven
            )
        except ValueError as exc:  # too few tokens for the streams, or streams vs. ranks
            option = "data.batch_size" if split == "train" else "data.eval_batch_size"
            raise DataConfigError(f"{split} split with {option}={batch_size}: {exc}") from exc
        self.stream_len = stream_len
        self.schedule, self.epoch = schedule, epoch or (lambda: 0)
        self._len = num_windows(stream_len, bptt)

    def lengths(self) -> list[int] | None:
        """The current pass's window lengths (variable windows), else None."""
        if self.schedule is None:
            return None
        return self.schedule.lengths(self.stream_len, self.epoch())

    def __len__(self) -> int:
        lengths = self.lengths()
        return self._len if lengths is None else len(lengths)

    def __iter__(self):
        if self.before_pass is not None:
            self.before_pass()
        streams = self.data.rank_streams(self.split, self.batch_size, self.rank, self.world_size)
        yield from BPTTBatches(streams.reshape(-1), streams.size(0), self.bptt,
                               lengths=self.lengths())  # fmt: skip
