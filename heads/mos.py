"""Mixture of Softmaxes (Yang et al. 2018; mos-hybrid-lightrnn-bpe.txt Eq. 1).

``P(x|c) = sum_k pi_{c,k} softmax(W h_{c,k})_x`` with ``h_{c,k} = tanh(H_k g_c)`` and
``pi_c = softmax(U g_c)``, computed in log space:
``log P = logsumexp_k(log pi_k + log_softmax_k)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from heads.base import (
    Head,
    HeadOutput,
    check_label_smoothing,
    check_positive_int,
    float32_no_autocast,
    upcast,
)

# columns of the vocabulary per step of the label-smoothing sum (its [N, K, block] pieces are
# recomputed in the backward, so memory stays O(N K block))
_SMOOTHING_BLOCK = 4096


def _block_log_prob_sum(
    logits: torch.Tensor, log_prior: torch.Tensor, component_lse: torch.Tensor
) -> torch.Tensor:
    """``sum_x log P(x)`` over one block of columns, ``logits`` ``[N, K, block]``."""
    log_probs = logits - component_lse.unsqueeze(-1) + log_prior.unsqueeze(-1)
    return torch.logsumexp(log_probs, dim=1).sum(-1)


def mixture_log_prob_sum(
    logits: torch.Tensor, log_prior: torch.Tensor, component_lse: torch.Tensor
) -> torch.Tensor:
    """``sum_x log P(x|c)`` per row (label smoothing's uniform term, Eq. 1 in log space) from
    the component logits ``[N, K, V]``, ``log pi`` ``[N, K]`` and each component's log-sum-exp
    ``[N, K]``, block by block over the vocabulary with each block recomputed in the backward:
    no ``[N, V]`` or further ``[N, K, V]`` tensor is kept."""
    total = logits.new_zeros(logits.size(0))
    for start in range(0, logits.size(-1), _SMOOTHING_BLOCK):
        block = logits[..., start : start + _SMOOTHING_BLOCK]
        total = total + checkpoint(
            _block_log_prob_sum, block, log_prior, component_lse, use_reentrant=False
        )
    return total


class MoSHead(Head):
    """Mixture of ``num_components`` softmaxes sharing the output embedding ``W``.

    Args:
        hidden_size: size of the context vectors ``g_c``.
        vocab_size: number of classes.
        num_components: K, the number of mixture components (15 in the MoS paper's PTB runs).
        embedding_size: size ``d`` of the per-component contexts ``h_{c,k}`` and of ``W``.
            Default: ``hidden_size``.
        context_dropout: dropout on ``h_{c,k}`` (MoS's "dropoutl").
        bias: per-class bias in each component softmax.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_components: int = 15,
        embedding_size: int | None = None,
        context_dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__(hidden_size, vocab_size)
        check_positive_int("num_components", num_components)
        embedding_size = hidden_size if embedding_size is None else embedding_size
        check_positive_int("embedding_size", embedding_size)
        self.num_components = num_components
        self.embedding_size = embedding_size
        self.context = nn.Linear(hidden_size, num_components * embedding_size)  # H_k
        self.prior = nn.Linear(hidden_size, num_components, bias=False)  # U
        self.context_dropout = nn.Dropout(context_dropout)
        self.weight = nn.Parameter(torch.empty(vocab_size, embedding_size))
        self.bias = nn.Parameter(torch.zeros(vocab_size)) if bias else None
        nn.init.normal_(self.weight, std=embedding_size**-0.5)

    def _component_log_probs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``log pi [N, K]`` and component logits ``[N, K, V]`` (float32)."""
        n = hidden.size(0)
        contexts = torch.tanh(self.context(hidden)).view(n, self.num_components, -1)
        contexts = self.context_dropout(contexts)
        logits = F.linear(contexts, self.weight, self.bias)
        prior_logits = self.prior(hidden)
        with float32_no_autocast(hidden.device):
            log_prior = upcast(prior_logits).log_softmax(dim=-1)
            return log_prior, upcast(logits)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        self.check_inputs(hidden)
        log_prior, logits = self._component_log_probs(hidden)
        with float32_no_autocast(hidden.device):
            return torch.logsumexp(log_prior.unsqueeze(-1) + logits.log_softmax(dim=-1), dim=1)

    def forward(
        self, hidden: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
    ) -> HeadOutput:
        # Only log P(target) is needed: per component, logit[target] - logsumexp(logits).
        self.check_inputs(hidden, target)
        check_label_smoothing(label_smoothing)
        log_prior, logits = self._component_log_probs(hidden)
        with float32_no_autocast(hidden.device):
            safe_target = target.clamp_min(0).view(-1, 1, 1).expand(-1, self.num_components, 1)
            target_logit = logits.gather(-1, safe_target).squeeze(-1)
            component_lse = torch.logsumexp(logits, dim=-1)  # [N, K]
            target_log_prob = torch.logsumexp(log_prior + target_logit - component_lse, dim=-1)
            smoothing = None
            if label_smoothing:
                log_prob_sum = mixture_log_prob_sum(logits, log_prior, component_lse)
                smoothing = -log_prob_sum / self.vocab_size
        return self.output(
            -target_log_prob, target, smoothing=smoothing, label_smoothing=label_smoothing
        )

    def tie_output_embedding(self, weight: nn.Parameter) -> None:
        self._tie("weight", weight)
