"""Adaptive softmax (Grave, Joulin, Cisse, Grangier, Jegou, ICML 2017; adaptive-softmax.txt).

A head short-list of the ``k_h`` most frequent words plus one logit per tail cluster; tail
cluster i projects the hidden state to ``d / div^i`` before its own classifier (Sec. 4.2,
"Adapting the classifier capacity"). ``log P(w) = log P_head(cluster(w)) + log P_i(w)``
(Eq. 3 of the two-level model), and the loss evaluates only the clusters the batch's targets
fall in.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from torch import nn

from heads.adaptive_cutoffs import CostModel, calibrate, optimal_cutoffs, zipf_probabilities
from heads.base import (
    Head,
    HeadOutput,
    float32_no_autocast,
    upcast,
)
from heads.cross_entropy import linear_cross_entropy_nll
from heads.errors import HeadConfigError

log = logging.getLogger(__name__)


class AdaptiveSoftmaxHead(Head):
    """Adaptive softmax with given or automatically chosen cut-offs.

    Args:
        hidden_size: size ``d`` of the context vectors.
        vocab_size: number of classes; ids sorted by decreasing frequency.
        cutoffs: increasing word positions ending the head and every tail cluster but the
            last, e.g. ``[2000, 10000]`` (the last cluster ends at ``vocab_size``), or
            ``"auto"``: the paper's dynamic program on the computation-time model.
        div_value: tail cluster i works in ``d // div_value**i`` dimensions.
        head_bias: learn a bias for the head classifier.
        num_clusters: for ``auto``: the number of tail clusters J (the paper uses 2 to 5), or
            ``None`` for the J in 1..4 with the least modelled cost (usually the most: the
            model charges nothing for the capacity lost in deep clusters).
        cost_model: for ``auto``: ``{c, lam, k0b0}`` of ``g(k, B)`` in ms, or ``None`` to measure
            them on this machine (cached per device and hidden size, and logged).
        calibration_batch: for ``auto``: the batch size B (tokens per step) the cost is for.
        token_counts: for ``auto``: training counts per id; default a Zipf law over the
            frequency-sorted ids.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        cutoffs: Sequence[int] | Literal["auto"] = "auto",
        div_value: float = 4.0,
        head_bias: bool = False,
        num_clusters: int | None = 2,
        cost_model: dict[str, float] | None = None,
        calibration_batch: int = 2048,
        token_counts: Sequence[int] | None = None,
    ) -> None:
        super().__init__(hidden_size, vocab_size)
        if div_value < 1:
            raise HeadConfigError(f"AdaptiveSoftmaxHead div_value must be >= 1, got {div_value}")
        self.div_value = div_value
        if cutoffs == "auto":
            cutoffs = self._auto_cutoffs(num_clusters, cost_model, calibration_batch, token_counts)
        self.cutoffs = self._check_cutoffs(list(cutoffs), vocab_size)
        self.shortlist_size = self.cutoffs[0]
        self.num_clusters = len(self.cutoffs) - 1
        # cluster starts, to find each target's cluster in forward (moves with the module)
        self.register_buffer("cluster_starts", torch.tensor(self.cutoffs[:-1]), persistent=False)
        bounds = self.cutoffs
        self.head = nn.Linear(hidden_size, self.shortlist_size + self.num_clusters, head_bias)
        self.tail = nn.ModuleList()
        for i in range(1, self.num_clusters + 1):
            reduced = int(hidden_size // div_value**i)
            if reduced < 1:
                raise HeadConfigError(
                    f"AdaptiveSoftmaxHead tail cluster {i} would have hidden_size // div_value^{i}"
                    f" = 0 dimensions: use fewer clusters or a smaller div_value"
                )
            self.tail.append(
                nn.Sequential(
                    nn.Linear(hidden_size, reduced, bias=False),
                    nn.Linear(reduced, bounds[i] - bounds[i - 1], bias=False),
                )
            )

    @staticmethod
    def _check_cutoffs(cutoffs: list[int], vocab_size: int) -> list[int]:
        if cutoffs and cutoffs[-1] == vocab_size:
            cutoffs = cutoffs[:-1]
        ok = (
            len(cutoffs) >= 1
            and all(isinstance(c, int) for c in cutoffs)
            and all(0 < a < b for a, b in zip(cutoffs, cutoffs[1:], strict=False))
            and 0 < cutoffs[0]
            and cutoffs[-1] < vocab_size
        )
        if not ok:
            raise HeadConfigError(
                f"AdaptiveSoftmaxHead cutoffs must be increasing positive integers below the "
                f"vocabulary size {vocab_size}, got {cutoffs}"
            )
        return [*cutoffs, vocab_size]

    def _auto_cutoffs(
        self,
        num_clusters: int | None,
        cost_model: dict[str, float] | None,
        batch: int,
        token_counts: Sequence[int] | None,
    ) -> list[int]:
        if token_counts is not None:
            if len(token_counts) != self.vocab_size:
                raise HeadConfigError(
                    f"token_counts has {len(token_counts)} entries for {self.vocab_size} classes"
                )
            probs = np.asarray(token_counts, dtype=np.float64) + 1e-12
            probs /= probs.sum()
        else:
            probs = zipf_probabilities(self.vocab_size)
        model = CostModel(**cost_model) if cost_model else calibrate(self.hidden_size)
        choices = [num_clusters] if num_clusters else range(1, 5)
        options = [
            optimal_cutoffs(probs, j, model, float(batch))
            for j in choices
            if j < self.vocab_size and self.hidden_size // self.div_value**j >= 1
        ]
        if not options:
            raise HeadConfigError("no cut-offs fit this vocabulary and hidden size")
        cuts, cost = min(options, key=lambda option: option[1])
        log.info("adaptive softmax cut-offs %s (modelled %.3f ms/step, %s)", cuts, cost, model)
        return cuts

    # -- checkpoints: the cut-offs are structure, and "auto" may pick others elsewhere ----
    def get_extra_state(self) -> dict:
        return {"cutoffs": self.cutoffs, "div_value": self.div_value}

    def set_extra_state(self, state: dict) -> None:
        if list(state["cutoffs"]) != self.cutoffs or state["div_value"] != self.div_value:
            raise HeadConfigError(
                f"the checkpoint's AdaptiveSoftmaxHead has cutoffs {state['cutoffs'][:-1]} and "
                f"div_value {state['div_value']}, this one {self.cutoffs[:-1]} and "
                f"{self.div_value}: pass --model.head.init_args.cutoffs "
                f"'{state['cutoffs'][:-1]}' (and the same div_value)"
            )

    # -- the contract -------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> HeadOutput:
        self.check_inputs(hidden, target)
        keep = target >= 0
        # 0 for the short-list, i for tail cluster i, -1 where ignored
        # (a comparison per cluster start: far cheaper than bucketize for a handful of clusters)
        in_cluster = (target.unsqueeze(-1) >= self.cluster_starts).sum(-1)
        cluster = torch.where(keep, in_cluster, -1)
        # Head: the word itself if in the short-list, else its cluster's entry.
        head_target = torch.where(
            cluster == 0, target, self.shortlist_size + cluster - 1
        ).masked_fill(~keep, -100)
        # product and loss in one function per classifier: no [N, C] gradient in the backward
        nll = linear_cross_entropy_nll(hidden, self.head.weight, self.head.bias, head_target)
        # One sort groups the rows by cluster (ignored and short-list rows first), so each
        # tail cluster is a contiguous slice of one gather: one index_select (and one
        # scatter in its backward) for all tail clusters instead of one per cluster.
        order = torch.argsort(cluster)
        sizes = torch.bincount(cluster + 1, minlength=self.num_clusters + 2).tolist()
        tail_rows = order[sizes[0] + sizes[1] :]
        if tail_rows.numel() == 0:
            return self.output_from_target_log_prob(-nll, target)
        tail_hidden = hidden.index_select(0, tail_rows)
        tail_target = target.index_select(0, tail_rows)
        cluster_nll, start = [], 0
        for i, (tail, size) in enumerate(zip(self.tail, sizes[2:], strict=True), start=1):
            if size == 0:
                continue  # the loss only touches the clusters this batch needs
            projected = tail[0](tail_hidden[start : start + size])  # d -> d / div^i
            relative = tail_target[start : start + size] - self.cutoffs[i - 1]
            cluster_nll.append(linear_cross_entropy_nll(projected, tail[1].weight, None, relative))
            start += size
        nll.index_add_(0, tail_rows, torch.cat(cluster_nll).to(nll.dtype))
        return self.output_from_target_log_prob(-nll, target)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        self.check_inputs(hidden)
        head_logits = self.head(hidden)
        tail_logits = [tail(hidden) for tail in self.tail]
        with float32_no_autocast(hidden.device):
            head_lp = upcast(head_logits).log_softmax(-1)
            parts = [head_lp[:, : self.shortlist_size]]
            for i, logits in enumerate(tail_logits):
                cluster_lp = head_lp[:, self.shortlist_size + i : self.shortlist_size + i + 1]
                parts.append(upcast(logits).log_softmax(-1) + cluster_lp)
            return torch.cat(parts, dim=-1)
