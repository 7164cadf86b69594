"""Transformer encoder-decoder backbone for translation (torch's layers; no output layer)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_modules.backbones.base import check_dropout, check_sizes
from lightning_modules.errors import ModelConfigError


def sinusoidal_positions(
    length: int, size: int, device: torch.device | str | None = None, first: int = 0
) -> torch.Tensor:
    """The fixed sine/cosine position encodings of Vaswani et al. (2017), ``[length, size]``:
    those of positions ``first .. first + length - 1``."""
    position = torch.arange(first, first + length, dtype=torch.float32, device=device)[:, None]
    frequency = torch.exp(
        torch.arange(0, size, 2, dtype=torch.float32, device=device) * (-math.log(1e4) / size)
    )
    table = torch.zeros(length, size, device=device)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: size // 2])
    return table


class Seq2SeqTransformer(nn.Module):
    """Pre-norm Transformer encoder-decoder: source ids -> decoder context vectors.

    ``forward(source, source_padding, target_input) -> hidden [B, T, output_size]``; a head
    maps each decoder vector to the next target token, exactly as in the LM task. The encoder
    and the decoder's cross-attention never attend to source padding (``source_padding`` is
    True there); the decoder is causal (position t sees target positions <= t only), so
    target padding, which only ever follows real tokens, is never seen by a real position.

    Args:
        src_vocab_size: source vocabulary size (linked from the data module by the CLI).
        vocab_size: target vocabulary size (linked; the same number the head gets).
        model_size: embedding and hidden size ``d_model`` (= the head's ``hidden_size``).
        num_heads: attention heads.
        encoder_layers, decoder_layers: layer counts.
        feedforward_size: inner size of the position-wise feed-forward blocks.
        dropout: dropout on embeddings, attention weights and sub-layer outputs.
        max_length: positions whose encodings are computed once, at build; a longer sequence
            (a long test sentence, a long translation) has its own computed when met: the
            sine/cosine encodings extend to any length (Vaswani et al. 2017, section 3.5), so
            no sentence is refused, and a checkpoint can take any ``max_length``.
        share_embeddings: one embedding table for source and target (needs a joint
            vocabulary, ``data.joint_vocab: true``).
    """

    @classmethod
    def output_size_from(cls, init_args: Mapping[str, Any]) -> int:
        return init_args.get("model_size", 256)

    def __init__(
        self,
        src_vocab_size: int,
        vocab_size: int,
        model_size: int = 256,
        num_heads: int = 4,
        encoder_layers: int = 3,
        decoder_layers: int = 3,
        feedforward_size: int = 1024,
        dropout: float = 0.1,
        max_length: int = 256,
        share_embeddings: bool = False,
    ) -> None:
        super().__init__()
        check_sizes(
            model_size=model_size,
            num_heads=num_heads,
            encoder_layers=encoder_layers,
            decoder_layers=decoder_layers,
            feedforward_size=feedforward_size,
            max_length=max_length,
        )
        if model_size % num_heads:
            raise ModelConfigError(
                f"model.backbone.model_size ({model_size}) must be divisible by "
                f"model.backbone.num_heads ({num_heads})"
            )
        if model_size % 2:
            raise ModelConfigError(
                f"model.backbone.model_size must be even (sine/cosine pairs), got {model_size}"
            )
        if share_embeddings and src_vocab_size != vocab_size:
            raise ModelConfigError(
                f"share_embeddings needs one vocabulary for both sides, got source "
                f"{src_vocab_size} and target {vocab_size} tokens: set data.joint_vocab true"
            )
        self.output_size = model_size
        self.max_length = max_length
        self.share_embeddings = share_embeddings
        self.embedding = nn.Embedding(vocab_size, model_size)  # target side: tie with the head
        self.source_embedding = (
            self.embedding if share_embeddings else nn.Embedding(src_vocab_size, model_size)
        )
        # a list, not a set of the two modules: a set's order follows their addresses, so the
        # tables took each other's draws in some processes and a seed did not fix the model
        tables = [self.embedding] if share_embeddings else [self.embedding, self.source_embedding]
        for table in tables:
            nn.init.normal_(table.weight, std=model_size**-0.5)
        self.register_buffer(
            "positions", sinusoidal_positions(max_length, model_size), persistent=False
        )
        self.scale = math.sqrt(model_size)
        check_dropout("dropout", dropout)
        self.dropout = nn.Dropout(dropout)

        def layer_kwargs() -> dict:
            return dict(
                d_model=model_size,
                nhead=num_heads,
                dim_feedforward=feedforward_size,
                dropout=dropout,
                batch_first=True,
                norm_first=True,
            )

        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(**layer_kwargs()),
            encoder_layers,
            norm=nn.LayerNorm(model_size),
            enable_nested_tensor=False,
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(**layer_kwargs()),
            decoder_layers,
            norm=nn.LayerNorm(model_size),
        )

    def _positions(self, first: int, end: int) -> torch.Tensor:
        """The encodings of positions ``first .. end - 1``."""
        if end <= self.max_length:
            return self.positions[first:end]
        table = sinusoidal_positions(end - first, self.output_size, self.positions.device, first)
        return table.to(self.positions.dtype)  # (as the table: bf16 under bf16-true)

    def _embed(self, table: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
        return self.dropout(table(tokens) * self.scale + self._positions(0, tokens.size(1)))

    def encode(self, source: torch.Tensor, source_padding: torch.Tensor) -> torch.Tensor:
        """``source [B, S]`` ids -> memory ``[B, S, d]``."""
        x = self._embed(self.source_embedding, source)
        return self.encoder(x, src_key_padding_mask=source_padding)

    def decode(
        self, target_input: torch.Tensor, memory: torch.Tensor, source_padding: torch.Tensor
    ) -> torch.Tensor:
        """``target_input [B, T]`` (BOS + prefix) -> context vectors ``[B, T, d]``."""
        length = target_input.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(
            length, device=target_input.device, dtype=memory.dtype
        )
        x = self._embed(self.embedding, target_input)
        return self.decoder(
            x,
            memory,
            tgt_mask=causal,
            tgt_is_causal=True,
            memory_key_padding_mask=source_padding,
        )

    def decode_step(
        self,
        target_input: torch.Tensor,
        memory: torch.Tensor,
        source_padding: torch.Tensor,
        cache: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The last position's context vector ``[B, d]`` for search, one new token at a time.

        Equal to ``decode(target_input, ...)[:, -1]`` in eval mode, but only the last token
        runs through the layers: the decoder is causal, so the earlier positions' inputs to
        each layer's self-attention never change and ``cache`` keeps them (one ``[B, t-1, d]``
        tensor per layer, as returned by the previous step; ``None`` at the first step).
        Reorder or shrink the cache with the batch rows between steps (``c[rows]``).
        """
        position = target_input.size(1) - 1
        last = target_input[:, -1:]
        x = self.embedding(last) * self.scale + self._positions(position, position + 1)
        x = self.dropout(x)
        new_cache = []
        # the pre-norm layer of nn.TransformerDecoderLayer, written out for one query position
        for i, layer in enumerate(self.decoder.layers):
            h = layer.norm1(x)
            keys = h if cache is None else torch.cat((cache[i], h), dim=1)
            new_cache.append(keys)
            x = x + layer.dropout1(layer.self_attn(h, keys, keys, need_weights=False)[0])
            h = layer.norm2(x)
            attended = layer.multihead_attn(
                h, memory, memory, key_padding_mask=source_padding, need_weights=False
            )[0]
            x = x + layer.dropout2(attended)
            h = layer.linear2(layer.dropout(layer.activation(layer.linear1(layer.norm3(x)))))
            x = x + layer.dropout3(h)
        return self.decoder.norm(x)[:, 0], new_cache

    def forward(
        self, source: torch.Tensor, source_padding: torch.Tensor, target_input: torch.Tensor
    ) -> torch.Tensor:
        return self.decode(target_input, self.encode(source, source_padding), source_padding)
