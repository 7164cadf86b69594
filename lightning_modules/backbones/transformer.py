"""Causal Transformer language-model backbone (torch's encoder layers with a causal mask)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_modules.backbones.base import LMBackbone, check_dropout, check_sizes
from lightning_modules.errors import ModelConfigError


class TransformerBackbone(LMBackbone):
    """Token + learnt position embeddings -> causal Transformer -> context vectors.

    Each BPTT window is modelled on its own (no state is carried between windows).
    """

    @classmethod
    def output_size_from(cls, init_args: Mapping[str, Any]) -> int:
        return init_args.get("embedding_size", 256)

    def __init__(
        self,
        vocab_size: int,
        embedding_size: int = 256,
        num_heads: int = 4,
        num_layers: int = 2,
        feedforward_size: int = 1024,
        dropout: float = 0.1,
        max_length: int = 512,
    ) -> None:
        super().__init__()
        check_sizes(
            embedding_size=embedding_size,
            num_heads=num_heads,
            num_layers=num_layers,
            feedforward_size=feedforward_size,
            max_length=max_length,
        )
        if embedding_size % num_heads:
            raise ModelConfigError(
                f"model.backbone.embedding_size ({embedding_size}) must be divisible by "
                f"model.backbone.num_heads ({num_heads})"
            )
        self.output_size = embedding_size
        self.max_length = max_length
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        self.position = nn.Embedding(max_length, embedding_size)
        layer = nn.TransformerEncoderLayer(
            embedding_size,
            num_heads,
            feedforward_size,
            dropout,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(embedding_size)
        check_dropout("dropout", dropout)
        self.dropout = nn.Dropout(dropout)
        self.scale = math.sqrt(embedding_size)

    def forward(self, tokens: torch.Tensor, state: None = None) -> tuple[torch.Tensor, None]:
        length = tokens.size(1)
        if length > self.max_length:  # (predict reads the last max_length tokens)
            raise ModelConfigError(
                f"a sequence of {length} tokens exceeds model.backbone.max_length "
                f"({self.max_length}), the size of the learnt position table: shorten data.bptt, "
                f"or raise max_length before training (a checkpoint's table keeps its size)"
            )
        positions = torch.arange(length, device=tokens.device)
        x = self.dropout(self.embedding(tokens) * self.scale + self.position(positions))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        return self.norm(self.encoder(x, mask=mask, is_causal=True)), None
