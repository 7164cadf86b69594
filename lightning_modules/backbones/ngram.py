"""N-gram backbone: the context vector is a function of the last ``order`` tokens only (the
state of an order-``k`` Markov chain, ``datamodules/markov_chain.py``), so that a head's
quality against the chain's optimum measures the head, not the backbone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lightning_modules.backbones.base import LMBackbone
from lightning_modules.errors import ModelConfigError


class NGramBackbone(LMBackbone):
    """Embeddings of the last ``order`` tokens, concatenated; with ``order`` 1 and no
    ``hidden_layers`` the context vector is the previous token's embedding itself (a free
    ``d``-vector per context: the head is the only bottleneck). Otherwise a ``tanh`` MLP maps
    the concatenation to ``output_size``. The last ``order - 1`` tokens of a window are
    carried to the next one as the state.

    Args:
        vocab_size: linked from the data module by the CLI.
        output_size: ``d``, the size of the context vectors given to the head.
        order: how many previous tokens the context holds.
        embedding_size: per-token embedding size (default ``output_size``).
        hidden_layers: ``tanh`` layers of width ``output_size`` after the concatenation.
        init_std: standard deviation of the embeddings' normal start.
    """

    carries_state = True

    @classmethod
    def output_size_from(cls, init_args: Mapping[str, Any]) -> int:
        return init_args.get("output_size", 32)

    def __init__(
        self,
        vocab_size: int,
        output_size: int = 32,
        order: int = 1,
        embedding_size: int | None = None,
        hidden_layers: int = 0,
        init_std: float = 0.1,
    ) -> None:
        super().__init__()
        if min(vocab_size, output_size, order) < 1 or hidden_layers < 0:
            raise ModelConfigError(
                f"model.backbone vocab_size, output_size and order must be positive and "
                f"hidden_layers >= 0, got {vocab_size}, {output_size}, {order}, {hidden_layers}"
            )
        embedding_size = output_size if embedding_size is None else embedding_size
        self.order, self.output_size = order, output_size
        self.embedding = nn.Embedding(vocab_size, embedding_size)
        nn.init.normal_(self.embedding.weight, std=init_std)
        width = order * embedding_size
        layers: list[nn.Module] = []
        for _ in range(hidden_layers):
            layers += [nn.Linear(width, output_size), nn.Tanh()]
            width = output_size
        if width != output_size:
            layers.append(nn.Linear(width, output_size))
        self.mlp = nn.Sequential(*layers)

    def forward(
        self, tokens: torch.Tensor, state: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        k = self.order
        if k == 1:
            return self.mlp(self.embedding(tokens)), None
        if state is None:  # no history yet: the first tokens repeat the earliest one
            state = tokens[:, :1].expand(-1, k - 1)
        history = torch.cat((state.to(tokens.dtype), tokens), dim=1)
        length = tokens.size(1)
        # position t sees tokens t-k+1..t (oldest first)
        parts = [self.embedding(history[:, i : i + length]) for i in range(k)]
        return self.mlp(torch.cat(parts, dim=-1)), history[:, -(k - 1) :]
