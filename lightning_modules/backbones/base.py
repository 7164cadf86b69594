"""What a language-model backbone offers the LightningModules (no output layer inside)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_modules.errors import ModelConfigError


def check_dropout(name: str, value: float) -> None:
    """Refuse a dropout probability outside [0, 1), naming the backbone's option (``nn.Dropout``
    raises for one above 1 with a traceback, and takes 1, which zeroes every value)."""
    if isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ModelConfigError(f"model.backbone.{name} must be in [0, 1), got {value!r}")


def check_sizes(**sizes: Any) -> None:
    """Refuse a size (``hidden_size=0``) that is not a positive integer, naming the backbone's
    option: torch's own errors for it (a ZeroDivisionError, "hidden_size must be greater than
    zero") name neither the option nor the config. ``None`` (unset, a default follows) passes."""
    for name, value in sizes.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelConfigError(
                f"model.backbone.{name} must be a positive integer, got {value!r}"
            )


def configured_output_size(backbone_class: type, init_args: Mapping[str, Any]) -> int:
    """The size of the context vectors a backbone built with ``init_args`` gives, read from
    its options before it is built: the CLI links it into ``head.hidden_size``, so that a
    config states it once. A backbone class answers through its ``output_size_from`` classmethod.
    """
    answer = getattr(backbone_class, "output_size_from", None)
    if answer is None:
        raise ModelConfigError(
            f"{backbone_class.__name__} has no output_size_from(init_args) classmethod: add one "
            f"so the CLI can size the head, or build the model in Python"
        )
    return int(answer(init_args))


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

    def extra_loss(self) -> torch.Tensor | None:
        """A regulariser of the last training forward for the task to add to the loss (AWD-LSTM's
        activation regularisation), or None. Read once per training step, after ``forward``."""
        return None

    @staticmethod
    def detach_state(state: Any) -> Any:
        """Cut the graph between BPTT windows, keeping the values."""
        if state is None:
            return None
        if isinstance(state, torch.Tensor):
            return state.detach()
        return type(state)(LMBackbone.detach_state(s) for s in state)
