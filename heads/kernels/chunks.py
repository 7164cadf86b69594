"""The chunk passes every eager loss kernel shares: one chunk's product ``h W_c^T + b_c``,
its in-place ``exp`` and row sums, the online log-sum-exp that joins chunks, the target's
column in a chunk, and the dtype rules (products in the compute dtype, reductions in float32,
float64 kept). Shapes only, never values: the loops trace under ``torch.compile``.
"""

from __future__ import annotations

import math
import warnings

import torch

# exp below about -87 gives subnormal floats, 20-40x slower on x86 CPUs (in the exp and in the
# products that read them). A class below the floor counts as exp(-60) = 9e-27 of the
# row's largest term: 1e-21 relative at 100k classes, far below float32 rounding.
EXP_FLOOR = -60.0


def spans(total: int, width: int | None) -> list[tuple[int, int]]:
    """``[0, total)`` in consecutive ``(start, stop)`` spans of at most ``width``; one span
    when ``width`` is None (a symbolic row count under ``torch.compile``: no loop on it)."""
    if width is None:
        return [(0, total)]
    return [(start, min(total, start + width)) for start in range(0, total, width)]


def span_of(
    x: torch.Tensor | None, start: int, stop: int, view: bool = False
) -> torch.Tensor | None:
    """``x[start:stop]``, or ``x`` itself where the span is all of it (unless ``view``: a
    slice always): a step in one tile (a launch-bound GPU step's usual case) then dispatches
    no slicing operator a tensor."""
    if x is None or (not view and start == 0 and stop == x.size(0)):
        return x
    return x[start:stop]


# -- the row passes ---------------------------------------------------------------------------
# The elementwise passes of the loss over one chunk's float32/64 logits ``z [R, C]``. On a CPU
# the exps are floored at ``EXP_FLOOR``.
def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without a dispatcher call when it already is (the loss's loops make
    dozens of these per call, most of them no-ops)."""
    return x if x.dtype == dtype else x.to(dtype)


def as_input(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad`` in the shape and dtype of the input ``x`` it is the gradient of, with no
    dispatcher call for what already matches (a backward returns several: each a host
    operator on a launch-bound GPU step)."""
    if grad.shape != x.shape:
        grad = grad.view(x.shape)
    return as_dtype(grad, x.dtype)


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


# The device types that run the GPU's execution plans (compiled bodies, tiles sized for the
# device's memory, launch-bound steps plainly): CUDA. A CPU added here runs them too, as an
# H100 would plan them: `python -m app.bench.profile --plans cuda` counts there what a GPU step
# dispatches (the launch-bound proxy); everything else keeps its CPU-tuned plans.
GPU_PLAN_DEVICES = {"cuda"}


def gpu_plans(device: torch.device) -> bool:
    """Whether ``device`` runs the GPU's execution plans (:data:`GPU_PLAN_DEVICES`)."""
    return device.type in GPU_PLAN_DEVICES


# CUDA takes half-precision operands into a float32 product (torch.mm's out_dtype: cuBLAS
# accumulates in float32 and writes float32); False once it has refused (then the product is
# rounded to the operands' dtype first, as on other devices). "addmm": whether the in-place
# sum into a float32 accumulator is taken too (the benchmark's JSON records this dict)
FLOAT32_PRODUCTS = {"cuda": True}


def accumulate_mm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool) -> None:
    """``out (+)= a b`` without a temporary where the dtypes allow. Half-precision operands
    into a float32 ``out`` on CUDA: the product itself in float32 (no rounding of a tile's
    partial sums to bf16 before they are added up), straight into ``out`` when not adding."""
    if out.dtype == a.dtype:
        if add:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
        return
    if _float32_products(out, a):
        try:
            if not add:
                torch.mm(a, b, out_dtype=out.dtype, out=out)
            elif FLOAT32_PRODUCTS.get("addmm", True):
                _addmm_float32(out, a, b)
            else:
                out += torch.mm(a, b, out_dtype=out.dtype)
            return
        except (RuntimeError, NotImplementedError) as error:  # refused before any work ran
            FLOAT32_PRODUCTS[out.device.type] = False
            warnings.warn(f"float32 products of {a.dtype} operands refused ({error}): "
                          "rounding each product to the operands' dtype", stacklevel=2)  # fmt: skip
    if add:
        out += torch.mm(a, b).to(out.dtype)
    else:
        out.copy_(torch.mm(a, b))


def _addmm_float32(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out += a b`` in place, as one product that reads and writes the float32 ``out``
    (the accumulator never leaves the GEMM); where this torch refuses a float32 ``out`` to
    add to (its checks changed between versions), a float32 product then an add."""
    try:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    except (RuntimeError, NotImplementedError):
        FLOAT32_PRODUCTS["addmm"] = False
        out += torch.mm(a, b, out_dtype=out.dtype)


def _float32_products(out: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``a b`` into ``out`` runs as one half-precision product written in float32."""
    return (
        out.dtype == torch.float32
        and a.dtype in (torch.float16, torch.bfloat16)
        and FLOAT32_PRODUCTS.get(out.device.type, False)
        and not torch.compiler.is_compiling()  # traced: the plain form (any backend has it)
    )
