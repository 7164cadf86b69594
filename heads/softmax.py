"""Full softmax output layer: ``log_softmax(W h + b)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import (
    HeadOutput,
    SingleSoftmaxHead,
    check_label_smoothing,
    check_positive_int,
    output_bias,
)
from heads.fused_cross_entropy import (
    linear_cross_entropy,
    mean_cross_entropy,
    plain_cross_entropy,
    plain_loss_fits,
)


class SoftmaxHead(SingleSoftmaxHead):
    """Full softmax over the vocabulary.

    Args:
        hidden_size: size of the context vectors given to the head.
        vocab_size: number of classes (linked from the data module by the CLI).
        embedding_size: size of the output token embeddings ``W``; when it differs from
            ``hidden_size`` a linear projection maps the context first (needed for weight
            tying with a smaller input embedding). Default: ``hidden_size``.
        bias: learn a per-class bias ``b``.
        zipf_bias_init: start the bias at the centred log-probabilities of a Zipf law over the
            frequency-sorted ids (``heads.base.zipf_log_prior``), as every head with a bias
            does, so that head comparisons start alike; False: at zero.
    """

    capturable = True  # its step depends on the batch's shape alone (heads/graphs.py)

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        embedding_size: int | None = None,
        bias: bool = True,
        zipf_bias_init: bool = True,
    ) -> None:
        super().__init__(hidden_size, vocab_size)
        embedding_size = hidden_size if embedding_size is None else embedding_size
        check_positive_int("embedding_size", embedding_size)
        self.embedding_size = embedding_size
        self.projection = (
            nn.Linear(hidden_size, embedding_size) if embedding_size != hidden_size else None
        )
        self.weight = nn.Parameter(torch.empty(vocab_size, embedding_size))
        self.bias = output_bias(vocab_size, zipf_bias_init) if bias else None
        self.zipf_bias_init = zipf_bias_init
        nn.init.normal_(self.weight, std=embedding_size**-0.5)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.projection is not None:
            hidden = self.projection(hidden)
        return F.linear(hidden, self.weight, self.bias)

    def forward(
        self, hidden: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
    ) -> HeadOutput:
        # the product and the loss fused by vocabulary chunks: no [N, V] tensor
        self.check_inputs(hidden, target)
        check_label_smoothing(label_smoothing)
        if self.projection is not None:
            hidden = self.projection(hidden)
        if plain_loss_fits(self.loss_options, hidden.device, hidden.size(0), self.vocab_size):
            # a launch-bound step on CUDA: one product and PyTorch's log-softmax
            nll, smoothing = plain_cross_entropy(hidden, self.weight, self.bias, target,
                                                 label_smoothing > 0)  # fmt: skip
            return self.output(nll, target, smoothing=smoothing, label_smoothing=label_smoothing)
        mean = mean_cross_entropy(
            hidden, self.weight, self.bias, target, label_smoothing=label_smoothing,
            options=self.loss_options,
        )  # fmt: skip
        if mean is not None:  # the rows plan: the loss's gradient computed in the forward
            return HeadOutput(mean.loss, mean.nll, mean.loss.new_zeros(()))
        rows = linear_cross_entropy(
            hidden, self.weight, self.bias, target, label_smoothing=label_smoothing,
            options=self.loss_options,
        )  # fmt: skip
        return self.output(
            rows.nll, target, smoothing=rows.smoothing, label_smoothing=label_smoothing
        )
