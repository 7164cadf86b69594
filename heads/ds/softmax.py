"""Doubly Sparse softmax: a sparse mixture of sparse experts (Liao et al.; ds-softmax.txt).

Top-1 gate (Eq. 1)::

    G(h) = softmax(U h),  k* = argmax_k G_k(h),  only G_{k*}(h) is kept

and the selected expert's distribution (Eq. 2) over the classes still alive in it::

    P(c | h) = softmax_c(G_{k*}(h) W^(k*)_c h)

The gradient reaches every gate row through the normalisation of ``G``.

Storage is sparse from the start: all experts' surviving rows are packed in one parameter
``weight [R, d]``; ``row_class [R]`` names each row's class (ascending within an expert) and
``expert_offsets [K + 1]`` delimits the experts. Memory and compute therefore follow the
surviving rows ``R = sum_k |v_k|``, not ``K x V``. Pruning and mitosis
(``app/callbacks/ds/pruning.py``, ``app/callbacks/ds/mitosis.py``) change this structure; it is
saved in the state dict and a freshly built head resizes itself to it when loading.

Two distributions, equal while no row has been pruned:

- ``log_prob`` / ``topk``: the sparse inference distribution of the issue, over the alive
  classes of the selected expert only (``-inf`` elsewhere).
- ``forward`` (the training loss): Algorithm 1 zeroes a pruned row, ``W^(k)_c = 0``, so the
  class keeps the logit 0 in the normaliser of Eq. 2. The ``V - |v_k|`` zero logits add the
  constant ``log(V - |v_k|)`` to a log-sum-exp: the loss stays finite for a target outside the
  expert, at the cost of a softmax over ``|v_k|`` rows. :meth:`training_log_prob` returns this
  distribution densely (for tests and analysis).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import (
    Head,
    HeadOutput,
    check_label_smoothing,
    check_positive_int,
    sort_into_groups,
    upcast,
)
from heads.cross_entropy import IGNORE_INDEX
from heads.ds.inference import DSInference
from heads.ds.structure import DSStructure, float32_context, split_rows
from heads.ds.svd import SVDPreview
from heads.errors import HeadConfigError
from heads.fused_cross_entropy import linear_lse


def sum_over_ranks(local: torch.Tensor) -> torch.Tensor:
    """``local`` summed over the DDP ranks of the default group, differentiably; ``local``
    itself outside ``torch.distributed`` or in a world of one (no collective).

    The load balance's expert importance goes through it: ``CV^2`` is not linear in the
    importance, so the mean of the ranks' own terms is not the global batch's term. Summed,
    every rank computes the global batch's term. Gradient: the all-reduce's backward sums the
    ranks' upstream gradients, ``W g`` (every rank's ``g`` is the same: one term), and DDP
    divides the parameter gradients' sum by ``W``: ``(1/W) sum_r W g d imp_r / d theta =
    g d(sum_r imp_r) / d theta``, one process's gradient on the union of the batches, with
    no extra scale. A functional collective (torch's replacement for the deprecated
    ``torch.distributed.nn.functional.all_reduce``, which raises under ``torch.compile``;
    the same sum in its backward), on the device: nothing is read back. Its backward runs
    before any parameter's gradient is complete (autograd runs the nodes made later first,
    and the load term is made after every use of a parameter), so on every rank it comes
    before DDP's bucket all-reduces, in the same order."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return local
    from torch.distributed import _functional_collectives as collectives

    return collectives.all_reduce(local, "sum", dist.group.WORLD)


