"""Multi-layer LSTM language-model backbone with locked (or standard) dropouts."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

import lightning_modules.backbones.rnn_flops  # noqa: F401  (the LSTM kernels' FLOP formulas)
from lightning_modules.backbones.base import LMBackbone, check_dropout, check_sizes
from lightning_modules.errors import ModelConfigError

DROPOUT_KINDS = ("locked", "standard")


class LockedDropout(nn.Module):
    """Variational dropout: one mask per sequence, shared over time (Gal & Ghahramani)."""

    def __init__(self, p: float, name: str = "dropout") -> None:
        super().__init__()
        check_dropout(name, p)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, T, D]
        if not self.training or self.p == 0.0:
            return x
        mask = x.new_empty(x.size(0), 1, x.size(2)).bernoulli_(1 - self.p) / (1 - self.p)
        return x * mask


def make_dropout(kind: str, p: float, name: str = "dropout") -> nn.Module:
    """``locked``: one mask per sequence (:class:`LockedDropout`); ``standard``: a new mask
    for every element, so every time step (``nn.Dropout``, Zaremba et al. 2014). ``name``:
    the backbone's option that gave ``p`` (for the error a bad one raises)."""
    if kind == "locked":
        return LockedDropout(p, name)
    check_dropout(name, p)
    return nn.Dropout(p)


class LSTMBackbone(LMBackbone):
    """Embedding -> ``num_layers`` LSTMs -> context vectors.

    Args:
        vocab_size: linked from the data module by the CLI.
        embedding_size: input embedding size (equal to the head's ``embedding_size`` for tying).
        hidden_size: size of every LSTM layer but the last.
        num_layers: number of stacked LSTM layers.
        output_size: size of the last layer, i.e. of the context vectors given to the head.
            Default: ``hidden_size``.
        input_dropout: dropout on the embedded inputs.
        hidden_dropout: dropout between LSTM layers.
        output_dropout: dropout on the last layer's output.
        dropout_kind: ``locked`` (one mask per sequence, shared over time: variational
            dropout) or ``standard`` (a new mask at every time step, as in Zaremba et al.
            2014 and PyTorch's word_language_model).
    """

    carries_state = True

    @classmethod
    def output_size_from(cls, init_args: Mapping[str, Any]) -> int:
        # (an output_size of 0 is not unset: the backbone refuses it, the head must not hide it)
        output_size = init_args.get("output_size")
        return init_args.get("hidden_size", 200) if output_size is None else output_size

    def __init__(
        self,
        vocab_size: int,
        embedding_size: int = 200,
        hidden_size: int = 200,
        num_layers: int = 2,
        output_size: int | None = None,
        input_dropout: float = 0.2,
        hidden_dropout: float = 0.2,
        output_dropout: float = 0.2,
        dropout_kind: str = "locked",
    ) -> None:
        super().__init__()
        if num_layers < 1:
            raise ModelConfigError(
                f"model.backbone.num_layers must be at least 1, got {num_layers}"
            )
        check_sizes(embedding_size=embedding_size, hidden_size=hidden_size, output_size=output_size)
        if dropout_kind not in DROPOUT_KINDS:
            raise ModelConfigError(
                f"backbone dropout_kind must be one of {', '.join(DROPOUT_KINDS)}, "
                f"got {dropout_kind!r}"
            )
        self.output_size = hidden_size if output_size is None else output_size
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        nn.init.uniform_(self.embedding.weight, -0.1, 0.1)
        sizes = [embedding_size] + [hidden_size] * (num_layers - 1) + [self.output_size]
        self.layers = nn.ModuleList(self._layer(sizes[i], sizes[i + 1]) for i in range(num_layers))
        self.input_dropout = make_dropout(dropout_kind, input_dropout, "input_dropout")
        self.hidden_dropout = make_dropout(dropout_kind, hidden_dropout, "hidden_dropout")
        self.output_dropout = make_dropout(dropout_kind, output_dropout, "output_dropout")

    def _layer(self, input_size: int, hidden_size: int) -> nn.Module:
        """One recurrent layer, called as ``layer(x, state) -> (x, state)``."""
        return nn.LSTM(input_size, hidden_size, batch_first=True)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens)

    def _recur(
        self, tokens: torch.Tensor, state: list[tuple[torch.Tensor, torch.Tensor]] | None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(the last layer's output before its dropout, the new state of every layer)."""
        x = self.input_dropout(self._embed(tokens))
        new_state = []
        with _cpu_recurrence_in_float32(x):
            for i, layer in enumerate(self.layers):
                x, layer_state = layer(x, None if state is None else state[i])
                new_state.append(layer_state)
                if i < len(self.layers) - 1:
                    x = self.hidden_dropout(x)
        return x, new_state

    def forward(
        self, tokens: torch.Tensor, state: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        raw, new_state = self._recur(tokens, state)
        return self.output_dropout(raw), new_state


def _cpu_recurrence_in_float32(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """oneDNN has no bf16 LSTM kernel without AVX-512, so CPU autocast would crash on most
    CPUs; the recurrence is cheap next to the output layer, so it runs in float32 there."""
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.autocast("cpu", enabled=False)
    return contextlib.nullcontext()
