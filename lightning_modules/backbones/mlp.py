"""Multi-layer perceptron backbone for vector inputs (the synthetic hierarchy task)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_modules.backbones.base import check_dropout
from lightning_modules.errors import ModelConfigError


class MLPBackbone(nn.Module):
    """``input_size -> hidden_size`` (x ``num_layers``, ReLU) context vectors for a head.

    Args:
        input_size: size of the input vectors.
        hidden_size: width of every layer, also ``output_size`` (given to the head).
        num_layers: number of linear + ReLU layers (the paper uses a two-layer MLP).
        dropout: dropout after each layer.
        vocab_size: accepted (and unused) so the CLI's ``data.vocab_size`` link applies.
    """

    @classmethod
    def output_size_from(cls, init_args: Mapping[str, Any]) -> int:
        return init_args.get("hidden_size", 64)

    def __init__(
        self,
        input_size: int,
        hidden_size: int = 64,
        num_layers: int = 2,
        dropout: float = 0.0,
        vocab_size: int | None = None,
    ) -> None:
        super().__init__()
        if min(input_size, hidden_size, num_layers) <= 0:
            raise ModelConfigError(
                f"model.backbone input_size, hidden_size and num_layers must be positive, got "
                f"{input_size}, {hidden_size}, {num_layers}"
            )
        check_dropout("dropout", dropout)
        self.input_size = input_size
        self.output_size = hidden_size
        layers: list[nn.Module] = []
        for i in range(num_layers):
            layers += [nn.Linear(input_size if i == 0 else hidden_size, hidden_size), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
        self.layers = nn.Sequential(*layers)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if inputs.size(-1) != self.input_size:
            raise ModelConfigError(
                f"MLPBackbone expects inputs of size {self.input_size}, got {inputs.size(-1)}: "
                "set the backbone's input_size to the data's dimension"
            )
        return self.layers(inputs)