def _check_non_negative(name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or value < 0:
        raise HeadConfigError(f"{name} must be a non-negative number, got {value!r}")


# the state of the SoftmaxHead a DS head can start from (load_pretrained)
SOFTMAX_STATE = frozenset({"weight", "bias"})


class DSSoftmaxHead(Head):
    """DS-Softmax with K experts, each starting over the full class space.

    Args:
        hidden_size: size of the context vectors ``h``.
        vocab_size: number of classes ``|V|`` (linked from the data module by the CLI).
        num_experts: K at construction (mitosis starts with 2 and doubles).
        lambda_lasso: weight of the group lasso over class rows,
            ``sum_k sum_c ||W^(k)_c||_2``.
        lambda_expert: weight of the expert-level group lasso,
            ``sum_k sqrt(sum_c ||W^(k)_c||_2^2)``.
        lambda_load: weight of the load balance ``CV(sum_h G(h))^2`` (paper: 10). In a
            training step under DDP, ``sum_h`` runs over the global batch (every rank's
            tokens: :func:`sum_over_ranks`); in evaluation over the rank's own batch.
        init_std: std of the initial expert rows and gate. Default ``hidden_size ** -0.5``.
        bias: give every expert row a bias, ``G_k (W^(k)_c h + b^(k)_c)``. Not in Eq. 2, but it
            lets DS start exactly from a softmax with a bias (pretrain-then-replace). The bias
            is stored as the row's last column, so it belongs to the row's lasso group and is
            pruned with it.
        svd_rank: with a positive value, ``topk`` answers by SVD-softmax on the experts that
            hold more than ``svd_min_classes`` classes: a preview with this many singular
            directions (the paper's window width, 16), then exact logits for the best
            ``svd_candidates`` share of the expert's classes (DS paper section 4.6, Table 3;
            ``heads/ds/svd.py``). An inference option: ``log_prob`` and training are exact.
            Default 0: exact ``topk``.
        svd_candidates: share of an expert's classes given exact logits (SVD-50: 0.5).
        svd_min_classes: experts up to this many classes stay exact (the paper: 1,000).
    """

    weight: nn.Parameter
    gate: nn.Parameter
    row_class: torch.Tensor
    expert_offsets: torch.Tensor

    capture_blocker = "its experts' sizes are counted from each batch (heads/graphs.py)"
    # Options that only size the structure a fresh head starts from: loading a checkpoint
    # resizes the head to its pruned, split structure, so another value here still loads it
    # and computes the same (lightning_modules/module_configs.py compares the rest)
    structure_options: frozenset[str] = frozenset({"num_experts"})

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_experts: int = 2,
        lambda_lasso: float = 0.0,
        lambda_expert: float = 0.0,
        lambda_load: float = 10.0,
        init_std: float | None = None,
        bias: bool = False,
        svd_rank: int = 0,
        svd_candidates: float = 0.5,
        svd_min_classes: int = 1000,
    ) -> None:
        super().__init__(hidden_size, vocab_size)
        check_positive_int("num_experts", num_experts)
        if num_experts > vocab_size:
            raise HeadConfigError(
                f"num_experts ({num_experts}) exceeds the {vocab_size} classes: experts "
                f"specialise on classes, more can only duplicate each other; use at most "
                f"{vocab_size}"
            )
        for name, value in (
            ("lambda_lasso", lambda_lasso),
            ("lambda_expert", lambda_expert),
            ("lambda_load", lambda_load),
        ):
            _check_non_negative(name, value)
        std = hidden_size**-0.5 if init_std is None else init_std
        if std <= 0:
            raise HeadConfigError(f"init_std must be positive, got {init_std!r}")
        self.lambda_lasso = float(lambda_lasso)
        self.lambda_expert = float(lambda_expert)
        self.lambda_load = float(lambda_load)
        self.bias = bool(bias)
        self.row_size = hidden_size + int(self.bias)
        # every expert starts over the full class space (paper, Figure 1)
        self.weight = nn.Parameter(torch.randn(num_experts * vocab_size, self.row_size) * std)
        if self.bias:
            with torch.no_grad():
                self.weight[:, -1] = 0.0
        self.gate = nn.Parameter(torch.randn(num_experts, hidden_size) * std)
        self.register_buffer("row_class", torch.arange(vocab_size).repeat(num_experts))
        self.register_buffer("expert_offsets", torch.arange(num_experts + 1) * vocab_size)
        if not isinstance(svd_rank, int) or svd_rank < 0:
            raise HeadConfigError(f"svd_rank must be a non-negative integer, got {svd_rank!r}")
        self.svd_preview = (
            SVDPreview(svd_rank, svd_candidates, svd_min_classes) if svd_rank else None
        )
        self._refresh_structure()

    # -- structure ----------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.gate.size(0)

    def _refresh_structure(self) -> None:
        """What follows from the structure, computed when it changes (construction,
        ``set_structure``, loading), never per step: Python-side offsets (the expert sizes
        that ``split`` and the slices take, without a sync) and the ``[R]`` expert of every
        row (a non-persistent buffer: it moves with the module, and the expert lasso reads
        it in every step)."""
        # (a head built on the meta device, as a checkpoint's config is compared with a run's
        # before anything is built, has no offsets to read: its Python-side ones stay empty)
        meta = self.expert_offsets.is_meta
        self._offsets: list[int] = [] if meta else self.expert_offsets.tolist()
        self._cache: DSInference | None = None
        device = self.row_class.device
        row_expert = torch.repeat_interleave(
            torch.arange(self.num_experts, device=device),
            self.expert_offsets.diff().to(device),
            output_size=self.row_class.numel(),
        )
        self.register_buffer("_row_expert", row_expert, persistent=False)

    def _split_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(W, b)`` of packed rows (``b`` is ``None`` without ``bias``)."""
        return split_rows(rows, self.bias)

    def expert_sizes(self) -> list[int]:
        """``|v_k|``: surviving classes per expert."""
        return [b - a for a, b in zip(self._offsets[:-1], self._offsets[1:], strict=True)]

    def expert_classes(self, k: int) -> torch.Tensor:
        """Surviving class ids of expert ``k`` (ascending)."""
        return self.row_class[self._offsets[k] : self._offsets[k + 1]]

    def row_expert(self) -> torch.Tensor:
        """``[R]`` expert index of every packed row (kept since the structure last changed)."""
        return self._row_expert

    def membership(self) -> torch.Tensor:
        """``[K, V]`` bool: class c is alive in expert k (the expert x class heatmap)."""
        out = torch.zeros(self.num_experts, self.vocab_size, dtype=torch.bool)
        out[self.row_expert().cpu(), self.row_class.cpu()] = True
        return out

    def classes_without_expert(self) -> torch.Tensor:
        """Class ids that no expert holds any more (empty unless pruned with the ``*`` variant)."""
        covered = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.row_class.device)
        covered[self.row_class] = True
        return (~covered).nonzero().squeeze(1)

    def set_structure(
        self,
        weight: torch.Tensor,
        row_class: torch.Tensor,
        expert_sizes: list[int] | torch.Tensor,
        gate: torch.Tensor,
    ) -> None:
        """Replace the experts: new ``weight``/``gate`` Parameters (optimizers must be rebuilt).

        Rows of an expert must be sorted by class id, each class at most once per expert.
        """
        sizes = torch.as_tensor(expert_sizes, dtype=torch.long).cpu()
        if weight.dim() != 2 or weight.size(1) != self.row_size:
            raise HeadConfigError(f"weight must be [R, {self.row_size}], got {weight.shape}")
        if gate.shape != (sizes.numel(), self.hidden_size) or sizes.numel() == 0:
            raise HeadConfigError(
                f"gate must be [K, {self.hidden_size}] with K = {sizes.numel()} experts (K >= 1)"
            )
        if int(sizes.sum()) != weight.size(0) or row_class.shape != weight.shape[:1]:
            raise HeadConfigError("expert sizes must add up to the rows of weight and row_class")
        if (sizes <= 0).any():
            raise HeadConfigError("every expert must keep at least one class")
        device = self.weight.device
        self.weight = nn.Parameter(weight.detach().to(device, self.weight.dtype).contiguous())
        self.gate = nn.Parameter(gate.detach().to(device, self.gate.dtype).contiguous())
        self.row_class = row_class.detach().to(device, torch.long).contiguous()
        offsets = torch.zeros(sizes.numel() + 1, dtype=torch.long)
        offsets[1:] = sizes.cumsum(0)
        self.expert_offsets = offsets.to(device)
        self._refresh_structure()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, *args) -> None:
        # Resize to the saved structure first (pruning/mitosis changed it), then load weights.
        keys = [prefix + name for name in ("weight", "gate", "row_class", "expert_offsets")]
        if all(key in state_dict for key in keys):
            weight, gate, row_class, offsets = (state_dict[key] for key in keys)
            if weight.shape != self.weight.shape or gate.shape != self.gate.shape:
                self.set_structure(weight, row_class, offsets.diff(), gate)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, *args)
        self._refresh_structure()

    # -- gate (Eq. 1) -------------------------------------------------------------------
    def select(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert [N], G_{k*}(h) [N])``: top-1 expert and its normalised gate value (Eq. 1)."""
        with float32_context(hidden.device):
            gates = (upcast(hidden) @ upcast(self.gate).T).softmax(dim=-1)
        expert = gates.argmax(dim=-1)
        return expert, gates.gather(1, expert[:, None]).squeeze(1)

    def _groups(self, expert: torch.Tensor):
        """Tokens grouped by selected expert: ``(k, token indices)`` for each used expert, and
        under ``torch.compile`` for every expert (an empty group costs little; skipping it
        would branch on the data). A batch of no rows (N = 0, known from its shape) gets
        expert 0 on zero rows: the loss then has its parts, and every parameter its zero
        gradient (the packed rows' ``split`` backward writes all of them), as DDP needs."""
        order, sizes = sort_into_groups(expert, self.num_experts)
        compiling, start = torch.compiler.is_compiling(), 0
        if expert.numel() == 0 and not compiling:
            yield 0, order
            return
        for k, size in enumerate(sizes):
            if compiling or size:
                yield k, order[start : start + size]
            start += size

    def _expert_rows(self) -> tuple[torch.Tensor, ...]:
        """Each expert's rows, differentiable. One ``split`` per step: its backward writes one
        ``[R, d]`` gradient, where a slice per expert would write K of them."""
        return self.weight.split(self.expert_sizes())

    def _expert_logits(
        self, rows: torch.Tensor, hidden: torch.Tensor, gate_value: torch.Tensor
    ) -> torch.Tensor:
        """``G_k W^(k) h`` for one expert's tokens (Eq. 2), float32 or float64."""
        if self.bias:  # [h, 1] against [W_c, b_c]: no column slice of the rows to backpropagate
            hidden = torch.cat((hidden, hidden.new_ones(hidden.size(0), 1)), dim=1)
        logits = F.linear(hidden, rows)  # the one matmul of this group (bf16 under autocast)
        with float32_context(hidden.device):
            return upcast(gate_value)[:, None] * upcast(logits)

    def _expert_loss(
        self,
        k: int,
        rows: torch.Tensor,
        hidden: torch.Tensor,
        gate_value: torch.Tensor,
        ids: torch.Tensor,
        smoothing: bool,
        row_bound: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One expert's tokens: per-row NLL (and ``mean_x(-log p_x)`` with smoothing) of Eq. 2
        through the fused primitive. ``G W h = W (G h)``, so the gate scales the rows fed to it
        (with the bias column: ``[G h, G] . [W_c, b_c]``); pruned classes are zero logits, the
        constant ``log(V - |v_k|)`` in the log-sum-exp (Algorithm 1, line 9)."""
        with float32_context(hidden.device):
            scaled = upcast(hidden)
            if self.bias:
                scaled = torch.cat((scaled, scaled.new_ones(scaled.size(0), 1)), dim=1)
            scaled = upcast(gate_value)[:, None] * scaled
        classes = self.expert_classes(k)
        where = torch.searchsorted(classes, ids.clamp_min(0)).clamp_max(classes.numel() - 1)
        local = torch.where((classes[where] == ids) & (ids >= 0), where, -1)
        part = linear_lse(scaled, rows, None, local, logit_sum=smoothing,
                          options=self.loss_options, row_bound=row_bound)  # fmt: skip
        log_norm = part.lse
        pruned = self.vocab_size - rows.size(0)  # from the shape: no read-back
        if pruned:  # a fill on the device, not a copy of a Python number to it
            log_norm = torch.logaddexp(log_norm, torch.full_like(log_norm, math.log(pruned)))
        nll = log_norm - part.target_logit
        smooth = log_norm - part.logit_sum / self.vocab_size if smoothing else None
        return nll, smooth

    # -- contract -----------------------------------------------------------------------
    def forward(
        self, hidden: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
    ) -> HeadOutput:
        self.check_inputs(hidden, target)
        check_label_smoothing(label_smoothing)
        expert, gate_value = self.select(hidden)
        ids = torch.where(target != IGNORE_INDEX, target, -1)
        parts, smooth_parts, positions, experts = [], [], [], self._expert_rows()
        compiling = torch.compiler.is_compiling()
        for k, idx in self._groups(expert):
            part = self._expert_loss(
                k, experts[k], hidden[idx], gate_value[idx], ids[idx], bool(label_smoothing),
                row_bound=hidden.size(0) if compiling else None,
            )  # fmt: skip
            parts.append(part[0])
            smooth_parts.append(part[1])
            positions.append(idx)
        order = torch.cat(positions)
        nll = hidden.new_zeros(hidden.size(0), dtype=parts[0].dtype).scatter(
            0, order, torch.cat(parts)
        )
        smoothing = None
        if label_smoothing:
            smoothing = torch.zeros_like(nll).scatter(0, order, torch.cat(smooth_parts))
        keep = target != IGNORE_INDEX
        # ignored rows weigh 0 in the load balance (a mask, not a selection: no shape that
        # depends on the data)
        aux = self.aux_loss(expert, torch.where(keep, gate_value, torch.zeros_like(gate_value)))
        return self.output(
            nll, target, aux_loss=aux, smoothing=smoothing, label_smoothing=label_smoothing
        )

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """The sparse inference distribution, dense: ``-inf`` outside the selected expert."""
        return self._dense_log_prob(hidden, pruned_as_zero_logits=False)

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """The same parameter names; any structure (the head resizes itself to the saved one
        when loading: pruning and mitosis change it)."""
        if set(state) != set(self.state_dict()):
            super().check_state_dict(state)  # names the missing and unexpected keys

    def load_pretrained(self, state: Mapping[str, torch.Tensor]) -> bool:
        """A DS head's state as it is, whatever its structure (a pruned, split head: this one
        resizes to it, e.g. to fine-tune it with the backbone), or a softmax's (``weight
        [V, d]``, optional ``bias``, nothing else) as every expert's start: the
        pretrain-then-replace recipe of appendix B. Another head's state (Mixtape's and MoS's
        hold a ``weight [V, d]`` too, beside their gates and projections) is not a softmax's:
        not loaded (the run says the head starts untrained)."""
        if set(state) == set(self.state_dict()):
            self.load_state_dict(state)
            return True
        weight = state.get("weight")
        if not set(state) <= SOFTMAX_STATE or weight is None:
            return False
        if weight.shape != (self.vocab_size, self.hidden_size):
            return False
        self.init_from_softmax(weight, state.get("bias"))
        return True

    def training_log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """The distribution ``forward`` trains: pruned rows of the selected expert are zero
        rows (logit 0), as in Algorithm 1. Equal to :meth:`log_prob` before any pruning."""
        return self._dense_log_prob(hidden, pruned_as_zero_logits=True)

    def _dense_log_prob(self, hidden: torch.Tensor, pruned_as_zero_logits: bool) -> torch.Tensor:
        self.check_inputs(hidden)
        expert, gate_value = self.select(hidden)
        dtype = upcast(hidden).dtype
        fill = 0.0 if pruned_as_zero_logits else -math.inf
        logits = torch.full(
            (hidden.size(0), self.vocab_size), fill, dtype=dtype, device=hidden.device
        )
        experts = self._expert_rows()
        for k, idx in self._groups(expert):
            logits = logits.index_put(
                (idx[:, None], self.expert_classes(k)[None, :]),
                self._expert_logits(experts[k], hidden[idx], gate_value[idx]),
            )
        with float32_context(hidden.device):
            return logits.log_softmax(dim=-1)

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k inside the selected expert only: a softmax over its ``|v_k|`` rows
        (``heads/ds/inference.py``), or SVD-softmax on the large experts when ``svd_rank``
        is set (``heads/ds/svd.py``). No gradient flows through the answer.

        When the expert holds fewer than ``k`` classes the rest of the answer is classes
        outside it, with log-probability ``-inf`` (probability 0).
        """
        inference = self._cache or self._inference_cache()
        answer = inference.native_topk(hidden, k)  # the C kernel: checks its own inputs
        if answer is not None:
            return answer
        check_positive_int("k", k)
        if k > self.vocab_size:
            raise HeadConfigError(f"top-k with k={k} exceeds the vocabulary size {self.vocab_size}")
        self.check_inputs(hidden)
        return inference.topk(hidden, k)

    def set_svd_preview(
        self, rank: int | None, candidates: float = 0.5, min_classes: int = 1000
    ) -> None:
        """Answer ``topk`` by SVD-softmax on experts with more than ``min_classes`` classes:
        a preview with ``rank`` singular directions, exact logits for the best ``candidates``
        share of the classes (``heads/ds/svd.py``). ``rank=None`` (or 0): exact ``topk``."""
        self.svd_preview = SVDPreview(rank, candidates, min_classes) if rank else None
        self._cache = None

    def _inference_cache(self) -> DSInference:
        """Detached per-expert views of the packed parameters, built once per structure:
        slicing a Parameter per query costs more than the expert's matrix-vector product.
        Views share storage, so optimizer steps and ``load_state_dict`` show through; a new
        structure (``set_structure``, loading), moving the storage (``_apply``: ``.to()``,
        ``.double()``) and new SVD options drop the cache."""
        cache = self._cache
        if cache is None:
            cache = self._cache = DSInference(self.structure(), self.svd_preview)
        return cache

    def structure(self) -> DSStructure:
        """The packed experts as inference reads them (detached views of the parameters)."""
        return DSStructure(
            weight=self.weight.detach(),
            gate=self.gate.detach(),
            row_class=self.row_class,
            expert_offsets=self.expert_offsets,
            offsets=self._offsets,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            bias=self.bias,
        )

    def _apply(self, fn, *args, **kwargs):
        self._cache = None  # the parameters may move to new storage
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # copies and pickles rebuild the cache: it holds raw pointers into these parameters
        return {**self.__dict__, "_cache": None}

    # -- regularisers -------------------------------------------------------------------
    def aux_loss(self, expert: torch.Tensor, gate_value: torch.Tensor) -> torch.Tensor:
        """``lambda_lasso L_lasso + lambda_expert L_expert + lambda_load L_load``: the DS
        paper's section 3.3 (unnumbered: "Sparse expert" and "Loading balance"), summed in
        Algorithm 1, line 3."""
        with float32_context(self.weight.device):
            weight = upcast(self.weight)
            total = weight.new_zeros(())
            if self.lambda_lasso or self.lambda_expert:
                # one pass over the [R, d] rows for both lassos: the rest works on [R] norms
                norms = torch.linalg.vector_norm(weight, dim=1)
                if self.lambda_lasso:
                    total = total + self.lambda_lasso * norms.sum()
                if self.lambda_expert:
                    squares = norms.new_zeros(self.num_experts).index_add(
                        0, self.row_expert(), norms.square()
                    )
                    # an expert of zero rows (new rows, set_expert_classes) has norm 0,
                    # where sqrt's derivative is infinite: 0 * inf would be NaN
                    norm = squares.clamp_min(torch.finfo(squares.dtype).tiny).sqrt()
                    total = total + self.lambda_expert * norm.sum()
            if self.lambda_load and self.num_experts > 1:
                # importance of expert k: sum over the batch of the sparse gate G_k(h)
                importance = upcast(gate_value).new_zeros(self.num_experts)
                importance = importance.index_add(0, expert, upcast(gate_value))
                if self.training and torch.is_grad_enabled():
                    # the global batch's importance under DDP (once per training forward,
                    # which every rank runs alike; evaluation batches differ in number per
                    # rank, so a collective there could hang: they keep their own)
                    importance = sum_over_ranks(importance)
                # CV^2 = var / mean^2, without a square root (finite gradient when balanced);
                # 0 for a batch without a kept row (no branch on it: nothing to sync)
                mean_squared = importance.mean().square()
                cv_squared = importance.var(unbiased=False) / mean_squared.clamp_min(1e-30)
                total = total + self.lambda_load * cv_squared.to(total.dtype)
            return total

    # -- reported speed-up --------------------------------------------------------------
    def flops_speedup(self, utilisation: torch.Tensor | list[float]) -> float:
        """``|V| / (sum_k |v_k| u_k + K)`` (section 3.3), ``u_k`` measured on data."""
        u = torch.as_tensor(utilisation, dtype=torch.float64)
        sizes = torch.tensor(self.expert_sizes(), dtype=torch.float64)
        return float(self.vocab_size / ((sizes * u).sum() + self.num_experts))

    # -- pretrain-then-replace (appendix B) ---------------------------------------------
    @torch.no_grad()
    def init_from_softmax(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, noise_std: float = 0.0
    ) -> None:
        """Start every expert from a trained softmax's ``W [V, d]`` and, if this head has
        ``bias``, its ``b [V]`` (otherwise the bias is dropped).

        Rows are scaled by ``1 / mean G`` so that ``G_k W^(k) h`` starts at the softmax's
        logits ``W h`` while the gate is still near uniform.
        """
        if weight.shape != (self.vocab_size, self.hidden_size):
            raise HeadConfigError(
                f"cannot initialise DS-Softmax [V={self.vocab_size}, d={self.hidden_size}] "
                f"from a softmax weight of shape {tuple(weight.shape)}"
            )
        self.gate.mul_(1e-3)  # near-uniform gate: G_k ~ 1/K
        if self.bias:
            b = weight.new_zeros(self.vocab_size) if bias is None else bias.to(weight)
            weight = torch.cat((weight, b[:, None]), dim=1)
        experts = weight.to(self.weight)[self.row_class] * self.num_experts
        self.weight.copy_(experts + noise_std * torch.randn_like(experts))

    # -- structural changes (used by the pruning and mitosis callbacks) -----------------
    @torch.no_grad()
    def prune(
        self, gamma: float, keep_every_class: bool = True, max_rows_after: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Drop rows with ``||W^(k)_c||_2 < gamma`` (Algorithm 1, lines 6-11).

        ``keep_every_class``: a class whose rows would all go keeps its largest-norm row
        (the paper's default; ``False`` is its ``*`` variant). An expert left without rows is
        removed with its gate row. ``max_rows_after``: prune only if at most that many rows
        survive (the surviving rows are copied while the old ones exist: a memory budget).
        Decided from the parameters only, which are identical on every DDP rank. Returns the
        old indices of the surviving ``(rows, gate rows)``, or ``None`` if nothing changed.
        """
        norms = torch.linalg.vector_norm(self.weight.float(), dim=1)
        keep = norms >= gamma
        if keep_every_class:
            keep[self._largest_row_of_uncovered_classes(norms, keep)] = True
        if bool(keep.all()):
            return None
        if not bool(keep.any()):  # nothing left: keep the single largest row
            keep[norms.argmax()] = True
        rows = keep.nonzero().squeeze(1)
        if max_rows_after is not None and rows.numel() > max_rows_after:
            return None
        row_expert = self.row_expert()
        sizes = torch.bincount(row_expert[rows], minlength=self.num_experts)
        alive_experts = (sizes > 0).nonzero().squeeze(1)
        self.set_structure(
            self.weight[rows], self.row_class[rows], sizes[alive_experts], self.gate[alive_experts]
        )
        return rows, alive_experts

    def _largest_row_of_uncovered_classes(
        self, norms: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """The largest-norm row (the first of equal ones) of every class that ``keep`` leaves
        without a row. Reductions, not an indexed write with repeated indices (which row of a
        class such a write keeps is unspecified: on a CPU's threads it varied from run to run,
        and DDP ranks could then disagree)."""
        classes, rows = self.row_class, torch.arange(norms.numel(), device=norms.device)
        largest = norms.new_full((self.vocab_size,), -math.inf)
        largest = largest.scatter_reduce(0, classes, norms, "amax")
        at_largest = norms == largest[classes]
        first = torch.full((self.vocab_size,), norms.numel(), device=norms.device)
        first = first.scatter_reduce(0, classes[at_largest], rows[at_largest], "amin")
        covered = torch.zeros(self.vocab_size, dtype=torch.bool, device=norms.device)
        covered[classes[keep]] = True  # repeated indices all write True
        return first[(first < norms.numel()) & ~covered]

    @torch.no_grad()
    def set_expert_classes(
        self, expert: torch.Tensor, classes: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Give the experts new class sets: one row per pair ``(expert[i], classes[i])`` (any
        order; duplicates count once). A row that existed keeps its weights; a new one starts
        at zero, bias included: the logit 0 that Algorithm 1 gives a pruned class in the
        training loss, so adding rows leaves that loss unchanged. An expert given no class is
        removed with its gate row. Returns the old indices of the new ``(rows, gate rows)``,
        ``-1`` for a new row (optimizers must be rebuilt, see ``app/callbacks/ds/optim.py``).
        """
        device = self.weight.device
        expert, classes = expert.to(device, torch.long), classes.to(device, torch.long)
        if expert.shape != classes.shape or expert.dim() != 1 or expert.numel() == 0:
            raise HeadConfigError("expert and classes must be non-empty 1-D tensors of one size")
        if not (0 <= int(expert.min()) and int(expert.max()) < self.num_experts):
            raise HeadConfigError(f"expert ids must lie in [0, {self.num_experts})")
        if not (0 <= int(classes.min()) and int(classes.max()) < self.vocab_size):
            raise HeadConfigError(f"class ids must lie in [0, {self.vocab_size})")
        # one key per (expert, class): the packed rows are sorted by it already
        keys = torch.unique(expert * self.vocab_size + classes)  # sorted: expert, then class
        old_keys = self.row_expert() * self.vocab_size + self.row_class
        where = torch.searchsorted(old_keys, keys).clamp_max(old_keys.numel() - 1)
        source = torch.where(old_keys[where] == keys, where, -1)
        weight = self.weight.new_zeros(keys.numel(), self.row_size)
        kept = source >= 0
        weight[kept] = self.weight[source[kept]]
        sizes = torch.bincount(keys // self.vocab_size, minlength=self.num_experts)
        alive = (sizes > 0).nonzero().squeeze(1)
        self.set_structure(weight, keys % self.vocab_size, sizes[alive], self.gate[alive])
        return source, alive

    @torch.no_grad()
    def split_experts(
        self,
        noise_std: float,
        max_experts: int | None = None,
        generator: torch.Generator | None = None,
        rescale_rows: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mitosis (Algorithm 2, lines 5-7): every expert (up to ``max_experts`` in all) gets a
        twin holding its surviving rows plus Gaussian noise; the pair's gate rows are copies of
        the parent's plus noise, so the twins start in the parent's region of ``h``.

        With identical gate rows a twin's ``G`` is half its parent's, so by default
        (``rescale_rows``) both twins' rows are doubled: ``G W h`` (Eq. 2) stays continuous
        through the split where every expert divides. Where ``max_experts`` lets only some
        divide, the gate's normaliser grows by the dividing experts' share alone, which
        depends on ``h``: their twins' ``G`` falls by less than half and the others' falls
        too, so the loss moves a little at that split (K = 4 -> 6: 7.70 -> 7.67 nats, noise
        0; the gate has no bias that could take ``-log 2`` for the twins). Without
        ``rescale_rows`` the rows keep their norms (less for the group lasso to remove; top-k
        answers do not depend on ``G``) and the distribution flattens until the gate sharpens
        again.

        The noise: each row's elements ``noise_std`` times the row's RMS; each gate element
        ``noise_std`` times the mean norm of the gate rows, ``sqrt(d)`` times larger relative
        to a gate row (0.14 at d = 200 and 0.01), so that the twins' gates differ enough for
        them to part. Departures from Algorithm 2: the paper re-draws the new gate at random
        (line 5) where the twins here start from their parent's gate; it gives both twins the
        same noisy rows (lines 6-7) where here each copy draws its own noise.
        Returns ``(weight_source_rows [R'], gate_source_rows [K'])``: old indices of every new row.
        """
        k_old = self.num_experts
        k_new = 2 * k_old if max_experts is None else min(2 * k_old, max_experts)
        parents = torch.arange(k_new - k_old)  # experts that divide
        offsets = self._offsets
        device = self.weight.device
        # children: all old experts (in place), then the twins of the dividing ones
        twin_rows = [torch.arange(offsets[k], offsets[k + 1]) for k in parents.tolist()]
        twin_rows = torch.cat(twin_rows) if twin_rows else torch.zeros(0, dtype=torch.long)
        source = torch.cat((torch.arange(self.weight.size(0)), twin_rows)).to(device)
        gate_source = torch.cat((torch.arange(k_old), parents)).to(device)
        divides = torch.zeros(k_old, dtype=torch.bool)
        divides[parents] = True
        sizes = self.expert_sizes()
        scale = torch.repeat_interleave(
            torch.where(divides & rescale_rows, 2.0, 1.0), torch.tensor(sizes)
        )  # doubled rows only for experts whose gate mass is now shared by twins
        twin_scale = 2.0 if rescale_rows else 1.0
        scale = torch.cat((scale, torch.full((twin_rows.numel(),), twin_scale))).to(self.weight)

        def noise(shape: tuple[int, ...], std: torch.Tensor | float) -> torch.Tensor:
            return torch.randn(shape, generator=generator).to(self.weight) * std

        # Built in place: the old rows, the new [R', d] tensor and one chunk of noise are all
        # that is held at once (the peak that Mitosis counts is R + R').
        rows_old = self.weight.size(0)
        weight = torch.empty(source.numel(), self.row_size, dtype=self.weight.dtype, device=device)
        weight[:rows_old].copy_(self.weight)
        torch.index_select(self.weight, 0, twin_rows.to(device), out=weight[rows_old:])
        weight.mul_(scale[:, None])
        chunk = 4096
        for start in range(0, weight.size(0), chunk):
            block = weight[start : start + chunk]
            row_std = block.norm(dim=1, keepdim=True) * noise_std / self.row_size**0.5
            block.add_(noise(tuple(block.shape), row_std))
        gate = self.gate[gate_source]
        gate = gate + noise(tuple(gate.shape), noise_std * gate.norm(dim=1, keepdim=True).mean())
        new_sizes = sizes + [sizes[k] for k in parents.tolist()]
        self.set_structure(weight, self.row_class[source], new_sizes, gate)
        return source, gate_source
