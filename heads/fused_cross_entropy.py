"""The fused linear + log-sum-exp primitive under every head's training loss.

From hidden rows ``h [N, d]`` and an output matrix ``W [V, d]`` (+ bias ``b``), the per-row
log-sum-exp of the logits ``z = h W^T + b``, the target's logit and (for label smoothing) the
sum of the logits, without a ``[N, V]`` tensor:

- the forward walks the vocabulary in column chunks (and, when ``N`` is very large, the rows
  in tiles), each chunk's product followed by its row maximum and ``sum exp``; the chunks'
  results combine as an online log-sum-exp, ``lse = m + log sum_c exp(m_c - m) s_c``;
- the backward recomputes each chunk's product and writes ``dL/dz = g p + g_t onehot + g_s``
  for that chunk only (``p = exp(z - lse)``), straight into the two products
  ``dL/dh += dz W_c`` and ``dL/dW_c = dz^T h``: memory ``O(N chunk + N d)`` besides the
  gradients themselves.
- Chunk results may be kept for the backward instead of recomputed, up to a byte budget
  (``LossOptions.saved_bytes``): small problems then run three products, as an unfused loss
  does, and large ones four, in bounded memory.

Under autocast the products run in the autocast dtype and everything else (maximum, exp, sums,
log-sum-exp, the gradient of the logits) in float32; float64 stays float64. Rows are never
branched on by value (no host sync): the loops depend on shapes only, so the function traces
into one graph under ``torch.compile``.

Backends (``LossOptions.backend``): ``torch`` (the portable path above, the default), and on
CUDA the optional ``cce`` (Apple's cut-cross-entropy) and ``liger`` (Liger-Kernel's fused
linear cross-entropy), imported on first use.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from heads.cross_entropy import IGNORE_INDEX
from heads.errors import HeadConfigError, UserError
from heads.kernels.compiled_lse import CompiledLinearLSE

BACKENDS = ("auto", "torch", "cce", "liger")
PLANS = ("auto", "eager", "compiled")

# Working set of one chunk's logits (float32 entries): small enough on a CPU for the chunk's
# passes to run from cache and for glibc to reuse the freed memory; on a GPU large enough for
# the products to fill the device.
_CHUNK_BYTES = {"cpu": 16 << 20}
_ACCELERATOR_CHUNK_BYTES = 128 << 20
# CUDA: at most this many chunks per row tile (each chunk is a few kernel launches and a
# product; fewer, wider chunks fill the GPU), at least _CUDA_MIN_BYTES of logits per chunk,
# and no chunk over 1/_CUDA_MEMORY_SHARE of the device's memory (then rows are tiled).
_CUDA_MAX_CHUNKS = 32
_CUDA_MIN_BYTES = 256 << 20
_CUDA_MEMORY_SHARE = 16
# Chunk results kept for the backward instead of recomputed, per call (see LossOptions).
DEFAULT_SAVED_BYTES = 128 << 20
_MIN_COLUMNS = 128  # narrower chunks make the products inefficient: tile the rows instead
# The backward builds dL/dz in one pass over the logits where V <= _FOLD_RATIO d, instead of
# scaling [R, d] rows (five [R, d] passes and temporaries, measured slower there).
_FOLD_RATIO = 4
_ALIGN = 16  # chunk widths are multiples of 16 columns (MKL and tensor cores prefer them)
# exp below about -87 gives subnormal floats, 20-40x slower on x86 CPUs (in the exp and in the
# products that read them). A class below the floor counts as exp(-60) = 9e-27 of the
# row's largest term: 1e-21 relative at 100k classes, far below float32 rounding.
EXP_FLOOR = -60.0


@dataclass(frozen=True)
class LossOptions:
    """How a head's training loss runs (a task's ``loss_backend`` sets ``backend``).

    backend: ``auto`` (= ``torch`` until other backends are measured faster), ``torch``,
        ``cce`` or ``liger`` (see the module docstring).
    chunk_bytes: bytes of one chunk's float32 logits; None: 16 MiB on a CPU, 128 MiB on a GPU.
    saved_bytes: chunk results the forward may keep for the backward instead of recomputing
        them, per call (default 128 MiB; 0: always recompute).
    columns, rows: force the chunk width and the row tile (tests, tuning); None: from bytes.
    fold: how the backward forms ``dL/dz``: True, chunk by chunk in one pass over the logits;
        False, by scaling ``[N, d]`` rows; None: True where ``V <= 4 d`` (tests, tuning).
    plan: ``eager`` (the hand-written chunk loop, tuned for CPUs), ``compiled`` (one
        compiled function per chunk, ``heads/kernels/compiled_lse.py``, tuned for GPUs), or
        ``auto``: compiled on CUDA, eager elsewhere.
    device_memory: bytes of device memory the CUDA chunks are planned for; None: the
        device's own (tests state one to check a plan on a CPU).
    """

    backend: str = "auto"
    chunk_bytes: int | None = None
    saved_bytes: int = DEFAULT_SAVED_BYTES
    columns: int | None = None
    rows: int | None = None
    fold: bool | None = None
    plan: str = "auto"
    device_memory: int | None = None

    def __post_init__(self) -> None:
        check_backend(self.backend)
        if self.plan not in PLANS:
            raise HeadConfigError(f"LossOptions.plan must be one of {', '.join(PLANS)}")
        for name in ("chunk_bytes", "columns", "rows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise HeadConfigError(f"LossOptions.{name} must be a positive integer or None")
        if not isinstance(self.saved_bytes, int) or self.saved_bytes < 0:
            raise HeadConfigError("LossOptions.saved_bytes must be a non-negative integer")


def check_backend(name: str) -> None:
    if name not in BACKENDS:
        raise HeadConfigError(
            f"loss backend {name!r} is not one of {', '.join(BACKENDS)}: set loss_backend to one"
        )


class MissingBackendError(UserError, ImportError):
    """An optional loss backend was asked for but its package (or device) is not there."""


# -- chunking ---------------------------------------------------------------------------------
def plan_tiles(
    rows: int, columns: int, device: torch.device, options: LossOptions, entries_per_column=1
) -> tuple[int | None, int]:
    """``(row tile, chunk width)`` for ``[rows, columns]`` logits with ``entries_per_column``
    float32 values held per entry (Mixtape's blocks hold ``2K``): the chunk's working set
    stays near ``options.chunk_bytes``. Both only depend on the shapes."""
    budget = options.chunk_bytes or _CHUNK_BYTES.get(device.type, _ACCELERATOR_CHUNK_BYTES)
    if device.type == "cuda" and options.chunk_bytes is None:
        budget = cuda_chunk_bytes(rows, columns, entries_per_column, device, options)
    entries = max(1, budget // (4 * entries_per_column))
    width = options.columns
    if width is None:
        width = max(entries // max(rows, 1) // _ALIGN * _ALIGN, _MIN_COLUMNS)
        # as many chunks, of even widths: no narrow last chunk (a slower product)
        count = math.ceil(columns / width)
        width = math.ceil(math.ceil(columns / count) / _ALIGN) * _ALIGN
    width = max(1, min(width, columns))
    tile = options.rows
    if tile is None:  # all rows, unless even the narrowest chunk of them is over budget
        tile = rows if rows * width <= entries else entries // width
    return max(1, min(tile, rows)), width


def cuda_chunk_bytes(
    rows: int, columns: int, entries_per_column: int, device: torch.device, options: LossOptions
) -> int:
    """A CUDA chunk's bytes: wide enough for at most ``_CUDA_MAX_CHUNKS`` chunks (MoS's K N
    rows get chunks as wide as the softmax's N rows), at least ``_CUDA_MIN_BYTES``, at most
    a ``1/_CUDA_MEMORY_SHARE`` of the device memory."""
    memory = options.device_memory or _device_memory(device)
    width = math.ceil(columns / _CUDA_MAX_CHUNKS)
    wanted = 4 * entries_per_column * max(rows, 1) * width
    return max(_CUDA_MIN_BYTES, min(wanted, memory // _CUDA_MEMORY_SHARE))


def _device_memory(device: torch.device) -> int:
    """The CUDA device's memory in bytes (a property query: no sync)."""
    return torch.cuda.get_device_properties(device).total_memory


def spans(total: int, width: int | None) -> list[tuple[int, int]]:
    """``[0, total)`` in consecutive ``(start, stop)`` spans of at most ``width``; one span
    when ``width`` is None (a symbolic row count under ``torch.compile``: no loop on it)."""
    if width is None:
        return [(0, total)]
    return [(start, min(total, start + width)) for start in range(0, total, width)]


# -- the row passes ---------------------------------------------------------------------------
# The elementwise passes of the loss over one chunk's float32/64 logits ``z [R, C]``. On a CPU
# the exps are floored at ``EXP_FLOOR``.
def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without a dispatcher call when it already is (the loss's loops make
    dozens of these per call, most of them no-ops)."""
    return x if x.dtype == dtype else x.to(dtype)


def chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    accumulate: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``h W^T + b`` in the compute dtype (``hidden``'s), returned in the accumulation dtype,
    written into the start of ``out`` (flat storage reused from chunk to chunk) when given."""
    if out is not None:
        rows, columns = hidden.size(0), weight.size(0)
        out = out[: rows * columns].view(rows, columns)
    if hidden.dtype == accumulate:
        if bias is None:
            return torch.mm(hidden, as_dtype(weight, hidden.dtype).t(), out=out)
        return torch.addmm(
            as_dtype(bias, accumulate), hidden, as_dtype(weight, hidden.dtype).t(), out=out
        )
    z = torch.mm(hidden, as_dtype(weight, hidden.dtype).t())
    z = as_dtype(z, accumulate) if out is None else out.copy_(z)
    return z if bias is None else z.add_(as_dtype(bias, accumulate))


def finite_shift(top: torch.Tensor) -> torch.Tensor:
    """A row maximum to shift by: 0 where the row is all ``-inf`` (masked columns), whose
    ``exp(-inf - 0) = 0`` where ``-inf - -inf`` would be NaN."""
    return torch.where(top == -math.inf, 0.0, top)


def exp_sum_(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place ``z <- exp(z - m)`` with ``m`` the row maximum (floored on a CPU); returns
    ``(m, sum of the row)``. A row of ``-inf`` has ``m = -inf`` and ``z <- exp(z)``: its sum
    only ever enters :func:`combine_chunk` times ``exp(-inf) = 0``."""
    top = z.amax(1)
    return top, exp_shifted_(z, finite_shift(top)).sum(1)


def exp_shifted_(z: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """In place ``z <- exp(z - shift)`` per row, ``exp(max(z - shift, EXP_FLOOR))`` on a CPU."""
    z.sub_(shift.unsqueeze(1))
    if z.device.type == "cpu":
        z.clamp_(min=EXP_FLOOR)
    return z.exp_()


def target_columns(target: torch.Tensor, start: int, stop: int):
    """``(inside, column)`` of targets for the columns ``[start, stop)``: whether each row's
    target falls there, and its column in the chunk (clamped to a valid one where not),
    ``[R, 1]`` for ``gather``/``scatter_add_``."""
    inside = (target >= start) & (target < stop)
    return inside, (target - start).clamp(0, stop - start - 1).unsqueeze(1)


def chunk_buffer(like: torch.Tensor, rows: int, width: int, dtype: torch.dtype):
    """Flat storage for the chunks that are not kept, reused from one to the next: a fresh
    tensor per chunk costs a page fault per 4 KiB on a CPU (glibc maps large blocks anew) and
    leaves freed blocks in the resident set. None under ``torch.compile``, which plans its
    own buffers."""
    if torch.compiler.is_compiling():
        return None
    return like.new_empty(rows * width, dtype=dtype)


def combine_chunk(
    top: torch.Tensor, total: torch.Tensor, chunk_top: torch.Tensor, chunk_total: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online log-sum-exp: ``(m, s)`` and one more chunk's ``(m_c, s_c)`` into the pair with
    ``m' = max(m, m_c)``, ``s' = s e^(m - m') + s_c e^(m_c - m')``."""
    new_top = torch.maximum(top, chunk_top)
    shift = finite_shift(new_top)  # both -inf: total 0, not NaN
    return new_top, total * torch.exp(top - shift) + chunk_total * torch.exp(chunk_top - shift)


def accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32 (the reductions' dtype)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The products' dtype: the autocast dtype under autocast, else the inputs' common one."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.dtype != torch.float64:
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _LinearLSE(torch.autograd.Function):
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
        n, v = hidden.size(0), weight.size(0)
        h = as_dtype(hidden, dtype)
        # per row tile: log-sum-exp, target logit, logit sum (one tile in the common case)
        tiles: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        kept: list[torch.Tensor] = []  # probabilities of the chunks kept for the backward
        budget = saved_bytes
        size = torch.finfo(acc).bits // 8
        buffer = None
        for r0, r1 in spans(n, tile):
            rows_t = target[r0:r1]
            top = total = picked = row_sum = None
            tile_kept = []
            for c0, c1 in spans(v, width):
                keep = False  # a prefix of the chunks is kept: the backward counts them
                if budget > 0:
                    budget -= (r1 - r0) * (c1 - c0) * size
                    keep = budget >= 0
                if not keep and buffer is None:
                    buffer = chunk_buffer(hidden, r1 - r0, width, acc)
                z = chunk_logits(h[r0:r1], weight[c0:c1], None if bias is None else bias[c0:c1],
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
            for exps, shift in tile_kept:  # exp(z - m_c) e^(m_c - lse) = p
                kept.append(exps.mul_(torch.exp(shift - tile_lse).unsqueeze(1)))
            tiles.append((tile_lse, picked, row_sum))
        lse, target_logit, logit_sum = (  # zeros: no rows, or no logit sum asked for
            _join([part[i] for part in tiles]) if tiles and (i < 2 or want_sum)
            else hidden.new_zeros(n, dtype=acc)
            for i in range(3)
        )  # fmt: skip
        ctx.save_for_backward(hidden, weight, bias, target, lse, *kept)
        ctx.kept_chunks = len(kept)
        ctx.layout = dtype, tile, width
        ctx.want_sum = want_sum
        ctx.fold = fold
        return lse, target_logit, logit_sum

    @staticmethod
    def backward(ctx, grad_lse, grad_target, grad_sum):
        hidden, weight, bias, target, lse, *kept = ctx.saved_tensors
        dtype, tile, width = ctx.layout
        acc = lse.dtype
        n, v = hidden.size(0), weight.size(0)
        h = as_dtype(hidden, dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        tiles = spans(n, tile)
        # the first row tile writes dW and db, the others add to them (no rows: zeros)
        new = weight.new_empty if tiles else weight.new_zeros
        grad_h = hidden.new_empty(n, hidden.size(1), dtype=acc) if need_h else None
        grad_w = new(v, weight.size(1), dtype=acc) if need_w else None
        grad_b = new(v, dtype=acc) if need_b else None
        g_s = as_dtype(grad_sum, acc) if ctx.want_sum and grad_sum is not None else None
        # dL/dz = g p + g_t onehot_t + g_s. Narrow vocabularies (at most _FOLD_RATIO d
        # columns) build it chunk by chunk, one pass over [R, C]; wide ones put the row scale
        # g on h (for dW) and on the [R, d] product (for dh), and the onehot and uniform
        # terms are [R, d] / [V, d] updates after the chunks: no pass over [R, C] beyond p.
        fold = ctx.fold if ctx.fold is not None else v <= _FOLD_RATIO * weight.size(1)
        chunk, buffer = 0, None
        for tile_index, (r0, r1) in enumerate(tiles):
            rows_lse, h_r, rows_t = lse[r0:r1], h[r0:r1], target[r0:r1]
            g = as_dtype(grad_lse[r0:r1], acc)
            if fold:
                g_t = as_dtype(grad_target[r0:r1], acc)
                g_s_r = None if g_s is None else g_s[r0:r1]
            else:
                scaled_h = as_dtype(as_dtype(h_r, acc) * g.unsqueeze(1), dtype)
            product = None  # sum over chunks of p_c W_c, [R, d]
            for c0, c1 in spans(v, width):
                w = weight[c0:c1]
                kept_chunk = chunk < ctx.kept_chunks
                if buffer is None and (fold or not kept_chunk):
                    buffer = chunk_buffer(hidden, r1 - r0, width, acc)
                if kept_chunk:
                    probs = kept[chunk]
                else:
                    z = chunk_logits(h_r, w, None if bias is None else bias[c0:c1], acc, buffer)
                    probs = exp_shifted_(z, rows_lse)
                chunk += 1
                if fold:
                    dz = _fold_chunk(probs, kept_chunk, buffer, g, g_t, rows_t, c0, c1, g_s_r)
                    dz_c = as_dtype(dz, dtype)
                    if need_h:
                        accumulate_mm(grad_h[r0:r1], dz_c, as_dtype(w, dtype), c0 > 0)
                    if need_w:
                        accumulate_mm(grad_w[c0:c1], dz_c.t(), h_r, tile_index > 0)
                    if need_b:
                        if tile_index > 0:
                            grad_b[c0:c1] += dz.sum(0)
                        else:
                            torch.sum(dz, 0, out=grad_b[c0:c1])
                    continue
                probs_c = as_dtype(probs, dtype)
                if need_h:
                    if product is None:
                        product = as_dtype(torch.mm(probs_c, as_dtype(w, dtype)), acc)
                    else:  # no [R, d] temporary per chunk where the dtypes allow
                        accumulate_mm(product, probs_c, as_dtype(w, dtype), True)
                if need_w:
                    accumulate_mm(grad_w[c0:c1], probs_c.t(), scaled_h, tile_index > 0)
                if need_b:
                    if tile_index > 0:
                        grad_b[c0:c1].addmv_(probs.t(), g)
                    else:
                        torch.mv(probs.t(), g, out=grad_b[c0:c1])
            if need_h and not fold:
                torch.mul(product, g.unsqueeze(1), out=grad_h[r0:r1])
        if not fold:
            _add_target_terms(grad_h, grad_w, grad_b, h, weight, target, grad_target, acc)
            if g_s is not None:  # d(sum_x z_x)/dz = 1 everywhere
                if need_h:
                    grad_h += g_s.unsqueeze(1) * as_dtype(weight, acc).sum(0)
                if need_w:
                    grad_w += g_s @ as_dtype(h, acc)
                if need_b:
                    grad_b += g_s.sum()
        return (
            None if grad_h is None else as_dtype(grad_h, hidden.dtype),
            None if grad_w is None else as_dtype(grad_w, weight.dtype),
            None if grad_b is None else as_dtype(grad_b, bias.dtype),
            *([None] * 7),
        )


def accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    """``out (+)= a b`` without a temporary where the dtypes allow."""
    if out.dtype == a.dtype:
        if add:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif add:
        out += torch.mm(a, b).to(out.dtype)
    else:
        out.copy_(torch.mm(a, b))


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
        grad_b.index_add_(0, safe, g_t)


class LinearLSE(NamedTuple):
    """Per-row results of :func:`linear_lse` (float32; float64 for float64 inputs)."""

    lse: torch.Tensor  # log sum_x exp(z_x)
    target_logit: torch.Tensor  # z_target, 0 where the target is outside [0, V)
    logit_sum: torch.Tensor | None  # sum_x z_x, when asked for


def linear_lse(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    *,
    logit_sum: bool = False,
    options: LossOptions | None = None,
    row_bound: int | None = None,
) -> LinearLSE:
    """Log-sum-exp, target logit and (``logit_sum=True``) logit sum of ``hidden W^T + b`` per
    row, differentiable, without a ``[N, V]`` tensor (module docstring). A target outside
    ``[0, V)`` (another block of the vocabulary, or ignored) just has no target logit.

    ``row_bound``: the row count is data-dependent (rows gathered by value, e.g. an adaptive
    tail cluster's) and at most this: the chunks are planned for it and the rows are not
    tiled, so that under ``torch.compile`` nothing branches on the count."""
    options = options or LossOptions()
    _check_shapes(hidden, weight, bias, target)
    if target is None:
        target = torch.full((hidden.size(0),), -1, dtype=torch.long, device=hidden.device)
    backend = resolve_backend(options.backend, hidden)
    if backend in ("cce", "liger"):
        return _external_lse(backend, hidden, weight, bias, target, logit_sum)
    v = weight.size(0)
    if row_bound is None:
        tile, width = plan_tiles(hidden.size(0), v, hidden.device, options)
        saved = options.saved_bytes
    else:
        (_, width), tile, saved = plan_tiles(row_bound, v, hidden.device, options), None, 0
    if resolve_plan(options.plan, hidden) == "compiled":
        acc = accumulation_dtype(hidden, weight)
        lse, target_logit = CompiledLinearLSE.apply(
            hidden, weight, bias, target, compute_dtype(hidden, weight), acc, tile, width
        )
        return LinearLSE(lse, target_logit, logit_sums(hidden, weight, bias) if logit_sum else None)
    lse, target_logit, total = _LinearLSE.apply(
        hidden, weight, bias, target, logit_sum, compute_dtype(hidden, weight), tile, width,
        saved, options.fold,
    )  # fmt: skip
    return LinearLSE(lse, target_logit, total if logit_sum else None)


def resolve_plan(plan: str, hidden: torch.Tensor) -> str:
    """``auto``: the compiled chunk plan on CUDA, the eager one (CPU-tuned) elsewhere."""
    if plan == "auto":
        return "compiled" if hidden.device.type == "cuda" else "eager"
    return plan


def logit_sums(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``sum_x z_x = h . sum_x W_x + sum_x b_x`` per row, in the accumulation dtype: one
    ``[N, d]`` product instead of a pass over the logits (autograd differentiates it)."""
    acc = accumulation_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):
        total = hidden.to(acc) @ weight.to(acc).sum(0)
        return total if bias is None else total + bias.to(acc).sum()


class CrossEntropyRows(NamedTuple):
    """Per-row cross-entropy of :func:`linear_cross_entropy`, 0 at ignored rows."""

    nll: torch.Tensor  # -log p_target (never smoothed)
    smoothing: torch.Tensor | None  # mean_x(-log p_x), with label smoothing
    lse: torch.Tensor  # log Z (any value at ignored rows)

    def loss(self, label_smoothing: float = 0.0) -> torch.Tensor:
        """``(1 - eps) nll + eps smoothing`` per row: its gradient is ``p - q`` with
        ``q = (1 - eps) onehot + eps / V``."""
        if not label_smoothing:
            return self.nll
        return (1 - label_smoothing) * self.nll + label_smoothing * self.smoothing


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    options: LossOptions | None = None,
    row_bound: int | None = None,
) -> CrossEntropyRows:
    """Cross-entropy of ``softmax(hidden W^T + b)`` per row, fused and chunked (module
    docstring): ``nll``, and with ``label_smoothing`` the smoothing term, both 0 (and with
    zero gradient) where ``target == ignore_index``. Same values and gradients as
    ``F.cross_entropy(F.linear(hidden, weight, bias), target, reduction="none")`` (tested)."""
    if target is None:
        raise ValueError("linear_cross_entropy needs a target [N]")
    keep = target != ignore_index
    parts = linear_lse(
        hidden, weight, bias, torch.where(keep, target, -1),
        logit_sum=bool(label_smoothing), options=options, row_bound=row_bound,
    )  # fmt: skip
    zero = torch.zeros_like(parts.lse)
    nll = torch.where(keep, parts.lse - parts.target_logit, zero)
    smoothing = None
    if label_smoothing:
        mean_logit = parts.logit_sum / weight.size(0)
        smoothing = torch.where(keep, parts.lse - mean_logit, zero)
    return CrossEntropyRows(nll, smoothing, parts.lse)


def combine_lse(*parts: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp over several blocks of the vocabulary from each block's: their
    ``logsumexp``, whose gradient hands every block its share ``exp(lse_b - lse)``."""
    return torch.logsumexp(torch.stack(parts), dim=0)


def _check_shapes(hidden, weight, bias, target) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(
            f"linear_lse expects hidden [N, d] and weight [V, d], got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.size(0)}], got {tuple(bias.shape)}")
    if target is not None and target.shape != hidden.shape[:1]:
        raise ValueError(f"target must be [N] = [{hidden.size(0)}], got {tuple(target.shape)}")


# -- backends ---------------------------------------------------------------------------------
# The field's fused kernels, optional and CUDA-only (requirements-gpu.txt). Each is called
# through its version's own arguments; another version is refused with the pin to install.
EXTERNAL_PACKAGES = {"cce": "cut-cross-entropy==25.1.1", "liger": "liger-kernel==0.8.5"}

# auto on CUDA: the backend the GPU benchmark measured fastest, per head, at vocabulary sizes
# up to the key (bf16, d = 512, 16,384 tokens; `bash .ci/gpu`). Heads or sizes not listed:
# the compiled torch plan.
MEASURED_FASTEST: dict[str, list[tuple[int, str]]] = {}


def fastest_backend(head: str, vocab_size: int, device: torch.device) -> str:
    """What ``auto`` runs for ``head`` (its registry name) at ``vocab_size`` on ``device``."""
    if device.type != "cuda":
        return "torch"
    for largest, backend in MEASURED_FASTEST.get(head, []):
        if vocab_size <= largest:
            return backend
    return "torch"


def resolve_backend(name: str, hidden: torch.Tensor) -> str:
    """The backend that runs: ``auto`` is ``torch`` here (a task resolves ``auto`` per head
    with :func:`fastest_backend` when it knows the device); ``cce`` and ``liger`` need CUDA
    (the name itself is checked by ``LossOptions``)."""
    if name == "auto":
        return "torch"
    if name in ("cce", "liger"):
        check_backend_device(name, hidden.device)
    return name


def check_backend_device(name: str, device: torch.device) -> None:
    if name in ("cce", "liger") and device.type != "cuda":
        raise MissingBackendError(
            f"loss backend {name!r} runs on CUDA only (the model is on {device.type}):"
            f" use loss_backend auto"
        )


def external_loss_function(name: str) -> Callable:
    """A per-row NLL function ``(h, W, b, target) -> [N]`` float32 for ``cce`` or ``liger``,
    sync-free, ``target`` all in ``[0, V)``; a one-line error naming the package to install
    when it is missing or another version."""
    import importlib
    from importlib import metadata

    package = EXTERNAL_PACKAGES[name]
    distribution, version = package.split("==")
    module = {"cce": "cut_cross_entropy.cce", "liger": "liger_kernel.transformers.functional"}
    try:
        installed = metadata.version(distribution)
        importlib.import_module(module[name])
    except (ImportError, metadata.PackageNotFoundError) as error:
        raise MissingBackendError(
            f"loss backend {name!r} needs `pip install {package}` (CUDA and Triton; "
            f"pip install -r requirements-gpu.txt): {error}"
        ) from error
    if installed != version:
        raise MissingBackendError(
            f"loss backend {name!r} is written for {package}, found {installed}: "
            f"`pip install {package}`"
        )
    return _cce_nll if name == "cce" else _liger_nll


def _cce_nll(hidden, weight, bias, target):
    """CCE 25.1.1: its public ``linear_cross_entropy`` has no bias and finds ignored rows with
    ``nonzero()`` (a host sync), so its autograd Function is called with no ignored rows and
    the bias folded in as one more column, ``[h, 1, 0...] . [W, b, 0...]`` (padded to a
    multiple of 8 columns for the kernels' alignment)."""
    from cut_cross_entropy.cce import CCEParams, linear_cross_entropy_apply
    from cut_cross_entropy.utils import _handle_eps

    if bias is not None:
        d = hidden.size(1)
        width = (d + 1 + 7) // 8 * 8
        hidden = torch.cat((hidden, hidden.new_ones(hidden.size(0), 1),
                            hidden.new_zeros(hidden.size(0), width - d - 1)), 1)  # fmt: skip
        weight = torch.cat(
            (weight, bias[:, None], weight.new_zeros(weight.size(0), width - d - 1)), 1
        )
    params = CCEParams(
        target, None, None, "none", _handle_eps("high", hidden.dtype), False, target.size()
    )
    return linear_cross_entropy_apply(hidden.contiguous(), weight.contiguous(), params)


def _liger_nll(hidden, weight, bias, target):
    """Liger 0.8.5 with ``accum_dtype=float32`` (else dW accumulates in bf16)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(
        hidden, weight, target, bias=bias, reduction="none", accum_dtype=torch.float32
    )


def _external_nll(name, hidden, weight, bias, target) -> torch.Tensor:
    """Per-row NLL from CCE or Liger, float32: both want one dtype for ``h``, ``W``, ``b``."""
    function = external_loss_function(name)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device, enabled=False):
        return function(hidden, weight, bias, target).float()


def _external_lse(name, hidden, weight, bias, target, want_sum) -> LinearLSE:
    """``lse = nll(t') + z_t'`` for a valid ``t'`` in every row (the external kernels return
    NLLs only): the ``z`` term's gradient cancels the onehot in the kernel's."""
    acc = accumulation_dtype(hidden, weight)
    valid = (target >= 0) & (target < weight.size(0))
    safe = torch.where(valid, target, 0)
    nll = _external_nll(name, hidden, weight, bias, safe).to(acc)
    with torch.autocast(hidden.device.type, enabled=False):
        h, w = hidden.to(acc), weight.to(acc)
        logit = (h * w.index_select(0, safe)).sum(1)
        if bias is not None:
            logit = logit + bias.to(acc).index_select(0, safe)
    lse = nll + logit
    total = logit_sums(hidden, weight, bias) if want_sum else None
    return LinearLSE(lse, torch.where(valid, logit, torch.zeros_like(logit)), total)
