"""DS-Softmax inference: top-k over the selected expert only (``DSSoftmaxHead.topk``).

Eq. 1 picks one expert per query, Eq. 2 is a softmax over its surviving classes; the answer is
that softmax's top-k (ds-softmax.txt, Table 1 times it). The paths, fastest first:

- C (``heads/ds/native/ds_topk.c``; a float32 head on CPU, a compiler at hand): one call per
  query, or per batch with the queries sorted by expert so each expert's rows are read once.
- PyTorch, batch 1: a matrix-vector product on cached per-expert views, a few calls.
- PyTorch, batched: queries sorted by expert, then either one ``baddbmm`` over every expert's
  rows padded to the largest (GPU; CPU when the padding is cheap) or one product per expert.

With an SVD preview (``heads/ds/svd.py``) the large experts answer by SVD-softmax on every
path. Everything here is derived from the head's parameters and rebuilt when its structure
changes; the exact ``log_prob`` is the head's own.
"""

from __future__ import annotations

import ctypes
import math

import torch
import torch.nn.functional as F

from heads.base import upcast
from heads.ds.native import DSPlan, DSTopkKernels, ds_topk_kernels
from heads.ds.structure import DSStructure, float32_context, split_rows
from heads.ds.svd import ExpertPreviews, SVDPreview, preview_topk

TopK = tuple[torch.Tensor, torch.Tensor]
FLOAT32 = torch.float32
# batches with at most this many queries per expert (on average) go through the C kernel
NATIVE_QUERIES_PER_EXPERT = 8
# stages timed by ds_topk_profile (heads/ds/native/ds_topk.c), then the kernel's whole call
PROFILE_STAGES = ("gate", "expert_rows", "svd_select", "normalise_topk", "kernel_total")


class NativeTopk:
    """The C kernels bound to one head's structure (a ``DSPlan`` pointing at its tensors)."""

    def __init__(self, kernels: DSTopkKernels, structure: DSStructure, max_rows: int) -> None:
        weight, gate = structure.weight, structure.gate
        offsets = structure.expert_offsets.to(torch.int64).contiguous()
        row_class = structure.row_class.to(torch.int64).contiguous()
        self._tensors: tuple = (weight, gate, offsets, row_class)  # the pointers stay valid
        self._plan = DSPlan(
            d=structure.hidden_size,
            n_experts=gate.size(0),
            row_stride=structure.row_size,
            has_bias=int(structure.bias),
            max_rows=max_rows,
            gate=gate.data_ptr(),
            weight=weight.data_ptr(),
            offsets=offsets.data_ptr(),
            row_class=row_class.data_ptr(),
        )
        self._previews: tuple = ()
        plan, one, batch = ctypes.addressof(self._plan), kernels.one, kernels.batch
        empty, long = torch.empty, torch.long

        def topk_one(hidden: torch.Tensor, k: int) -> TopK | None:
            """One contiguous float32 query ``[1, d]``; ``None`` when its expert holds fewer
            than ``k`` classes."""
            values, classes = empty(1, k), empty(1, k, dtype=long)
            taken = one(plan, hidden.data_ptr(), k, values.data_ptr(), classes.data_ptr())
            return (values, classes) if taken == k else None

        def topk_batch(hidden: torch.Tensor, k: int) -> TopK:
            """Float32 queries ``[n, d]`` with unit column stride. Where an expert holds fewer
            than ``k`` classes the missing entries are ``(-inf, -1)``."""
            n = hidden.size(0)
            values, classes = empty(n, k), empty(n, k, dtype=long)
            status = batch(
                plan, hidden.data_ptr(), hidden.stride(0), n, k, values.data_ptr(),
                classes.data_ptr(), torch.get_num_threads(),
            )  # fmt: skip
            if status != 0:
                raise MemoryError("DS-Softmax top-k: out of memory in the native kernel")
            return values, classes

        def profile(hidden: torch.Tensor, k: int) -> tuple[TopK, dict[str, float]]:
            """Contiguous float32 queries ``[n, d]`` one by one, as ``one`` answers them, with
            the kernel's time per query (microseconds) in each stage."""
            n = hidden.size(0)
            values, classes = empty(n, k), empty(n, k, dtype=long)
            ns = torch.zeros(len(PROFILE_STAGES), dtype=torch.int64)
            status = kernels.profile(
                plan, hidden.data_ptr(), n, k, values.data_ptr(), classes.data_ptr(),
                ns.data_ptr(),
            )  # fmt: skip
            if status != 0:
                raise MemoryError("DS-Softmax top-k: out of memory in the native kernel")
            per_query = (ns.double() / max(n, 1) / 1000).tolist()
            return (values, classes), dict(zip(PROFILE_STAGES, per_query, strict=True))

        self.one, self.batch, self.profile = topk_one, topk_batch, profile

    def use_previews(self, previews: ExpertPreviews | None) -> None:
        """Point the plan at SVD previews (or at none)."""
        plan = self._plan
        if previews is None or not previews.any:
            self._previews = ()
            plan.preview_rank = plan.candidates = plan.basis_offsets = None
            plan.preview_offsets = plan.basis = plan.preview = None
            return
        rank = torch.tensor(previews.rank, dtype=torch.int64)
        candidates = torch.tensor(previews.candidates, dtype=torch.int64)
        kept = (rank, candidates, previews.basis_offsets, previews.preview_offsets,
                previews.basis_packed, previews.preview_packed)  # fmt: skip
        self._previews = kept
        (plan.preview_rank, plan.candidates, plan.basis_offsets, plan.preview_offsets,
         plan.basis, plan.preview) = (t.data_ptr() for t in kept)  # fmt: skip


