"""The GPU plan of the fused linear + log-sum-exp: one compiled function per chunk.

Same outputs and gradients as ``heads.kernels.eager_lse.EagerLinearLSE`` (the CPU plan), built
for a GPU's costs instead of a CPU cache's:

- the vocabulary is padded once per call to a whole number of equal chunks (padding columns
  have weight 0 and bias ``-inf``, so ``exp`` gives them 0): every chunk has the same shape
  and the chunk bodies compile to one graph each, with no recompilation per chunk;
- a chunk's forward is one product and one fused reduction (bias, row maximum, ``sum exp``,
  the target's logit and the online combination with the previous chunks); its backward is
  the recomputed product, one fused pass that forms ``dL/dz = g p + g_t onehot``, and the two
  gradient products. The bias gradient is folded into the weight's, ``dz^T [h | 1 | 0]`` into
  ``[dW | db | 0]`` (``h`` widened once per call, to a multiple of 8 columns for the tensor
  cores): one pass over the chunk fewer, for ~1.6% more ``dW`` product at d = 512. Products
  run in the compute dtype (bf16 under autocast) with float32 accumulation, and no float32
  copy of the logits is written;
- the logit sum (label smoothing) is ``h . sum_x W_x + sum_x b_x``, an ``[N, d]`` product
  outside the chunks, left to autograd.

Nothing here branches on values: the loops depend on shapes only, so a step has no host sync.
"""

from __future__ import annotations

import functools
import math

import torch

from heads.kernels.chunks import as_dtype, finite_shift

# torch.compile's backend for the chunk bodies; tests swap in "aot_eager" to check the plan's
# logic quickly, and keep one test on the real one
COMPILE_BACKEND = "inductor"


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """One chunk's ``h W^T + b`` in the accumulation dtype (the product in ``h``'s dtype)."""
    return torch.mm(h, w.t()).to(acc) + b


def forward_chunk(h, w, b, local, top, total, picked):
    """One chunk into the running ``(max, sum exp, target logit)`` of every row; ``local``
    is the target's column in this chunk (outside ``[0, C)``: not here)."""
    return fold_chunk(_logits(h, w, b, top.dtype), local, top, total, picked)


def fold_chunk(z, local, top, total, picked):
    """A chunk's logits ``z`` into the rows' running ``(max, sum exp, target logit)`` (the
    online log-sum-exp; shared with Mixtape's blocks, ``compiled_mixtape.py``)."""
    columns = z.size(1)
    inside = (local >= 0) & (local < columns)
    picked = torch.where(inside, z.gather(1, local.clamp(0, columns - 1)[:, None])[:, 0], picked)
    new_top = torch.maximum(top, z.amax(1))
    shift = finite_shift(new_top)  # all -inf so far: 0, not NaN
    total = total * torch.exp(top - shift) + torch.exp(z - shift[:, None]).sum(1)
    return new_top, total, picked


def _chunk_dz(h, w, b, local, lse, g, g_t):
    """One chunk's ``dL/dz = g p + g_t onehot``, in ``h``'s dtype for the products."""
    return chunk_gradient(_logits(h, w, b, lse.dtype), local, lse, g, g_t).to(h.dtype)


def chunk_gradient(z, local, lse, g, g_t):
    """``dL/dz = g p + g_t onehot`` of a chunk's logits ``z`` (``p = exp(z - lse)``), in the
    accumulation dtype (shared with Mixtape's blocks)."""
    columns = torch.arange(z.size(1), device=z.device)
    dz = g[:, None] * torch.exp(z - lse[:, None])
    return dz + torch.where(columns[None, :] == local[:, None], g_t[:, None], 0.0)


def backward_chunk(h, w, b, local, lse, g, g_t, grad_h):
    """``dL/dz`` for one chunk straight into the products (no bias gradient): returns
    ``(grad_h + dz W_c, dz^T h)``."""
    dz_c = _chunk_dz(h, w, b, local, lse, g, g_t)
    return grad_h + torch.mm(dz_c, w).to(grad_h.dtype), torch.mm(dz_c.t(), h)


