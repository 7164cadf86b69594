"""The eager (CPU-tuned) plan of the fused linear + log-sum-exp loss: the hand-written chunk
loop behind ``heads.fused_cross_entropy.linear_lse`` (its module docstring states the maths).

The forward walks row tiles and column chunks with an online log-sum-exp, keeping a prefix of
the chunks' probabilities for the backward up to a byte budget; the backward recomputes the
other chunks and writes ``dL/dz = g p + g_t onehot_t + g_s`` chunk by chunk into the two
products, either folded into one pass over the logits (narrow vocabularies) or with the row
scale on ``[R, d]`` and the onehot and uniform terms added after the chunks (wide ones).
"""

from __future__ import annotations

import torch

from heads.kernels.chunks import (
    accumulate_mm,
    accumulation_dtype,
    as_dtype,
    chunk_buffer,
    chunk_logits,
    combine_chunk,
    exp_shifted_,
    exp_sum_,
    spans,
    target_columns,
)

# The backward builds dL/dz in one pass over the logits where V <= _FOLD_RATIO d, instead of
# scaling [R, d] rows (five [R, d] passes and temporaries, measured slower there).
_FOLD_RATIO = 4


class EagerLinearLSE(torch.autograd.Function):
    """``(lse, z_target, sum_x z)`` per row of ``z = h W^T + b``; see the module docstring.

    ``target`` entries outside ``[0, V)`` have no target logit (0) and no onehot gradient; the
    log-sum-exp is computed for every row."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        want_sum: bool,
        dtype: torch.dtype,
        tile: int | None,
        width: int,
        saved_bytes: int,
        fold: bool | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = accumulation_dtype(hidden, weight)
        n = hidden.size(0)
        h = as_dtype(hidden, dtype)
        # per row tile: log-sum-exp, target logit, logit sum (one tile in the common case)
        tiles: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        kept: list[torch.Tensor] = []  # probabilities of the chunks kept for the backward
        budget, buffer = saved_bytes, None
        for r0, r1 in spans(n, tile):
            results, probs, budget, buffer = _forward_tile(
                hidden, h[r0:r1], weight, bias, target[r0:r1], want_sum, width, budget, buffer
            )
            kept += probs
            tiles.append(results)
        lse, target_logit, logit_sum = (  # zeros: no rows, or no logit sum asked for
            _join([part[i] for part in tiles]) if tiles and (i < 2 or want_sum)
            else hidden.new_zeros(n, dtype=acc)
            for i in range(3)
        )  # fmt: skip
        ctx.save_for_backward(hidden, weight, bias, target, lse, *kept)
        ctx.layout = dtype, tile, width
        ctx.want_sum = want_sum
        ctx.fold = fold
        return lse, target_logit, logit_sum

    @staticmethod
    def backward(ctx, grad_lse, grad_target, grad_sum):
        hidden, weight, bias, target, lse, *kept = ctx.saved_tensors
        walk = _Backward(ctx, hidden, weight, bias, target, lse, kept)
        acc = lse.dtype
        g_s = as_dtype(grad_sum, acc) if ctx.want_sum and grad_sum is not None else None
        # dL/dz = g p + g_t onehot_t + g_s. Narrow vocabularies (at most _FOLD_RATIO d
        # columns) build it chunk by chunk, one pass over [R, C]; wide ones put the row scale
        # g on h (for dW) and on the [R, d] product (for dh), and the onehot and uniform
        # terms are [R, d] / [V, d] updates after the chunks: no pass over [R, C] beyond p.
        fold = ctx.fold if ctx.fold is not None else weight.size(0) <= _FOLD_RATIO * weight.size(1)
        for tile_index, (r0, r1) in enumerate(walk.tiles):
            g = as_dtype(grad_lse[r0:r1], acc)
            if fold:
                g_t = as_dtype(grad_target[r0:r1], acc)
                walk.folded_tile(tile_index, r0, r1, g, g_t, None if g_s is None else g_s[r0:r1])
            else:
                walk.scaled_tile(tile_index, r0, r1, g)
        if not fold:
            walk.add_target_and_sum_terms(grad_target, g_s)
        return (*walk.gradients(), *([None] * 7))


def _forward_tile(hidden, h_r, weight, bias, rows_t, want_sum, width, budget, buffer):
    """One row tile of the forward over every column chunk: ``((lse, target logit, logit
    sum), probabilities of the chunks kept, budget left, chunk buffer)``. A prefix of the
    chunks is kept while the byte budget lasts (the backward counts them)."""
    acc = accumulation_dtype(hidden, weight)
    rows, size = h_r.size(0), torch.finfo(acc).bits // 8
    top = total = picked = row_sum = None
    tile_kept = []
    for c0, c1 in spans(weight.size(0), width):
        keep = False
        if budget > 0:
            budget -= rows * (c1 - c0) * size
            keep = budget >= 0
        if not keep and buffer is None:
            buffer = chunk_buffer(hidden, rows, width, acc)
        z = chunk_logits(h_r, weight[c0:c1], None if bias is None else bias[c0:c1],
                         acc, None if keep else buffer)  # fmt: skip
        inside, column = target_columns(rows_t, c0, c1)
        picked = torch.where(
            inside, z.gather(1, column).squeeze(1), 0.0 if picked is None else picked
        )
        if want_sum:
            row_sum = z.sum(1) if row_sum is None else row_sum.add_(z.sum(1))
        chunk_top, chunk_total = exp_sum_(z)  # z now holds exp(z - m_c)
        if top is None:
            top, total = chunk_top, chunk_total
        else:
            top, total = combine_chunk(top, total, chunk_top, chunk_total)
        if keep:
            tile_kept.append((z, chunk_top))
    tile_lse = top + total.log()
    # exp(z - m_c) e^(m_c - lse) = p
    probs = [exps.mul_(torch.exp(shift - tile_lse).unsqueeze(1)) for exps, shift in tile_kept]
    return (tile_lse, picked, row_sum), probs, budget, buffer


class _Backward:
    """The backward's walk over row tiles and column chunks, and the gradients it fills."""

    def __init__(self, ctx, hidden, weight, bias, target, lse, kept) -> None:
        self.dtype, tile, self.width = ctx.layout
        self.hidden, self.weight, self.bias, self.target = hidden, weight, bias, target
        self.lse, self.kept, self.acc = lse, kept, lse.dtype
        self.h = as_dtype(hidden, self.dtype)
        self.tiles = spans(hidden.size(0), tile)
        self.chunk, self.buffer = 0, None  # chunks walked so far; the chunk buffer
        n, v, acc = hidden.size(0), weight.size(0), lse.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        # the first row tile writes dW and db, the others add to them (no rows: zeros)
        new = weight.new_empty if self.tiles else weight.new_zeros
        self.grad_h = hidden.new_empty(n, hidden.size(1), dtype=acc) if need_h else None
        self.grad_w = new(v, weight.size(1), dtype=acc) if need_w else None
        self.grad_b = new(v, dtype=acc) if need_b else None

    def probs(self, h_r, rows_lse, c0, c1, fold: bool) -> tuple[torch.Tensor, bool]:
        """The next chunk's ``p = exp(z - lse)`` and whether the forward kept it (else it is
        recomputed into the chunk buffer)."""
        kept_chunk = self.chunk < len(self.kept)
        if self.buffer is None and (fold or not kept_chunk):
            self.buffer = chunk_buffer(self.hidden, h_r.size(0), self.width, self.acc)
        if kept_chunk:
            probs = self.kept[self.chunk]
        else:
            bias = None if self.bias is None else self.bias[c0:c1]
            z = chunk_logits(h_r, self.weight[c0:c1], bias, self.acc, self.buffer)
            probs = exp_shifted_(z, rows_lse)
        self.chunk += 1
        return probs, kept_chunk

    def folded_tile(self, tile_index, r0, r1, g, g_t, g_s) -> None:
        """Rows ``[r0, r1)``: each chunk's whole ``dL/dz`` in one pass, then its products."""
        h_r, rows_lse, rows_t, dtype = (
            self.h[r0:r1],
            self.lse[r0:r1],
            self.target[r0:r1],
            self.dtype,
        )
        grad_h, grad_w, grad_b = self.grad_h, self.grad_w, self.grad_b
        for c0, c1 in spans(self.weight.size(0), self.width):
            w = self.weight[c0:c1]
            probs, kept_chunk = self.probs(h_r, rows_lse, c0, c1, True)
            dz = _fold_chunk(probs, kept_chunk, self.buffer, g, g_t, rows_t, c0, c1, g_s)
            dz_c = as_dtype(dz, dtype)
            if grad_h is not None:
                accumulate_mm(grad_h[r0:r1], dz_c, as_dtype(w, dtype), c0 > 0)
            if grad_w is not None:
                accumulate_mm(grad_w[c0:c1], dz_c.t(), h_r, tile_index > 0)
            if grad_b is not None:
                if tile_index > 0:
                    grad_b[c0:c1] += dz.sum(0)
                else:
                    torch.sum(dz, 0, out=grad_b[c0:c1])

    def scaled_tile(self, tile_index, r0, r1, g) -> None:
        """Rows ``[r0, r1)``: the ``g p`` part only, the row scale ``g`` on ``h`` (for dW)
        and on the summed ``[R, d]`` product ``sum_c p_c W_c`` (for dh)."""
        h_r, rows_lse, dtype, acc = self.h[r0:r1], self.lse[r0:r1], self.dtype, self.acc
        grad_h, grad_w, grad_b = self.grad_h, self.grad_w, self.grad_b
        scaled_h = as_dtype(as_dtype(h_r, acc) * g.unsqueeze(1), dtype)
        product = None  # sum over chunks of p_c W_c, [R, d]
        for c0, c1 in spans(self.weight.size(0), self.width):
            w = self.weight[c0:c1]
            probs, _ = self.probs(h_r, rows_lse, c0, c1, False)
            probs_c = as_dtype(probs, dtype)
            if grad_h is not None:
                if product is None:
                    product = as_dtype(torch.mm(probs_c, as_dtype(w, dtype)), acc)
                else:  # no [R, d] temporary per chunk where the dtypes allow
                    accumulate_mm(product, probs_c, as_dtype(w, dtype), True)
            if grad_w is not None:
                accumulate_mm(grad_w[c0:c1], probs_c.t(), scaled_h, tile_index > 0)
            if grad_b is not None:
                if tile_index > 0:
                    grad_b[c0:c1].addmv_(probs.t(), g)
                else:
                    torch.mv(probs.t(), g, out=grad_b[c0:c1])
        if grad_h is not None:
            torch.mul(product, g.unsqueeze(1), out=grad_h[r0:r1])

    def add_target_and_sum_terms(self, grad_target, g_s) -> None:
        """After ``scaled_tile``: the onehot term, and ``g_s`` (``d(sum_x z_x)/dz = 1``)."""
        grad_h, grad_w, grad_b, acc = self.grad_h, self.grad_w, self.grad_b, self.acc
        _add_target_terms(grad_h, grad_w, grad_b, self.h, self.weight, self.target,
                          grad_target, acc)  # fmt: skip
        if g_s is not None:
            if grad_h is not None:
                grad_h += g_s.unsqueeze(1) * as_dtype(self.weight, acc).sum(0)
            if grad_w is not None:
                grad_w += g_s @ as_dtype(self.h, acc)
            if grad_b is not None:
                grad_b += g_s.sum()

    def gradients(self) -> tuple[torch.Tensor | None, ...]:
        """``(dh, dW, db)`` in the inputs' dtypes."""
        return (
            None if self.grad_h is None else as_dtype(self.grad_h, self.hidden.dtype),
            None if self.grad_w is None else as_dtype(self.grad_w, self.weight.dtype),
            None if self.grad_b is None else as_dtype(self.grad_b, self.bias.dtype),
        )


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """The row tiles' results as one ``[N]`` (no copy for one tile)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _fold_chunk(probs, kept, buffer, g, g_t, target, c0, c1, g_s) -> torch.Tensor:
    """``dL/dz = g p + g_t onehot_t + g_s`` of one chunk ``[c0, c1)``, in the chunk buffer
    (a kept chunk is read, never written: a retained graph may run the backward again)."""
    scale = g.unsqueeze(1)
    dz = torch.mul(probs, scale, out=_view(buffer, probs)) if kept else probs.mul_(scale)
    inside, column = target_columns(target, c0, c1)
    dz.scatter_add_(1, column, torch.where(inside, g_t, 0.0).unsqueeze(1))
    if g_s is not None:
        dz.add_(g_s.unsqueeze(1))
    return dz


def _view(buffer: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """The start of the flat ``buffer`` shaped like ``like`` (None under torch.compile)."""
    return None if buffer is None else buffer[: like.numel()].view_as(like)


def _add_target_terms(grad_h, grad_w, grad_b, h, weight, target, grad_target, acc) -> None:
    """The ``g_t onehot_t`` part of ``dL/dz``: ``dh += g_t W[t]``, ``dW[t] += g_t h``,
    ``db[t] += g_t``, for rows whose target is inside ``[0, V)``."""
    valid = (target >= 0) & (target < weight.size(0))
    safe = torch.where(valid, target, 0)
    g_t = torch.where(valid, as_dtype(grad_target, acc), 0.0)
    if grad_h is not None:
        grad_h += g_t.unsqueeze(1) * as_dtype(weight.index_select(0, safe), acc)
    if grad_w is not None:
        grad_w.index_add_(0, safe, g_t.unsqueeze(1) * as_dtype(h, acc))
    if grad_b is not None:
        # scatter_add_, not index_add_: Inductor's CPU code generation fails on a 1-D
        # index_add_ whose index is a repeated target (MoS's ``repeat_interleave``)
        grad_b.scatter_add_(0, safe, g_t)
