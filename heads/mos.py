"""Mixture of Softmaxes (Yang et al. 2018; mos-hybrid-lightrnn-bpe.txt Eq. 1).

``P(x|c) = sum_k pi_{c,k} softmax(W h_{c,k})_x`` with ``h_{c,k} = tanh(H_k g_c)`` and
``pi_c = softmax(U g_c)``, computed in log space:
``log P = logsumexp_k(log pi_k + log_softmax_k)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import Head, HeadOutput, check_positive_int, float32_no_autocast, upcast


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

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> HeadOutput:
        # Only log P(target) is needed: per component, logit[target] - logsumexp(logits).
        self.check_inputs(hidden, target)
        log_prior, logits = self._component_log_probs(hidden)
        with float32_no_autocast(hidden.device):
            safe_target = target.clamp_min(0).view(-1, 1, 1).expand(-1, self.num_components, 1)
            target_logit = logits.gather(-1, safe_target).squeeze(-1)
            component_log_prob = target_logit - torch.logsumexp(logits, dim=-1)
            target_log_prob = torch.logsumexp(log_prior + component_log_prob, dim=-1)
        return self.output_from_target_log_prob(target_log_prob, target)

    def tie_output_embedding(self, weight: nn.Parameter) -> None:
        self._tie("weight", weight)
