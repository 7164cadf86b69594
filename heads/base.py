"""The head contract shared by every output layer (DESIGN.md, "The head contract").

A head maps context vectors ``hidden [N, hidden_size]`` to a distribution over
``vocab_size`` class ids. It never assumes a backbone, a task or a vocabulary type.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from heads.cross_entropy import HALF_DTYPES, IGNORE_INDEX, cross_entropy_nll
from heads.errors import HeadConfigError


@dataclass
class HeadOutput:
    """What ``Head.forward`` returns.

    loss: mean negative log-likelihood over the positions that are not ignored.
    nll: ``[N]`` per-position negative log-likelihood, 0 where the target is ignored.
    aux_loss: scalar regulariser to add to the training loss (0 when the head has none).
    """

    loss: torch.Tensor
    nll: torch.Tensor
    aux_loss: torch.Tensor


def check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise HeadConfigError(f"{name} must be a positive integer, got {value!r}")


def float32_no_autocast(device: torch.device) -> torch.autocast:
    """Context where normalisations and reductions stay in float32 under mixed precision."""
    return torch.autocast(device_type=device.type, enabled=False)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision tensors to float32 for reductions; float32/float64 unchanged."""
    return x.float() if x.dtype in HALF_DTYPES else x


class Head(nn.Module):
    """Base class of every output layer: ``Head(hidden_size, vocab_size, **options)``.

    Subclasses implement :meth:`log_prob`; they override :meth:`forward` when the loss
    can be computed without the full ``[N, vocab_size]`` distribution, and :meth:`topk`
    when they have a faster search than ``log_prob(hidden).topk(k)``.
    """

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("vocab_size", vocab_size)
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size

    # -- the contract -------------------------------------------------------------------
    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact normalised log-probabilities ``[N, vocab_size]`` in float32."""
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> HeadOutput:
        self.check_inputs(hidden, target)
        log_probs = self.log_prob(hidden)
        return self.output_from_target_log_prob(self.gather_target(log_probs, target), target)

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely classes per row: ``(log_probs [N, k], indices [N, k])``."""
        check_positive_int("k", k)
        if k > self.vocab_size:
            raise HeadConfigError(f"top-k with k={k} exceeds the vocabulary size {self.vocab_size}")
        return self.log_prob(hidden).topk(k, dim=-1)

    def tie_output_embedding(self, weight: nn.Parameter) -> None:
        """Share the output token embeddings with an input embedding ``[vocab_size, d]``."""
        raise HeadConfigError(f"{type(self).__name__} does not support weight tying")

    # -- helpers for subclasses ---------------------------------------------------------
    def check_inputs(self, hidden: torch.Tensor, target: torch.Tensor | None = None) -> None:
        if hidden.dim() != 2 or hidden.size(-1) != self.hidden_size:
            raise ValueError(
                f"{type(self).__name__} expects hidden of shape [N, {self.hidden_size}], "
                f"got {tuple(hidden.shape)}"
            )
        if target is not None and target.shape != hidden.shape[:1]:
            raise ValueError(
                f"target must have shape [{hidden.size(0)}], got {tuple(target.shape)}"
            )

    @staticmethod
    def gather_target(log_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``log_probs[n, target[n]]``, 0 at ignored positions."""
        safe_target = target.clamp_min(0).unsqueeze(-1)
        return log_probs.gather(-1, safe_target).squeeze(-1)

    @staticmethod
    def output_from_target_log_prob(
        target_log_prob: torch.Tensor, target: torch.Tensor, aux_loss: torch.Tensor | None = None
    ) -> HeadOutput:
        """Build a :class:`HeadOutput` from ``log P(target)`` per position (float32)."""
        keep = target != IGNORE_INDEX
        target_log_prob = upcast(target_log_prob)
        nll = torch.where(keep, -target_log_prob, torch.zeros_like(target_log_prob))
        # clamp: an all-ignored batch gives loss 0, not NaN
        loss = nll.sum() / keep.sum().clamp_min(1)
        if aux_loss is None:
            aux_loss = nll.new_zeros(())
        return HeadOutput(loss=loss, nll=nll, aux_loss=aux_loss)

    def _tie(self, param_name: str, weight: nn.Parameter) -> None:
        own = getattr(self, param_name)
        if weight.shape != own.shape:
            raise HeadConfigError(
                f"cannot tie {type(self).__name__}.{param_name} of shape {tuple(own.shape)} "
                f"to an embedding of shape {tuple(weight.shape)}: set the head's embedding_size "
                f"to the backbone's embedding size ({weight.size(-1)})"
            )
        setattr(self, param_name, weight)


class SingleSoftmaxHead(Head):
    """A head whose distribution is one softmax over ``logits(hidden) [N, V]``.

    Subclasses implement :meth:`logits`; normalisation and loss run here, in float32.
    Their output embeddings live in ``self.weight`` ``[V, d]`` and can be tied.
    """

    weight: nn.Parameter

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        self.check_inputs(hidden)
        logits = self.logits(hidden)
        with float32_no_autocast(hidden.device):
            return upcast(logits).log_softmax(dim=-1)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> HeadOutput:
        self.check_inputs(hidden, target)
        logits = self.logits(hidden)
        with float32_no_autocast(hidden.device):
            nll = cross_entropy_nll(logits, target)  # float32 inside
        return self.output_from_target_log_prob(-nll, target)

    def tie_output_embedding(self, weight: nn.Parameter) -> None:
        self._tie("weight", weight)
