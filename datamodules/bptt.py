"""Contiguous truncated-BPTT batches: ``batch_size`` parallel streams x ``bptt`` steps."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset


def stream_layout(num_tokens: int, batch_size: int, rank: int = 0, world_size: int = 1):
    """Where a rank's streams lie in a token stream: ``(start, streams, stream_len)``, its
    ``streams`` rows of ``stream_len`` tokens being ``tokens[start : start + streams *
    stream_len]`` (a contiguous block: the global ``[batch_size, stream_len]`` layout is row
    major). Raises ``ValueError`` for sizes that cannot work."""
    if batch_size <= 0:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if batch_size % world_size:
        raise ValueError(
            f"batch_size {batch_size} must be divisible by the number of processes "
            f"{world_size}: the streams are split evenly across ranks"
        )
    stream_len = num_tokens // batch_size
    if stream_len < 2:
        raise ValueError(f"{num_tokens} tokens are too few for {batch_size} streams of at least 2")
    per_rank = batch_size // world_size
    return rank * per_rank * stream_len, per_rank, stream_len


def num_windows(stream_len: int, bptt: int) -> int:
    return math.ceil((stream_len - 1) / bptt)


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
    ) -> None:
        super().__init__()
        if batch_size <= 0 or bptt <= 0:
            raise ValueError(f"batch_size and bptt must be positive, got {batch_size} and {bptt}")
        start, streams, stream_len = stream_layout(tokens.numel(), batch_size, rank, world_size)
        self.streams = tokens[start : start + streams * stream_len].view(streams, stream_len)
        self.bptt = bptt

    def __len__(self) -> int:
        return num_windows(self.streams.size(1), self.bptt)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        length = self.streams.size(1) - 1
        for start in range(0, length, self.bptt):
            stop = min(start + self.bptt, length)
            yield (
                self.streams[:, start:stop].long(),
                self.streams[:, start + 1 : stop + 1].long(),
            )


class StreamWindows(IterableDataset):
    """Contiguous BPTT batches over one split of a data module, this rank's share of the
    ``batch_size`` streams, re-read at every pass (``data.rank_streams``). ``tokens``: the
    split's length; ``before_pass``: called as each pass starts (a vocabulary's scheduled
    state takes effect there)."""

    def __init__(self, data, split: str, batch_size: int, bptt: int, tokens: int,
                 before_pass=None) -> None:  # fmt: skip
        from datamodules.errors import DataConfigError

        super().__init__()
        trainer = data.trainer
        self.rank, self.world_size = (
            (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        )
        self.data, self.split, self.batch_size, self.bptt = data, split, batch_size, bptt
        self.before_pass = before_pass
        try:
            _, _, stream_len = stream_layout(tokens, batch_size, self.rank, self.world_size)
        except ValueError as exc:  # too few tokens for the streams, or streams vs. ranks
            option = "data.batch_size" if split == "train" else "data.eval_batch_size"
            raise DataConfigError(f"{split} split with {option}={batch_size}: {exc}") from exc
        self._len = num_windows(stream_len, bptt)

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        if self.before_pass is not None:
            self.before_pass()
        streams = self.data.rank_streams(self.split, self.batch_size, self.rank, self.world_size)
        yield from BPTTBatches(streams.reshape(-1), streams.size(0), self.bptt)