def backward_bias_chunk(h_ext, w, b, local, lse, g, g_t, grad_h):
    """The same with the bias gradient: ``h_ext = [h | 1 | 0]`` (:func:`with_ones`), so
    ``dz^T h_ext = [dW_c | db_c | 0]``; returns ``(grad_h + dz W_c, dz^T h_ext)``."""
    dz_c = _chunk_dz(h_ext[:, : w.size(1)], w, b, local, lse, g, g_t)
    return grad_h + torch.mm(dz_c, w).to(grad_h.dtype), torch.mm(dz_c.t(), h_ext)


def mixture_forward_chunk(flat, w, b, shift, total):
    """MoS's label-smoothing term over one chunk: ``total + sum_x logsumexp_k(a_k + z_{k,x})``
    (``flat`` the ``[N K, d]`` component contexts, ``shift`` ``a`` as ``[N, K, 1]``)."""
    n, k = shift.shape[:2]
    z = _logits(flat, w, b, total.dtype).view(n, k, w.size(0))  # N = 0: no -1
    return total + torch.logsumexp(z + shift, dim=1).sum(1)


def mixture_backward_chunk(flat, w, b, shift, g, grad_flat, grad_shift):
    """Its gradient: the responsibilities ``r = softmax_k(a + z) g`` into the products;
    returns ``(grad_flat + r W_c, r^T h, sum_rows r, grad_shift + sum_x r)``."""
    n, k = shift.shape[:2]
    z = _logits(flat, w, b, grad_flat.dtype).view(n, k, w.size(0))
    r = torch.softmax(z + shift, dim=1) * g
    r_flat = r.view(n * k, w.size(0))
    r_c = r_flat.to(flat.dtype)
    grad_flat = grad_flat + torch.mm(r_c, w).to(grad_flat.dtype)
    return grad_flat, torch.mm(r_c.t(), flat), r_flat.sum(0), grad_shift + r.sum(-1)


BODIES = {
    "forward": forward_chunk,
    "backward": backward_chunk,
    "backward_bias": backward_bias_chunk,
    "mixture_forward": mixture_forward_chunk,
    "mixture_backward": mixture_backward_chunk,
}


@functools.cache
def _compiled(function, backend: str):
    # dynamic: one graph for every row count and chunk width (heads, clusters, experts and
    # batch sizes differ); the callers pass detached tensors, so requires_grad never varies
    # either. Measured on an H100 before both: 8 recompilations and eager fallback.
    return torch.compile(function, backend=backend, dynamic=True)


def compiled_body(function):
    """``function`` compiled (once per process), or as it is while Dynamo is already tracing
    the caller (a compiled model: the body is inlined into its graph)."""
    if torch.compiler.is_compiling():
        return function
    return _compiled(function, COMPILE_BACKEND)


def chunk_body(name: str):
    """The compiled chunk body ``name`` of :data:`BODIES`."""
    return compiled_body(BODIES[name])


def padded_output(weight, bias, width: int, dtype: torch.dtype, acc: torch.dtype):
    """``W`` in the compute dtype and ``b`` in the accumulation dtype, padded to a multiple of
    ``width`` rows (zero weights, ``-inf`` bias): one cast-and-copy of ``W`` per call."""
    v = weight.size(0)
    padded = math.ceil(v / width) * width
    w = weight.new_zeros(padded, weight.size(1), dtype=dtype)
    w[:v] = weight
    b = weight.new_full((padded,), -math.inf, dtype=acc)
    if bias is None:
        b[:v] = 0.0
    else:
        b[:v] = bias
    return w, b


def joint_width(d: int) -> int:
    """The columns of ``[h | 1 | 0]``: ``d + 1`` padded to a multiple of 8 (16-byte rows in
    half precision, as the tensor-core products need)."""
    return (d + 8) // 8 * 8


