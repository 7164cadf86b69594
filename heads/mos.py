"""Mixture of Softmaxes (Yang et al. 2018; mos-hybrid-lightrnn-bpe.txt Eq. 1).

``P(x|c) = sum_k pi_{c,k} softmax(W h_{c,k})_x`` with ``h_{c,k} = tanh(H_k g_c)`` and
``pi_c = softmax(U g_c)``, computed in log space:
``log P = logsumexp_k(log pi_k + log_softmax_k)``.

Training never builds the ``[N, K, V]`` component logits. By the ``rows`` plan (a CPU's
where the column plan would recompute, as at most MoS sizes) the mixture's mean loss and its
gradient come in one forward, by tiles of tokens with all their ``K`` component rows
(``heads/kernels/rows_ce.py``); by the column plans each of the
``K N`` component rows ``h_{c,k}`` goes through the fused linear + log-sum-exp primitive,
giving its cross-entropy ``CE_k = lse_k - z_{k,t}``, and ``nll = -logsumexp_k(log pi_k -
CE_k)``: memory ``O(K N)`` beyond one vocabulary chunk. Label smoothing (column plans only)
sums ``sum_x log P(x)`` chunk by chunk, the chunks recomputed in its backward
(``heads/kernels/mixture_lse.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from heads.base import (
    Head,
    HeadOutput,
    check_dropout,
    check_label_smoothing,
    check_positive_int,
    float32_no_autocast,
    output_bias,
    upcast,
)
from heads.cross_entropy import IGNORE_INDEX
from heads.fused_cross_entropy import (
    LossOptions,
    linear_lse,
    mean_cross_entropy,
    plan_tiles,
    resolve_plan,
)
from heads.kernels.chunks import accumulation_dtype, compute_dtype, spans
from heads.kernels.compiled_lse import CompiledMixtureLogProbSum
from heads.kernels.locked_dropout import locked_dropout
from heads.kernels.mixture_lse import MixtureLogProbSum, column_chunk

# columns of the exact log_prob per block (evaluation): [N, K, block] at a time
_EVAL_ENTRIES = 1 << 24


class MoSHead(Head):
    """Mixture of ``num_components`` softmaxes sharing the output embedding ``W``.

    Args:
        hidden_size: size of the context vectors ``g_c``.
        vocab_size: number of classes.
        num_components: K, the number of mixture components (15 in the MoS paper's PTB runs).
        embedding_size: size ``d`` of the per-component contexts ``h_{c,k}`` and of ``W``.
            Default: ``hidden_size``.
        context_dropout: dropout on ``h_{c,k}`` (MoS's "dropoutl").
        locked_dropout: where the task gives the rows' layout (``forward``'s
            ``sequence_length``), one ``context_dropout`` mask per sequence over its ``K d``
            latent features, shared by its steps, as the MoS code's
            ``self.lockdrop(latent, self.dropoutl)`` (``heads/kernels/locked_dropout.py``);
            False, or without the layout: a mask per row.
        bias: per-class bias in each component softmax.
        zipf_bias_init: start the bias at the centred log-probabilities of a Zipf law over the
            frequency-sorted ids (``heads.base.zipf_log_prior``), as every head with a bias
            does, so that head comparisons start alike; False: at zero.
    """

    capturable = True  # its step depends on the batch's shape alone (heads/graphs.py)

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_components: int = 15,
        embedding_size: int | None = None,
        context_dropout: float = 0.0,
        bias: bool = True,
        zipf_bias_init: bool = True,
        locked_dropout: bool = False,
    ) -> None:
        super().__init__(hidden_size, vocab_size)
        check_positive_int("num_components", num_components)
        embedding_size = hidden_size if embedding_size is None else embedding_size
        check_positive_int("embedding_size", embedding_size)
        self.num_components = num_components
        self.embedding_size = embedding_size
        # H_k, with a bias (Eq. 2 writes none; Yang et al.'s code has one)
        self.context = nn.Linear(hidden_size, num_components * embedding_size)
        self.prior = nn.Linear(hidden_size, num_components, bias=False)  # U
        check_dropout("context_dropout", context_dropout)
        self.context_dropout = nn.Dropout(context_dropout)
        self.locked_dropout = locked_dropout
        self.weight = nn.Parameter(torch.empty(vocab_size, embedding_size))
        self.bias = output_bias(vocab_size, zipf_bias_init) if bias else None
        self.zipf_bias_init = zipf_bias_init
        nn.init.normal_(self.weight, std=embedding_size**-0.5)

    def _mixture(
        self, hidden: torch.Tensor, sequence_length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Component contexts ``h_{c,k}`` ``[N, K, d]`` and ``log pi`` ``[N, K]`` (float32).
        The context dropout is applied here, before any plan: every plan (rows, columns,
        compiled, captured) takes the dropped contexts."""
        n = hidden.size(0)
        # sizes named, not -1: a batch of no rows (N = 0) has no size to infer
        contexts = torch.tanh(self.context(hidden))
        contexts = contexts.view(n, self.num_components, self.embedding_size)
        # a mask per row, or with locked_dropout the MoS code's lockdrop(latent, dropoutl):
        # one mask [B, 1, K d] over each sequence's T steps
        locked = sequence_length if self.locked_dropout else None
        contexts = locked_dropout(contexts, self.context_dropout.p, self.training, locked)
        prior_logits = self.prior(hidden)
        with float32_no_autocast(hidden.device):
            return contexts, upcast(prior_logits).log_softmax(dim=-1)

    def _component_lse(self, contexts: torch.Tensor, target: torch.Tensor | None, smoothing=False):
        """The primitive over the ``K N`` component rows (row ``n K + k``)."""
        n, k, d = contexts.shape
        ids = None if target is None else target.repeat_interleave(k)
        return linear_lse(contexts.reshape(n * k, d), self.weight, self.bias, ids,
                          logit_sum=smoothing, options=self.loss_options)  # fmt: skip

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact ``[N, V]`` log-probabilities, by blocks of the vocabulary: no ``[N, K, V]``."""
        self.check_inputs(hidden)
        contexts, log_prior = self._mixture(hidden)
        n, k, _ = contexts.shape
        lse = self._component_lse(contexts, None).lse.view(n, k)
        shift = (log_prior - lse).unsqueeze(-1)  # log pi_k - log Z_k
        # the products as the primitive computed them (its dtype, float32 bias), so that
        # each component's block log-probabilities use exactly the normaliser above
        flat = contexts.reshape(n * k, self.embedding_size).to(compute_dtype(contexts, self.weight))
        acc = accumulation_dtype(contexts, self.weight)
        width = max(1, _EVAL_ENTRIES // max(n * k, 1))
        blocks = []
        with float32_no_autocast(hidden.device):
            for a, b in spans(self.vocab_size, width):
                logits = column_chunk(flat, self.weight, self.bias, a, b, acc).view(n, k, b - a)
                blocks.append(torch.logsumexp(shift + logits, dim=1))
        if not blocks:
            return log_prior.new_zeros(n, 0)
        return torch.cat(blocks, dim=-1) if len(blocks) > 1 else blocks[0]

    def forward(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float = 0.0,
        sequence_length: int | None = None,
    ) -> HeadOutput:
        # log P(t) = logsumexp_k(log pi_k - CE_k), CE_k = lse_k - z_{k,t}: K N rows of the
        # fused primitive, nothing [N, K, V]
        self.check_inputs(hidden, target)
        check_label_smoothing(label_smoothing)
        contexts, log_prior = self._mixture(hidden, sequence_length)
        n, k, d = contexts.shape
        mean = mean_cross_entropy(
            contexts.reshape(n * k, d), self.weight, self.bias, target, log_prior=log_prior,
            label_smoothing=label_smoothing, options=self.loss_options,
        )  # fmt: skip
        if mean is not None:  # the rows plan: the loss's gradient computed in the forward
            return HeadOutput(mean.loss, mean.nll, mean.loss.new_zeros(()))
        ids = torch.where(target != IGNORE_INDEX, target, -1)
        parts = self._component_lse(contexts, ids)
        lse = parts.lse.view(n, k)
        component_nll = lse - parts.target_logit.view(n, k)
        nll = -torch.logsumexp(log_prior - component_nll, dim=-1)
        smoothing = None
        if label_smoothing:
            log_prob_sum = mixture_log_prob_sum(
                contexts, self.weight, self.bias, log_prior - lse, self.loss_options
            )
            smoothing = -log_prob_sum / self.vocab_size
        return self.output(nll, target, smoothing=smoothing, label_smoothing=label_smoothing)

    def tie_output_embedding(self, weight: nn.Parameter) -> None:
        self._tie("weight", weight)


def mixture_log_prob_sum(
    contexts: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    shift: torch.Tensor,
    options: LossOptions,
) -> torch.Tensor:
    """``sum_x log P(x|c)`` per row (label smoothing's uniform term, Eq. 1 in log space):
    ``sum_x logsumexp_k(a_k + z_{k,x})`` with ``a_k = log pi_k - log Z_k`` ``[N, K]`` and the
    component logits ``z = h_{c,k} W^T + b``, by vocabulary chunks recomputed in the
    backward: no ``[N, K, V]`` tensor exists."""
    n, k, _ = contexts.shape
    _, width = plan_tiles(n * k, weight.size(0), contexts.device, options, entries_per_column=2)
    dtype = compute_dtype(contexts, weight)
    if resolve_plan(options.plan, contexts) == "compiled":  # the GPU plan: a compiled chunk body
        acc = accumulation_dtype(contexts, weight, shift)
        return CompiledMixtureLogProbSum.apply(contexts, weight, bias, shift, dtype, acc, width)
    return MixtureLogProbSum.apply(contexts, weight, bias, shift, dtype, width)