class DSInference:
    """Inference-side copies of a head's structure (``DSStructure``), built once per
    structure (see ``DSSoftmaxHead._inference_cache``).

    ``experts[k]``: detached views ``(W^(k) [|v_k|, d], b^(k) [|v_k|] or None, class ids)``,
    ``rows[k]`` the same rows with the bias column. Views share the parameters' storage, so
    in-place updates (optimizer steps, ``load_state_dict``) show through. Copies derived from
    the values (the padded block, SVD previews) are rebuilt when the parameters' version
    counters move.
    """

    def __init__(self, structure: DSStructure, svd: SVDPreview | None) -> None:
        weight, gate = structure.weight, structure.gate
        self._structure = structure
        self.gate = gate
        self.dtype = weight.dtype
        self.vocab_size = structure.vocab_size
        self.hidden_size = structure.hidden_size
        self.bias = structure.bias
        bounds = structure.bounds()
        self.rows = [weight[a:b] for a, b in bounds]
        self.experts = [(*split_rows(rows, self.bias), structure.row_class[a:b])
                        for rows, (a, b) in zip(self.rows, bounds, strict=True)]  # fmt: skip
        sizes = structure.expert_sizes()
        self.max_size, self.min_size = max(sizes), min(sizes)
        self.svd = svd
        self._previews: ExpertPreviews | None = None
        self._previews_version: tuple[int, int] | None = None
        self._padded_version: tuple[int, int] | None = None
        self._padded: tuple[torch.Tensor, torch.Tensor] | None = None
        self.padded_classes: torch.Tensor | None = None
        self.can_pad = len(sizes) * self.max_size <= 2 * weight.size(0)
        self.native = self._bind_native(structure)

    def _bind_native(self, structure: DSStructure) -> NativeTopk | None:
        """The C kernels bound to this structure, or ``None`` (not float32 on CPU, no
        compiler): the PyTorch paths answer then."""
        weight, gate = structure.weight, structure.gate
        if not (weight.device.type == "cpu" and weight.dtype == gate.dtype == torch.float32):
            return None
        if not (weight.is_contiguous() and gate.is_contiguous()):
            return None
        kernels = ds_topk_kernels()
        return None if kernels is None else NativeTopk(kernels, structure, self.max_size)

    def _version(self) -> tuple[int, int]:
        return self._structure.version()

    # -- derived copies -----------------------------------------------------------------
    @property
    def previews(self) -> ExpertPreviews | None:
        """SVD previews of the experts that get one, up to date; ``None`` without any."""
        if self.svd is None:
            return None
        version = self._version()
        if version != self._previews_version:
            self._previews = ExpertPreviews(self.rows, self.svd)
            self._previews_version = version
            if self.native is not None:
                self.native.use_previews(self._previews)
        return self._previews if self._previews.any else None

    @property
    def padded(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every expert's rows padded to the largest, transposed, ``([K, d, S], bias [K, S])``
        with a ``-inf`` bias on padding; only when padding at most doubles the rows."""
        if not self.can_pad:
            return None
        version = self._version()
        if version != self._padded_version:
            k, s = len(self.experts), self.max_size
            ref = self.experts[0][0]
            weight = ref.new_zeros(k, self.hidden_size, s)  # [K, d, S]: see _topk_padded
            bias = ref.new_full((k, s), -math.inf)
            classes = torch.zeros(k, s, dtype=torch.long, device=ref.device)
            for e, (rows, b, c) in enumerate(self.experts):
                weight[e, :, : rows.size(0)] = rows.T
                bias[e, : rows.size(0)] = 0.0 if b is None else b
                classes[e, : rows.size(0)] = c
            self._padded, self.padded_classes = (weight, bias), classes
            self._padded_version = version
        return self._padded

    # -- entry points -------------------------------------------------------------------
    def native_topk(self, hidden: torch.Tensor, k: int) -> TopK | None:
        """The C paths when they apply (float32 CPU queries ``[n, d]``), else ``None``."""
        native = self.native  # checks cheapest first: this runs before every batch-1 answer
        if native is None or type(k) is not int or hidden.dtype is not FLOAT32:
            return None
        shape = hidden.shape
        if len(shape) != 2 or shape[1] != self.hidden_size or not 0 < k <= self.vocab_size:
            return None
        if not hidden.is_cpu:
            return None
        if self.svd is not None:
            self.previews  # noqa: B018 (rebuilt if the parameters moved)
        n = shape[0]
        if n == 1:
            return native.one(hidden, k) if hidden.is_contiguous() else None
        # The kernel answers query by query, its expert's rows in cache after the group's
        # first query: it pays while groups are small. Many queries per expert are
        # matrix-matrix products, which the per-expert BLAS products do faster.
        if n == 0 or n > NATIVE_QUERIES_PER_EXPERT * len(self.experts) or hidden.stride(1) != 1:
            return None
        values, classes = native.batch(hidden, k)
        if k > self.min_size:  # some experts hold fewer than k classes
            short = (classes[:, -1] < 0).nonzero().squeeze(1)
            if short.numel():
                with torch.no_grad():
                    values[short], classes[short] = self.topk_batched(hidden[short], k)
        return values, classes

    def profile(self, hidden: torch.Tensor, k: int) -> tuple[TopK, dict[str, float]] | None:
        """Batch-1 answers of the C kernel for float32 queries ``[n, d]``, with its time per
        query in each stage (``PROFILE_STAGES``); ``None`` without the kernel."""
        if self.native is None:
            return None
        if self.svd is not None:
            self.previews  # noqa: B018 (rebuilt if the parameters moved)
        return self.native.profile(hidden.detach().float().contiguous(), k)

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, k: int) -> TopK:
        """The PyTorch paths, for validated queries ``[n, d]``."""
        if hidden.size(0) == 1:
            if hidden.dtype == self.dtype and not torch.is_autocast_enabled(hidden.device.type):
                return self.topk_one(hidden[0], k)
            with float32_context(hidden.device):
                logits = upcast(hidden) @ upcast(self.gate).T
                gate_value, expert = logits.softmax(-1).max(-1)
            return self.expert_topk(int(expert), hidden, gate_value, k)
        return self.topk_batched(hidden, k)

    # -- PyTorch paths ------------------------------------------------------------------
    def topk_one(self, h: torch.Tensor, k: int) -> TopK:
        """One query ``h [d]``: gate matvec, one (add)mv over the selected expert, a softmax
        and top-k over ``|v_k|`` values, then the class ids. No grouping, no grad."""
        gate_value, expert = torch.softmax(torch.mv(self.gate, h), 0).max(0)  # Eq. 1
        e, g = int(expert), float(gate_value)
        rows, bias, classes = self.experts[e]
        previews = self.previews
        if previews is not None and previews.rank[e] and k <= classes.numel():
            return self._preview_topk(e, h[None], gate_value[None], k)
        # G_{k*} (W h + b) (Eq. 2). Scaling after the product: addmv's alpha/beta != 1 takes a
        # path about 4x slower than the plain one on CPU (torch 2.13)
        logits = torch.mv(rows, h) if bias is None else torch.addmv(bias, rows, h)
        logits.mul_(g)
        if k > classes.numel():
            return self.top_of_expert(torch.log_softmax(logits, 0)[None], classes, k)
        values, where = torch.log_softmax(logits, 0).topk(k)
        return values[None], classes.take(where)[None]  # take: cheaper than advanced indexing

    def select(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expert [n], G_{k*} [n])`` (Eq. 1) on the detached gate, float32 or float64."""
        with float32_context(hidden.device):
            gate_value, expert = (upcast(hidden) @ upcast(self.gate).T).softmax(-1).max(-1)
        return expert, gate_value

    def topk_batched(self, hidden: torch.Tensor, k: int) -> TopK:
        """Queries grouped by expert with one sort. Without SVD previews, where the experts'
        padded block is cheap enough, all groups go through one batched matmul; otherwise
        one product per group."""
        expert, gate_value = self.select(hidden)
        n = hidden.size(0)
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=len(self.experts))
        if (
            self.padded is not None
            and self.previews is None
            and k <= self.min_size
            and not torch.is_autocast_enabled(hidden.device.type)
            and hidden.dtype == self.dtype
        ):
            if hidden.device.type != "cpu":  # one launch beats a loop of small ones on a GPU
                return self._topk_padded(hidden, k, expert, gate_value, order, counts)
            # the padded matmul computes K x S_max x C_max products, the loop about n x S_max
            # plus ~5 op calls per used expert: take the padded one when not much dearer
            padded_cost = len(self.experts) * self.max_size * int(counts.max())
            if padded_cost <= 4 * n * self.max_size + len(self.experts) * 20_000:
                return self._topk_padded(hidden, k, expert, gate_value, order, counts)
        sorted_hidden, sorted_gate = hidden[order], gate_value[order]
        parts_values, parts_classes, start = [], [], 0
        for e, count in enumerate(counts.tolist()):
            if count:
                rows = slice(start, start + count)
                top_values, top_classes = self.expert_topk(
                    e, sorted_hidden[rows], sorted_gate[rows], k
                )
                parts_values.append(top_values)
                parts_classes.append(top_classes)
                start += count
        values, classes = torch.cat(parts_values), torch.cat(parts_classes)
        return (
            torch.empty_like(values).index_copy_(0, order, values),
            torch.empty_like(classes).index_copy_(0, order, classes),
        )

    def _topk_padded(self, hidden, k, expert, gate_value, order, counts) -> TopK:
        """All groups in one ``baddbmm``: every expert's rows padded to the largest expert
        ``[K, d, S]`` against its queries padded to the largest group ``[K, C, d]``.
        Padded rows carry a ``-inf`` bias, so they never reach the softmax or the top-k."""
        weight, bias = self.padded
        n, num_experts = hidden.size(0), len(self.experts)
        sorted_expert = expert[order]
        # position of each (sorted) query inside its expert's group
        rank = torch.arange(n, device=hidden.device) - (counts.cumsum(0) - counts)[sorted_expert]
        queries = hidden.new_zeros(num_experts, int(counts.max()), self.hidden_size)
        queries[sorted_expert, rank] = hidden[order]
        # [K, C, d] @ [K, d, S]: the long axis last runs about 3x faster than [K, S, d] @ [K, d, C]
        logits = torch.baddbmm(bias[:, None, :], queries, weight)[sorted_expert, rank]
        log_probs = (logits * gate_value[order][:, None]).log_softmax(-1)  # Eq. 2, sorted order
        values, where = log_probs.topk(k, dim=-1)
        classes = self.padded_classes[sorted_expert[:, None], where]
        return (
            torch.empty_like(values).index_copy_(0, order, values),
            torch.empty_like(classes).index_copy_(0, order, classes),
        )

    def expert_topk(self, e: int, hidden: torch.Tensor, gate_value: torch.Tensor, k: int) -> TopK:
        """Top-k of expert ``e`` for its queries ``hidden [c, d]`` (Eq. 2)."""
        rows, bias, classes = self.experts[e]
        previews = self.previews
        if previews is not None and previews.rank[e] and k <= classes.numel():
            return self._preview_topk(e, hidden, gate_value, k)
        logits = F.linear(hidden, rows, bias)
        with float32_context(hidden.device):
            log_probs = (upcast(logits) * upcast(gate_value)[:, None]).log_softmax(dim=-1)
        return self.top_of_expert(log_probs, classes, k)

    def _preview_topk(self, e: int, hidden: torch.Tensor, gate_value: torch.Tensor, k: int):
        """SVD-softmax over expert ``e`` (``heads/ds/svd.py``), in float32 or float64."""
        previews = self.previews
        with float32_context(hidden.device):
            h = upcast(hidden).to(self.dtype)
            if self.bias:  # [h, 1] against [W_c, b_c]
                h = torch.cat((h, h.new_ones(h.size(0), 1)), dim=1)
            values, where = preview_topk(
                self.rows[e], previews.basis[e], previews.preview[e], h,
                upcast(gate_value).to(self.dtype), k, previews.candidates[e],
            )  # fmt: skip
        return values, self.experts[e][2][where]

    def top_of_expert(self, log_probs: torch.Tensor, classes: torch.Tensor, k: int) -> TopK:
        """Top-k of one expert's ``[n, |v_k|]`` log-probabilities, as class ids; past the
        expert's size, classes outside it with log-probability ``-inf``."""
        take = min(k, classes.numel())
        top_values, where = log_probs.topk(take, dim=-1)
        top_classes = classes.take(where)
        if take < k:  # fill with classes outside the expert: probability 0
            outside = torch.ones(self.vocab_size, dtype=torch.bool, device=classes.device)
            outside[classes] = False
            extra = outside.nonzero().squeeze(1)[: k - take]
            rows = log_probs.size(0)
            top_values = torch.cat(
                (top_values, top_values.new_full((rows, k - take), -math.inf)), 1
            )
            top_classes = torch.cat((top_classes, extra.expand(rows, -1)), 1)
        return top_values, top_classes