def with_ones(hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[h | 1 | 0]`` in ``dtype`` (:func:`joint_width` columns): one cast-and-copy of ``h``
    per call (in place of the plain cast) for the bias gradient's fold, ``dz^T [h | 1 | 0] =
    [dW | db | 0]``; times ``[W | b | 0]^T`` it is ``h W^T + b`` in one product."""
    n, d = hidden.shape
    if torch.compiler.is_compiling():  # traced: the graph's one fused kernel writes it
        h_ext = hidden.new_zeros(n, joint_width(d), dtype=dtype)
        h_ext[:, :d] = hidden
        h_ext[:, d] = 1.0
        return h_ext
    # one concatenation (a launch where the three writes were six host operators)
    ones = _ones_columns(hidden.device, dtype, joint_width(d) - d).expand(n, -1)
    return torch.cat((as_dtype(hidden, dtype), ones), 1)


@functools.cache
def _ones_columns(device: torch.device, dtype: torch.dtype, width: int) -> torch.Tensor:
    """``[1 | 0]`` ``[1, width]``: :func:`with_ones`' columns after ``h``, made once a device
    and dtype."""
    columns = torch.zeros(1, width, dtype=dtype, device=device)
    columns[0, 0] = 1.0
    return columns


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def own(tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` as a tensor of their own (no view): the compiled bodies then see
    inputs with no storage offset or base to guard on, and never recompile per chunk. The
    copy of a chunk of ``W`` is small next to its product; a whole tensor is passed as is."""
    if start == 0 and stop == tensor.size(0) and tensor._base is None:
        return tensor
    return tensor[start:stop].clone()


def row_spans(total: int, tile: int | None) -> list[tuple[int, int]]:
    """Row tiles; one when ``tile`` is None (a data-dependent row count under compile)."""
    if tile is None:
        return [(0, total)]
    return [(start, min(total, start + tile)) for start in range(0, total, tile)]


def own_targets(target: torch.Tensor, classes: int) -> torch.Tensor:
    """Targets outside ``[0, V)`` (ignored, or another block's) as -1: never a padding column."""
    return torch.where((target >= 0) & (target < classes), target, -1)


class CompiledLinearLSE(torch.autograd.Function):
    """``(lse, z_target)`` per row of ``z = h W^T + b`` by equal chunks of ``width`` columns
    (and row tiles of ``tile``): the module docstring."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, dtype, acc, tile: int | None, width: int):
        n = hidden.size(0)
        target = own_targets(target, weight.size(0))
        h = hidden.detach().to(dtype)
        w, b = padded_output(weight.detach(), _detached(bias), width, dtype, acc)
        body = chunk_body("forward")
        lse = hidden.new_empty(n, dtype=acc)
        picked_all = hidden.new_zeros(n, dtype=acc)
        for r0, r1 in row_spans(n, tile):
            top = hidden.new_full((r1 - r0,), -math.inf, dtype=acc)
            total = hidden.new_zeros(r1 - r0, dtype=acc)
            picked = hidden.new_zeros(r1 - r0, dtype=acc)
            rows_h = own(h, r0, r1)
            for c0 in range(0, w.size(0), width):
                local = target[r0:r1] - c0
                top, total, picked = body(
                    rows_h, own(w, c0, c0 + width), own(b, c0, c0 + width), local, top, total,
                    picked,
                )  # fmt: skip
            lse[r0:r1] = top + total.log()
            picked_all[r0:r1] = picked
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.layout = dtype, tile, width
        return lse, picked_all

    @staticmethod
    def backward(ctx, grad_lse, grad_target):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        dtype, tile, width = ctx.layout
        acc = lse.dtype
        (n, d), v = hidden.shape, weight.size(0)
        # db folded into dW's product; no bias (or a frozen one): no db at all
        fold = bias is not None and ctx.needs_input_grad[2]
        h = with_ones(hidden.detach(), dtype) if fold else hidden.detach().to(dtype)
        w, b = padded_output(weight.detach(), _detached(bias), width, dtype, acc)
        body = chunk_body("backward_bias" if fold else "backward")
        g = grad_lse.to(acc) if grad_lse is not None else lse.new_zeros(n)
        g_t = grad_target.to(acc) if grad_target is not None else lse.new_zeros(n)
        grad_h = hidden.new_zeros(n, d, dtype=acc)
        # [dW | db | 0] (or dW): the first row tile writes it, later ones add (no rows: zeros)
        tiles = row_spans(n, tile)
        new = weight.new_empty if tiles else weight.new_zeros
        grad_wb = new(w.size(0), h.size(1), dtype=acc)
        for r0, r1 in tiles:
            rows_grad = grad_h[r0:r1].clone()
            h_r, lse_r, g_r, g_t_r = (own(t, r0, r1) for t in (h, lse, g, g_t))
            for c0 in range(0, w.size(0), width):
                rows_grad, dwb = body(
                    h_r, own(w, c0, c0 + width), own(b, c0, c0 + width), target[r0:r1] - c0,
                    lse_r, g_r, g_t_r, rows_grad,
                )  # fmt: skip
                if r0 == 0:
                    grad_wb[c0 : c0 + width] = dwb
                else:
                    grad_wb[c0 : c0 + width] += dwb
            grad_h[r0:r1] = rows_grad
        return (
            grad_h.to(hidden.dtype),
            grad_wb[:v, :d].to(weight.dtype),
            grad_wb[:v, d].to(bias.dtype) if fold else None,
            *([None] * 5),
        )


def _mixture_inputs(contexts, weight, bias, shift, dtype, acc):
    """Detached ``[N K, d]`` contexts and ``W`` in the compute dtype, ``b`` and ``a`` (as
    ``[N, K, 1]``) in the accumulation dtype."""
    n, k, d = contexts.shape
    flat = contexts.detach().reshape(n * k, d).to(dtype)
    w = weight.detach().to(dtype)
    b = weight.new_zeros(weight.size(0), dtype=acc) if bias is None else bias.detach().to(acc)
    return flat, w, b, shift.detach().to(acc).unsqueeze(-1)


class CompiledMixtureLogProbSum(torch.autograd.Function):
    """``sum_x logsumexp_k(a_k + z_{k,x})`` per row by chunks of ``width`` columns, each
    chunk one compiled body (``heads/mos.py``'s ``mixture_log_prob_sum``; the last chunk,
    narrower, is a second graph: padding columns would add ``-inf`` terms to the sum)."""

    @staticmethod
    def forward(ctx, contexts, weight, bias, shift, dtype, acc, width: int):
        n, k, d = contexts.shape
        flat, w, b, a = _mixture_inputs(contexts, weight, bias, shift, dtype, acc)
        body = chunk_body("mixture_forward")
        total = contexts.new_zeros(n, dtype=acc)
        flat = own(flat, 0, flat.size(0))
        for c0 in range(0, weight.size(0), width):
            total = body(flat, own(w, c0, c0 + width), own(b, c0, c0 + width), a, total)
        ctx.save_for_backward(contexts, weight, bias, shift)
        ctx.layout = dtype, acc, width
        return total

    @staticmethod
    def backward(ctx, grad_total):
        contexts, weight, bias, shift = ctx.saved_tensors
        dtype, acc, width = ctx.layout
        n, k, d = contexts.shape
        flat, w, b, a = _mixture_inputs(contexts, weight, bias, shift, dtype, acc)
        g = grad_total.to(acc).view(n, 1, 1)
        body = chunk_body("mixture_backward")
        grad_flat = contexts.new_zeros(n * k, d, dtype=acc)
        grad_shift = contexts.new_zeros(n, k, dtype=acc)
        flat = own(flat, 0, flat.size(0))
        grad_w = weight.new_empty(weight.shape, dtype=acc)
        grad_b = weight.new_empty(weight.size(0), dtype=acc)
        for c0 in range(0, weight.size(0), width):
            grad_flat, dw, db, grad_shift = body(
                flat, own(w, c0, c0 + width), own(b, c0, c0 + width), a, g, grad_flat, grad_shift
            )
            grad_w[c0 : c0 + width] = dw
            grad_b[c0 : c0 + width] = db
        return (
            grad_flat.view(contexts.shape).to(contexts.dtype),
            grad_w.to(weight.dtype),
            None if bias is None else grad_b.to(bias.dtype),
            grad_shift.to(shift.dtype),
            None,
            None,
            None,
        )
