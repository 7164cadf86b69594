"""Contiguous truncated-BPTT batches: ``batch_size`` parallel streams x ``bptt`` steps."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import IterableDataset


class BPTTBatches(IterableDataset):
    """Cuts a token stream into ``batch_size`` contiguous streams and walks them in windows.

    Batch i holds tokens ``[i*bptt, (i+1)*bptt)`` of every stream and their successors as
    targets, so a recurrent state carried from batch i to i+1 continues the same text.
    Under DDP each rank takes its own contiguous block of streams (the global batch is
    ``batch_size``): no text is duplicated or dropped across ranks beyond the tail that
    does not fill a stream.
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
        if batch_size % world_size:
            raise ValueError(
                f"batch_size {batch_size} must be divisible by the number of processes "
                f"{world_size}: the streams are split evenly across ranks"
            )
        stream_len = tokens.numel() // batch_size
        if stream_len < 2:
            raise ValueError(
                f"{tokens.numel()} tokens are too few for {batch_size} streams of at least 2"
            )
        streams = tokens[: stream_len * batch_size].view(batch_size, stream_len)
        per_rank = batch_size // world_size
        self.streams = streams[rank * per_rank : (rank + 1) * per_rank].contiguous()
        self.bptt = bptt

    def __len__(self) -> int:
        return math.ceil((self.streams.size(1) - 1) / self.bptt)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        length = self.streams.size(1) - 1
        for start in range(0, length, self.bptt):
            stop = min(start + self.bptt, length)
            yield self.streams[:, start:stop], self.streams[:, start + 1 : stop + 1]
