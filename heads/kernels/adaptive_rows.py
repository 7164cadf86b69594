"""The adaptive softmax's rows plan: its whole mean loss (Grave et al. Sec. 3.3: a row's NLL is
the head classifier's over its word or its cluster's entry, plus its cluster's over its word)
and every gradient in one forward (the maths and its other plans: ``heads/adaptive.py``).

Why one function. On a GPU the adaptive softmax's step is bound by the host well past the
sizes where a softmax is not: at V = 10k, 16,384 tokens, its products are ~30 GFLOP (a few
hundredths of a millisecond on an H100), yet ours and PyTorch's layer took 3.8 ms a step there
(docs/results/bench_gpu_heads_10k.json). Composed of per-classifier losses (the rows plan's
per classifier: 425 operators a step dispatched, PyTorch's layer 343, counted on a CPU:
profile_cpu_cuda_plans_adaptive_rows_1k), autograd records each product, cast, gather and
reduction and replays their backwards one by one; here each classifier is one product for its
logits, one pass that turns them into their gradient in place (the Triton rows kernel on
CUDA: ``heads/kernels/triton_rows.py``) and the products of its gradients, all queued in the
forward (276 operators); the backward scales the stored gradients by the loss's (one
multi-tensor launch). Memory: one row tile of one classifier's logits at a time, in the
products' dtype (PyTorch's layer keeps its log-probabilities in float32), the tiles planned as
the other rows plans' (``heads.fused_cross_entropy.row_tile``: ``chunk_bytes``, else a share of
the device's memory); between forward and backward it keeps the gradients alone, ``dh [N, d]``
and one per parameter in the accumulation dtype: ``4 (N d + (k_h + J)(d + 1) + sum_i d_i (d +
|C_i|))`` bytes in float32, ``d_i = d // div^i`` (nothing that grows with a tile or a cluster's
logits).

Per classifier (head over every row; tail cluster i over its own rows, found by one sort):
``z = x W^T (+ b)``, ``lse``, ``z_t``, ``dz = w (softmax(z) - onehot(t))`` in the products'
dtype (``w``: the row's weight in the mean, 0 for an ignored row), then ``dW = dz^T x``,
``dx = dz W`` (the tail's ``x`` its projection ``h P_i^T``: ``dP_i = dx^T h``, ``dh = dx
P_i``). Columns are padded with zero weight rows to a multiple of 64 (aligned products), their
logits masked out of the softmax. Label smoothing and ``torch.compile`` keep the head's other
plans.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import once_differentiable

from heads.kernels.chunks import (
    accumulate_mm,
    accumulation_dtype,
    as_dtype,
    as_input,
    span_of,
    spans,
)
from heads.kernels.rows_ce import (
    added_gradients,
    graph_kept,
    join_tiles,
    padded_columns,
    padded_weight,
    scaled_gradients,
    tile_body,
)
from heads.kernels.triton_rows import bias_to_width, row_statistics

# Tile rows for a classifier: ``tile(rows, columns, bytes_per_logit)`` (the head passes the
# rows plans' ``heads.fused_cross_entropy.row_tile``); None: every classifier in one tile
TilePlan = Callable[[int, int, int], int] | None


def _classifier(x, w, bias, target, scale, v: int, dtype, acc, triton: bool):
    """One classifier's ``(nll, dz)`` over rows ``x`` (``target`` -1: no loss, ``scale`` 0):
    ``dz = scale (p - onehot)`` ``[R, columns]`` in ``dtype``, 0 in the padding; ``w`` the
    weight as the products take it (:meth:`_Walk.prepared`), ``v`` its classes."""
    z = torch.mm(x, w.t())  # (x in dtype)
    if triton:  # lse, z_t and dz over z in place, one kernel
        lse, picked, _ = row_statistics(z, bias, target, False, (scale, scale, None), acc, v)
        return lse - picked, z
    # in place over one float32 (acc) copy of the logits: the tile holds that copy, the
    # log-sum-exp's temporary and dz in dtype (:func:`bytes_per_logit`)
    z = as_dtype(z, acc)
    if bias is not None:
        z += bias
    lse, column = torch.logsumexp(z, 1), target.clamp_min(0)[:, None]
    picked = z.gather(1, column).squeeze(1)
    dz = z.sub_(lse[:, None]).exp_().mul_(scale[:, None])
    dz.scatter_add_(1, column, -scale[:, None])  # (a row without a target has scale 0)
    return lse - picked, as_dtype(dz, dtype)


def bytes_per_logit(triton: bool, dtype: torch.dtype, acc: torch.dtype) -> int:
    """What a tile holds per logit, for its planning: the Triton pass its logits alone (``dz``
    written over them), the torch operators a float32 (acc) copy, the log-sum-exp's
    temporary and ``dz`` in the products' dtype."""
    return dtype.itemsize if triton else 2 * acc.itemsize + dtype.itemsize


