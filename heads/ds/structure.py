"""What DS-Softmax's inference paths read of a head: its packed rows and their layout.

``DSStructure`` is a plain snapshot (detached views, so in-place parameter updates show
through and the version counters are the parameters' own) that ``heads/ds/inference.py``
takes instead of the head; the head builds one per structure (``DSSoftmaxHead.structure``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from heads.base import float32_no_autocast


def float32_context(device: torch.device) -> contextlib.AbstractContextManager:
    """``float32_no_autocast``, skipped when autocast is off: entering an autocast context
    costs about as much as the whole batch-1 expert softmax."""
    if torch.is_autocast_enabled(device.type):
        return float32_no_autocast(device)
    return contextlib.nullcontext()


def split_rows(rows: torch.Tensor, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W, b)`` of packed rows (``b`` is ``None`` without a bias column)."""
    if bias:
        return rows[:, :-1], rows[:, -1]
    return rows, None


@dataclass(frozen=True)
class DSStructure:
    """The packed experts of one head.

    ``weight [R, row_size]`` (rows of every expert, a bias column last when ``bias``),
    ``gate [K, d]``, ``row_class [R]`` (each row's class), ``expert_offsets [K + 1]`` and the
    same ``offsets`` as Python ints.
    """

    weight: torch.Tensor
    gate: torch.Tensor
    row_class: torch.Tensor
    expert_offsets: torch.Tensor
    offsets: list[int]
    hidden_size: int
    vocab_size: int
    bias: bool

    @property
    def row_size(self) -> int:
        return self.hidden_size + int(self.bias)

    def bounds(self) -> list[tuple[int, int]]:
        """``(start, stop)`` of each expert's rows."""
        return list(zip(self.offsets[:-1], self.offsets[1:], strict=True))

    def expert_sizes(self) -> list[int]:
        """``|v_k|``: surviving classes per expert."""
        return [b - a for a, b in self.bounds()]

    def version(self) -> tuple[int, int]:
        """The parameters' version counters (shared by the detached views)."""
        return self.weight._version, self.gate._version
