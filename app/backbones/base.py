"""What a language-model backbone offers the LightningModules (no output layer inside)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class LMBackbone(nn.Module):
    """Maps token ids ``[B, T]`` to context vectors ``[B, T, output_size]``.

    ``forward(tokens, state) -> (hidden, new_state)``. Recurrent backbones carry ``state``
    from one BPTT window to the next (``carries_state = True``); others return ``None``.
    ``embedding`` is the input embedding, exposed for weight tying with the head.
    """

    carries_state: bool = False
    embedding: nn.Embedding
    output_size: int

    def forward(self, tokens: torch.Tensor, state: Any = None) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def detach_state(state: Any) -> Any:
        """Cut the graph between BPTT windows, keeping the values."""
        if state is None:
            return None
        if isinstance(state, torch.Tensor):
            return state.detach()
        return type(state)(LMBackbone.detach_state(s) for s in state)
