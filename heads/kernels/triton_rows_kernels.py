"""The Triton kernels of :mod:`heads.kernels.triton_rows` (imported only from there, on first
use: importing this module imports Triton). ``ACC``: the statistics' dtype (float32; float64
for float64 logits)."""

import torch
import triton
import triton.language as tl

# the statistics' dtype for each accumulation dtype
ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


@triton.jit
def _logits(z_row, bias_ptr, cols, mask, HAS_BIAS: tl.constexpr, ACC: tl.constexpr):
    x = tl.load(z_row + cols, mask=mask, other=float("-inf")).to(ACC)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(ACC)
    return x


@triton.jit
def _write_gradient(z_row, bias_ptr, t, lse, scale, onehot, uniform, cols, mask,
                    HAS_BIAS: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    x = _logits(z_row, bias_ptr, cols, mask, HAS_BIAS, ACC)
    p = tl.where(lse == float("-inf"), 0.0, tl.exp(x - lse))  # a row of -inf: p = 0
    dz = scale * p - tl.where(cols == t, onehot, 0.0) - uniform
    tl.store(z_row + cols, dz.to(z_row.dtype.element_ty), mask=mask)


@triton.jit
def fresh_statistics(ACC: tl.constexpr, BLOCK: tl.constexpr):
    """A row's statistics before its first block: ``(top, total, picked, logit_sum)``."""
    top = tl.full([], float("-inf"), ACC)
    return top, tl.zeros([], ACC), tl.zeros([BLOCK], ACC), tl.zeros([BLOCK], ACC)


@triton.jit
def statistics_step(x, cols, mask, t, top, total, picked, logit_sum, HAS_SUM: tl.constexpr):
    """One block of a row's logits ``x`` into its running statistics: the online log-sum-exp
    by blocks (one exp per logit; per lane it would take two), ``top`` the maximum so far and
    ``total`` the sum of ``exp(x - top)`` (shifted by 0 while ``top`` is -inf: ``-inf - -inf``
    is NaN), the target's logit and the logits' sum (``mask``: the row's own columns)."""
    new_top = tl.maximum(top, tl.max(x, 0))
    shift = tl.where(new_top == float("-inf"), 0.0, new_top)
    # nothing so far (top -inf): total is 0, rescaled by 0, not by exp(-inf - shift)
    rescale = tl.where(top == float("-inf"), 0.0, tl.exp(top - shift))
    total = total * rescale + tl.sum(tl.exp(x - shift), 0)
    picked += tl.where((cols == t) & mask, x, 0.0)  # not a padded column
    if HAS_SUM:
        logit_sum += tl.where(mask, x, 0.0)
    return new_top, total, picked, logit_sum


@triton.jit
def store_statistics(row, top, total, picked, logit_sum, lse_ptr, picked_ptr, sum_ptr,
                     HAS_SUM: tl.constexpr):  # fmt: skip
    """The row's ``lse`` (returned), target logit and logit sum, stored."""
    lse = tl.where(top == float("-inf"), 0.0, top) + tl.log(total)
    tl.store(lse_ptr + row, lse)
    tl.store(picked_ptr + row, tl.sum(picked, 0))
    if HAS_SUM:
        tl.store(sum_ptr + row, tl.sum(logit_sum, 0))
    return lse


@triton.jit
def statistics(z_ptr, bias_ptr, target_ptr, lse_ptr, picked_ptr, sum_ptr,
               scale_ptr, onehot_ptr, uniform_ptr, v, stride,
               HAS_BIAS: tl.constexpr, HAS_SUM: tl.constexpr, FUSE: tl.constexpr,
               HAS_UNIFORM: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride
    t = tl.load(target_ptr + row)
    top, total, picked, logit_sum = fresh_statistics(ACC, BLOCK)
    for start in range(0, v, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < v
        x = _logits(z_row, bias_ptr, cols, mask, HAS_BIAS, ACC)
        top, total, picked, logit_sum = statistics_step(x, cols, mask, t, top, total, picked,
                                                        logit_sum, HAS_SUM)  # fmt: skip
    lse = store_statistics(row, top, total, picked, logit_sum, lse_ptr, picked_ptr, sum_ptr,
                           HAS_SUM)  # fmt: skip
    if FUSE:  # one softmax: dz in the same program, its coefficients given
        scale = tl.load(scale_ptr + row)
        onehot = tl.load(onehot_ptr + row)
        uniform = 0.0
        if HAS_UNIFORM:
            uniform = tl.load(uniform_ptr + row)
        for start in range(0, v, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            _write_gradient(z_row, bias_ptr, t, lse, scale, onehot, uniform, cols, cols < v,
                            HAS_BIAS, ACC)  # fmt: skip


@triton.jit
def gradient(z_ptr, bias_ptr, target_ptr, lse_ptr, scale_ptr, onehot_ptr, uniform_ptr,
             v, stride, HAS_BIAS: tl.constexpr, HAS_UNIFORM: tl.constexpr,
             ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    uniform = 0.0
    if HAS_UNIFORM:
        uniform = tl.load(uniform_ptr + row)
    _write_gradient(z_ptr + row.to(tl.int64) * stride, bias_ptr, tl.load(target_ptr + row),
                    tl.load(lse_ptr + row), tl.load(scale_ptr + row), tl.load(onehot_ptr + row),
                    uniform, cols, cols < v, HAS_BIAS, ACC)  # fmt: skip


cdiv = triton.cdiv