def _tiles(rows: int, columns: int, held: int, tile: TilePlan) -> list[tuple[int, int]]:
    """The row tiles of a classifier over ``rows`` rows (at least one, empty for no rows: a
    cluster the batch misses still gives its zero gradients)."""
    if tile is None or rows == 0:
        return [(0, rows)]
    return spans(rows, max(1, tile(rows, columns, held)))


class _Walk:
    """The step's classifiers over one set of row weights: ``run`` gives the NLL per row and
    every gradient of ``sum_n w_n nll_n``. Each classifier walks its rows in tiles
    (:data:`TilePlan`): a tile's logits and ``dz`` are its memory, freed before the next
    tile's are made; the gradients accumulate in the accumulation dtype."""

    def __init__(self, hidden, target, head_target, tail_rows, tail_sizes, tail_valid, head,
                 tail, cutoffs, tile: TilePlan = None) -> None:  # fmt: skip
        self.hidden, self.target, self.head_target = hidden, target, head_target
        self.head_weight, self.head_bias = head
        self.tail, self.cutoffs = tail, cutoffs
        self.acc = accumulation_dtype(hidden, self.head_weight)
        device = hidden.device
        if torch.is_autocast_enabled(device.type) and self.acc != torch.float64:
            self.dtype = torch.get_autocast_dtype(device.type)  # the products'
        else:
            self.dtype = torch.promote_types(hidden.dtype, self.head_weight.dtype)
        self.triton = tile_body(device, self.dtype) == "triton"
        self.tail_rows, self.sizes, self.tail_valid = tail_rows, tail_sizes, tail_valid
        held = bytes_per_logit(self.triton, self.dtype, self.acc)
        classes = [self.head_weight.size(0), *(out.size(0) for _, out in tail)]
        rows = [hidden.size(0), *tail_sizes]
        self.tiles = [_tiles(r, self._columns(v), held, tile)
                      for r, v in zip(rows, classes, strict=True)]  # fmt: skip

    def _columns(self, v: int) -> int:
        return padded_columns(v) if self.triton else v

    def prepared(self, weight, bias):
        """``(weight, bias)`` as every tile's products and pass take them: the weight in the
        products' dtype (padded to the Triton pass's columns), the bias in ``acc`` (padded)."""
        columns = self._columns(weight.size(0))
        w = padded_weight(weight, columns, self.dtype)  # (no copy where it already is both)
        if bias is not None:
            bias = as_dtype(bias, self.acc)
            bias = bias_to_width(bias, columns) if self.triton else bias
        return w, bias

    def run(self, row_weight: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """``(nll [N], [dh, dW_head, db_head, dP_1, dW_1, ...])`` for weights ``row_weight``."""
        acc, dtype, triton = self.acc, self.dtype, self.triton
        hd = as_dtype(self.hidden, dtype)
        v = self.head_weight.size(0)
        w, bias = self.prepared(self.head_weight, self.head_bias)
        dh = hd.new_empty(hd.shape, dtype=acc)
        d_w = w.new_empty(w.shape, dtype=acc)
        d_bias = None if bias is None else w.new_empty(w.size(0), dtype=acc)
        nll = []
        for r0, r1 in self.tiles[0]:
            x = span_of(hd, r0, r1)
            part, dz = _classifier(x, w, bias, span_of(self.head_target, r0, r1),
                                   span_of(row_weight, r0, r1), v, dtype, acc, triton)  # fmt: skip
            nll.append(part)
            accumulate_mm(span_of(dh, r0, r1), dz, w, False)
            accumulate_mm(d_w, dz.t(), x, r0 > 0)
            if d_bias is not None:
                if r0 > 0:
                    d_bias += dz.sum(0, dtype=acc)
                else:
                    torch.sum(dz, 0, dtype=acc, out=d_bias)
            dz = None  # freed before the next tile's logits are made
        grads = [dh, span_of(d_w, 0, v), span_of(d_bias, 0, v)]
        tail_h = hd.index_select(0, self.tail_rows)
        tail_t = self.target.index_select(0, self.tail_rows)
        tail_w = row_weight.index_select(0, self.tail_rows)
        valid = self.tail_valid
        if valid is not None:  # slots past a cluster's rows: no target, no weight
            tail_t, tail_w = torch.where(valid, tail_t, -1), torch.where(valid, tail_w, 0.0)
        tail_dh = torch.empty_like(tail_h, dtype=acc)
        tail_nll, start = [], 0
        for i, ((project, out), size) in enumerate(zip(self.tail, self.sizes, strict=True)):
            project = as_dtype(project, dtype)
            out_w, _ = self.prepared(out, None)
            d_project = project.new_empty(project.shape, dtype=acc)
            d_out = out_w.new_empty(out_w.shape, dtype=acc)
            for r0, r1 in self.tiles[i + 1]:
                rows = slice(start + r0, start + r1)
                x = tail_h[rows]
                projected = torch.mm(x, project.t())  # d -> d / div^i
                relative = tail_t[rows] - self.cutoffs[i]
                part, dz = _classifier(projected, out_w, None, relative, tail_w[rows],
                                       out.size(0), dtype, acc, triton)  # fmt: skip
                tail_nll.append(part)
                d_projected = torch.mm(dz, out_w)
                accumulate_mm(d_project, d_projected.t(), x, r0 > 0)  # dP_i
                accumulate_mm(d_out, dz.t(), projected, r0 > 0)  # dW_i
                dz = None  # freed before the next tile's logits are made
                accumulate_mm(tail_dh[rows], d_projected, project, False)
            grads += [d_project, span_of(d_out, 0, out.size(0))]
            start += size
        grads[0] = grads[0].index_add_(0, self.tail_rows, tail_dh)  # (empty slots' rows: 0)
        tail_nll = as_dtype(torch.cat(tail_nll), acc)
        if valid is not None:
            tail_nll = torch.where(valid, tail_nll, 0.0)
        nll = as_dtype(join_tiles(nll), acc).index_add(0, self.tail_rows, tail_nll)
        return nll, grads


class AdaptiveRowsLoss(torch.autograd.Function):
    """``(mean loss, nll [N])`` of the adaptive softmax (module docstring), its gradients
    computed in the forward. Inputs: ``hidden [N, d]``, ``target [N]`` (ids, negative:
    ignored), each row's head target, the tail clusters' rows (one after the other: each
    cluster's ``tail_sizes[i]`` of them) and, where those are fixed slots
    (``heads.base.sort_into_slots``), which slots hold one of the cluster's rows
    (``tail_valid``; None: all), ``cutoffs`` (the clusters' first ids), then the parameters:
    the head's weight and bias (or None), and each tail cluster's projection and output
    weights."""

    @staticmethod
    def forward(ctx, hidden, target, head_target, tail_rows, tail_sizes, tail_valid, cutoffs,
                tile, head_weight, head_bias, *tail_weights):  # fmt: skip
        ctx.set_materialize_grads(False)  # an undifferentiated NLL output gives None, not 0s
        tail = list(zip(tail_weights[::2], tail_weights[1::2], strict=True))
        walk = _Walk(hidden, target, head_target, tail_rows, tail_sizes, tail_valid,
                     (head_weight, head_bias), tail, cutoffs, tile)  # fmt: skip
        keep = (target >= 0).to(walk.acc)
        unit = keep.sum().clamp_min(1).reciprocal()  # the mean's 1 / count, on the device
        with torch.autocast(hidden.device.type, enabled=False):
            nll, grads = walk.run(keep)
        nll = nll * keep  # 0 where ignored (a finite value there: logits minus logits)
        ctx.walk, ctx.keep = walk, keep
        ctx.save_for_backward(unit, *[g if g is not None else torch.empty(0) for g in grads])
        ctx.has_bias = head_bias is not None
        return unit * nll.sum(), nll

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_nll):
        unit, *stored = ctx.saved_tensors
        walk = ctx.walk
        if not ctx.has_bias:
            stored[2] = None
        params = [walk.hidden, walk.head_weight, walk.head_bias,
                  *[w for pair in walk.tail for w in pair]]  # fmt: skip
        need = [ctx.needs_input_grad[0], *ctx.needs_input_grad[8:]]
        factor = None if grad_loss is None else as_dtype(grad_loss, unit.dtype) * unit
        in_place = not graph_kept()  # the stored gradients handed over, not copied
        out = scaled_gradients(stored, need, factor, in_place)
        if grad_nll is not None:  # the NLL output is differentiated too: walk again, w = g
            g = torch.where(ctx.keep > 0, as_dtype(grad_nll, walk.acc), 0.0)
            with torch.autocast(walk.hidden.device.type, enabled=False):
                _, extra = walk.run(g)
            out = added_gradients(out, extra, need, in_place)
        grads = [None if g is None or p is None else as_input(g, p)
                 for g, p in zip(out, params, strict=True)]  # fmt: skip
        return grads[0], *([None] * 7), *grads[1:]


def adaptive_rows_loss(hidden, target, head_target, tail_rows, tail_sizes, cutoffs, head, tail,
                       tail_valid=None, tile: TilePlan = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(mean loss, nll)`` of :class:`AdaptiveRowsLoss` for ``head`` (``nn.Linear``) and
    ``tail`` (an ``nn.ModuleList`` of ``Sequential(projection, output)``); ``tile`` plans
    each classifier's row tiles (:data:`TilePlan`; None: one tile each)."""
    weights = [w for cluster in tail for w in (cluster[0].weight, cluster[1].weight)]
    return AdaptiveRowsLoss.apply(hidden, target, head_target, tail_rows, list(tail_sizes),
                                  tail_valid, list(cutoffs), tile, head.weight, head.bias,
                                  *weights)  # fmt: skip
