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
multi-tensor launch). Memory: one classifier's logits at a time, in the products' dtype
(PyTorch's layer keeps its log-probabilities in float32).

Per classifier (head over every row; tail cluster i over its own rows, found by one sort):
``z = x W^T (+ b)``, ``lse``, ``z_t``, ``dz = w (softmax(z) - onehot(t))`` in the products'
dtype (``w``: the row's weight in the mean, 0 for an ignored row), then ``dW = dz^T x``,
``dx = dz W`` (the tail's ``x`` its projection ``h P_i^T``: ``dP_i = dx^T h``, ``dh = dx
P_i``). Columns are padded with zero weight rows to a multiple of 64 (aligned products), their
logits masked out of the softmax. Label smoothing and ``torch.compile`` keep the head's other
plans.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from heads.kernels.chunks import accumulation_dtype, as_dtype, as_input
from heads.kernels.rows_ce import padded_columns, padded_weight, scaled_gradients, tile_body
from heads.kernels.triton_rows import bias_to_width, row_statistics


def _classifier(x, weight, bias, target, scale, columns: int, dtype, acc, triton: bool):
    """One classifier's ``(nll, dz, W)`` over rows ``x`` (``target`` -1: no loss, ``scale``
    0): ``dz = scale (p - onehot)`` ``[R, columns]`` in ``dtype``, 0 in the padding, and the
    weight as the products take it (padded, in ``dtype``)."""
    v = weight.size(0)
    w = padded_weight(weight, columns, dtype) if triton else as_dtype(weight, dtype)
    z = torch.mm(x, w.t())  # (x in dtype)
    if triton:  # lse, z_t and dz over z in place, one kernel
        bias = None if bias is None else bias_to_width(as_dtype(bias, acc), columns)
        lse, picked, _ = row_statistics(z, bias, target, False, (scale, scale, None), acc, v)
        return lse - picked, z, w
    z = as_dtype(z, acc) if bias is None else z.to(acc) + bias.to(acc)
    lse, column = torch.logsumexp(z, 1), target.clamp_min(0)[:, None]
    picked = z.gather(1, column).squeeze(1)
    dz = torch.exp(z - lse[:, None]).mul_(scale[:, None])
    dz.scatter_add_(1, column, -scale[:, None])  # (a row without a target has scale 0)
    return lse - picked, as_dtype(dz, dtype), w


class _Walk:
    """The step's classifiers over one set of row weights: ``run`` gives the NLL per row and
    every gradient of ``sum_n w_n nll_n``."""

    def __init__(self, hidden, target, head_target, tail_rows, tail_sizes, tail_valid, head,
                 tail, cutoffs) -> None:  # fmt: skip
        self.hidden, self.target, self.head_target = hidden, target, head_target
        self.head_weight, self.head_bias = head
        self.tail, self.cutoffs = tail, cutoffs
        self.acc = accumulation_dtype(hidden, self.head_weight)
        device = hidden.device.type
        if torch.is_autocast_enabled(device) and self.acc != torch.float64:
            self.dtype = torch.get_autocast_dtype(device)  # the products'
        else:
            self.dtype = torch.promote_types(hidden.dtype, self.head_weight.dtype)
        self.triton = tile_body(hidden.device, self.dtype) == "triton"
        self.tail_rows, self.sizes, self.tail_valid = tail_rows, tail_sizes, tail_valid

    def _columns(self, v: int) -> int:
        return padded_columns(v) if self.triton else v

    def run(self, row_weight: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """``(nll [N], [dh, dW_head, db_head, dP_1, dW_1, ...])`` for weights ``row_weight``."""
        acc, dtype, head_w = self.acc, self.dtype, self.head_weight
        hd = as_dtype(self.hidden, dtype)
        columns = self._columns(head_w.size(0))
        nll, dz, w = _classifier(hd, head_w, self.head_bias, self.head_target, row_weight,
                                 columns, dtype, acc, self.triton)  # fmt: skip
        v = head_w.size(0)
        d_bias = None if self.head_bias is None else dz.sum(0, dtype=acc)[:v]
        grads = [as_dtype(torch.mm(dz, w), acc), as_dtype(torch.mm(dz.t(), hd)[:v], acc), d_bias]
        tail_h = hd.index_select(0, self.tail_rows)
        tail_t = self.target.index_select(0, self.tail_rows)
        tail_w = row_weight.index_select(0, self.tail_rows)
        valid = self.tail_valid
        if valid is not None:  # slots past a cluster's rows: no target, no weight
            tail_t, tail_w = torch.where(valid, tail_t, -1), torch.where(valid, tail_w, 0.0)
        tail_dh = torch.empty_like(tail_h, dtype=acc)
        tail_nll, start = [], 0
        for i, ((project, out), size) in enumerate(zip(self.tail, self.sizes, strict=True)):
            rows = slice(start, start + size)
            x, project = tail_h[rows], as_dtype(project, dtype)
            projected = torch.mm(x, project.t())  # d -> d / div^i
            relative = tail_t[rows] - self.cutoffs[i]
            columns = self._columns(out.size(0))
            part, dz, out_w = _classifier(projected, out, None, relative, tail_w[rows], columns,
                                          dtype, acc, self.triton)  # fmt: skip
            tail_nll.append(part)
            d_projected = torch.mm(dz, out_w)
            grads.append(as_dtype(torch.mm(d_projected.t(), x), acc))  # dP_i
            grads.append(as_dtype(torch.mm(dz.t(), projected)[: out.size(0)], acc))  # dW_i
            tail_dh[rows] = torch.mm(d_projected, project)
            start += size
        grads[0] = grads[0].index_add_(0, self.tail_rows, tail_dh)  # (empty slots' rows: 0)
        tail_nll = as_dtype(torch.cat(tail_nll), acc)
        if valid is not None:
            tail_nll = torch.where(valid, tail_nll, 0.0)
        nll = as_dtype(nll, acc).index_add(0, self.tail_rows, tail_nll)
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
                head_weight, head_bias, *tail_weights):  # fmt: skip
        ctx.set_materialize_grads(False)  # an undifferentiated NLL output gives None, not 0s
        tail = list(zip(tail_weights[::2], tail_weights[1::2], strict=True))
        walk = _Walk(hidden, target, head_target, tail_rows, tail_sizes, tail_valid,
                     (head_weight, head_bias), tail, cutoffs)  # fmt: skip
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
        need = [ctx.needs_input_grad[0], *ctx.needs_input_grad[7:]]
        factor = None if grad_loss is None else as_dtype(grad_loss, unit.dtype) * unit
        out = scaled_gradients(stored, need, factor)
        if grad_nll is not None:  # the NLL output is differentiated too: walk again, w = g
            g = torch.where(ctx.keep > 0, as_dtype(grad_nll, walk.acc), 0.0)
            with torch.autocast(walk.hidden.device.type, enabled=False):
                _, extra = walk.run(g)
            out = [x if y is None or not wanted else (y if x is None else x + y)
                   for x, y, wanted in zip(out, extra, need, strict=True)]  # fmt: skip
        grads = [None if g is None or p is None else as_input(g, p)
                 for g, p in zip(out, params, strict=True)]  # fmt: skip
        return grads[0], *([None] * 6), *grads[1:]


def adaptive_rows_loss(hidden, target, head_target, tail_rows, tail_sizes, cutoffs, head, tail,
                       tail_valid=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(mean loss, nll)`` of :class:`AdaptiveRowsLoss` for ``head`` (``nn.Linear``) and
    ``tail`` (an ``nn.ModuleList`` of ``Sequential(projection, output)``)."""
    weights = [w for cluster in tail for w in (cluster[0].weight, cluster[1].weight)]
    return AdaptiveRowsLoss.apply(hidden, target, head_target, tail_rows, list(tail_sizes),
                                  tail_valid, list(cutoffs), head.weight, head.bias,
                                  *weights)  # fmt: skip
