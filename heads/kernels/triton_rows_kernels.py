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
def statistics(z_ptr, bias_ptr, target_ptr, lse_ptr, picked_ptr, sum_ptr,
               scale_ptr, onehot_ptr, uniform_ptr, v, stride,
               HAS_BIAS: tl.constexpr, HAS_SUM: tl.constexpr, FUSE: tl.constexpr,
               HAS_UNIFORM: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride
    t = tl.load(target_ptr + row)
    # the online log-sum-exp by blocks (one exp per logit; per lane it would take two): top,
    # the maximum so far, and total, the sum of exp(x - top) (x - 0 while top is -inf: NaN
    # otherwise)
    top = tl.full([], float("-inf"), ACC)
    total = tl.zeros([], ACC)
    picked = tl.zeros([BLOCK], ACC)
    logit_sum = tl.zeros([BLOCK], ACC)
    for start in range(0, v, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < v
        x = _logits(z_row, bias_ptr, cols, mask, HAS_BIAS, ACC)
        new_top = tl.maximum(top, tl.max(x, 0))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        # nothing so far (top -inf): total is 0, rescaled by 0, not by exp(-inf - shift)
        rescale = tl.where(top == float("-inf"), 0.0, tl.exp(top - shift))
        total = total * rescale + tl.sum(tl.exp(x - shift), 0)
        top = new_top
        picked += tl.where(cols == t, x, 0.0)
        if HAS_SUM:
            logit_sum += tl.where(mask, x, 0.0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    lse = shift + tl.log(total)
    tl.store(lse_ptr + row, lse)
    tl.store(picked_ptr + row, tl.sum(picked, 0))
    if HAS_SUM:
        tl.store(sum_ptr + row, tl.sum(logit_sum, 0))
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
