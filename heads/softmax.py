"""Full softmax output layer: ``log_softmax(W h + b)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import Head, HeadOutput, check_positive_int, float32_no_autocast, upcast


class SoftmaxHead(Head):
    """Full softmax over the vocabulary.

    Args:
        hidden_size: size of the context vectors given to the head.
        vocab_size: number of classes (linked from the data module by the CLI).
        embedding_size: size of the output token embeddings ``W``; when it differs from
            ``hidden_size`` a linear projection maps the context first (needed for weight
            tying with a smaller input embedding). Default: ``hidden_size``.
        bias: learn a per-class bias ``b``.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        embedding_size: int | None = None,
        bias: bool = True,
    ) -> None:
        super().__init__(hidden_size, vocab_size)
        embedding_size = hidden_size if embedding_size is None else embedding_size
        check_positive_int("embedding_size", embedding_size)
        self.embedding_size = embedding_size
        self.projection = (
            nn.Linear(hidden_size, embedding_size) if embedding_size != hidden_size else None
        )
        self.weight = nn.Parameter(torch.empty(vocab_size, embedding_size))
        self.bias = nn.Parameter(torch.zeros(vocab_size)) if bias else None
        nn.init.normal_(self.weight, std=embedding_size**-0.5)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.projection is not None:
            hidden = self.projection(hidden)
        return F.linear(hidden, self.weight, self.bias)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        self.check_inputs(hidden)
        logits = self.logits(hidden)
        with float32_no_autocast(hidden.device):
            return upcast(logits).log_softmax(dim=-1)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> HeadOutput:
        self.check_inputs(hidden, target)
        logits = self.logits(hidden)
        with float32_no_autocast(hidden.device):
            # cross_entropy fuses log-softmax and gather: no second [N, V] tensor is kept.
            nll = F.cross_entropy(upcast(logits), target, reduction="none")
        return self.output_from_target_log_prob(-nll, target)

    def tie_output_embedding(self, weight: nn.Parameter) -> None:
        self._tie("weight", weight)
