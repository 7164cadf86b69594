"""The Triton kernels of :mod:`heads.kernels.triton_rows` (imported only from there, on first
use: importing this module imports Triton). ``ACC``: the statistics' dtype (float32; float64
for float64 logits).

A program reads a row ``[REPS, LANES]`` logits at a time: each thread holds 8 contiguous
logits of a lane (one 16-byte load) in each of the ``REPS`` lane rows, so a block is ``REPS``
loads in flight per thread and its maximum and sum over ``REPS`` stay in the thread. The
online log-sum-exp is kept per lane (:func:`lanes_statistics`, :func:`merge_statistics`: one
``exp`` a logit plus one a lane) and reduced across the program once per row
(:func:`row_lse`): no barrier in the loop over a row. Loads are masked by the row's padded
width (``width``, a multiple of 16 in the rows plan: Triton then proves the 16-byte loads
aligned), logits past ``v`` are ``-inf`` by value.
"""

import torch
import triton
import triton.language as tl

# the statistics' dtype for each accumulation dtype
ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


@triton.jit
def merge_statistics(top, total, other_top, other_total):
    """Two partial log-sum-exps, each a maximum and the sum of ``exp(x - maximum)``, as one
    with one ``exp``: the larger maximum is kept and the other side's sum rescaled by
    ``exp(low - high)`` (0 where both are ``-inf``: ``-inf - -inf`` is NaN)."""
    high = tl.maximum(top, other_top)
    rescale = tl.where(high == float("-inf"), 0.0, tl.exp(tl.minimum(top, other_top) - high))
    total = tl.where(other_top > top, total * rescale + other_total, total + other_total * rescale)
    return high, total


@triton.jit
def lanes_statistics(x, top, total):
    """A block of logits ``x [REPS, LANES]`` into the lanes' running ``(top, total)``: a lane's
    ``REPS`` logits are one thread's, so their maximum and sum need no other thread."""
    block_top = tl.max(x, 0)
    shift = tl.where(block_top == float("-inf"), 0.0, block_top)  # a lane of -inf: sum 0
    return merge_statistics(top, total, block_top, tl.sum(tl.exp(x - shift[None, :]), 0))


@triton.jit
def row_lse(top, total):
    """The row's log-sum-exp from its lanes' statistics (``-inf`` for a row of ``-inf``)."""
    high = tl.max(top, 0)
    shift = tl.where(high == float("-inf"), 0.0, high)
    return shift + tl.log(tl.sum(total * tl.exp(top - shift), 0))


@triton.jit
def _block(z_row, bias_ptr, offs, v, width, HAS_BIAS: tl.constexpr, ACC: tl.constexpr):
    """The logits (plus bias) at ``offs``, ``-inf`` from column ``v`` on."""
    inside = offs < width  # the loads' mask: 16-byte loads where width is a multiple of 16
    x = tl.load(z_row + offs, mask=inside, other=float("-inf")).to(ACC)
    if HAS_BIAS:  # the bias padded to width by the wrapper
        x += tl.load(bias_ptr + offs, mask=inside, other=0.0).to(ACC)
    return tl.where(offs < v, x, float("-inf"))


@triton.jit
def softmax_gradient(x, cols, t, lse, scale, onehot, uniform):
    """``dz = scale p - onehot [x = t] - uniform``, ``p = exp(x - lse)`` (0 for a row of
    ``-inf``, whose ``lse`` is ``-inf``)."""
    p = tl.where(lse == float("-inf"), 0.0, tl.exp(x - lse))
    return scale * p - tl.where(cols == t, onehot, 0.0) - uniform


@triton.jit
def _write_gradient(z_row, bias_ptr, offs, t, lse, scale, onehot, uniform, v, width,
                    HAS_BIAS: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    x = _block(z_row, bias_ptr, offs, v, width, HAS_BIAS, ACC)
    dz = softmax_gradient(x, offs, t, lse, scale, onehot, uniform)
    dz = tl.where(offs < v, dz, 0.0)  # the padding's gradient is 0
    tl.store(z_row + offs, dz.to(z_row.dtype.element_ty), mask=offs < width)


@triton.jit
def _lanes(REPS: tl.constexpr, LANES: tl.constexpr):
    """A block's column offsets ``[REPS, LANES]``: lane row r is columns ``r LANES ..``."""
    return tl.arange(0, REPS)[:, None] * LANES + tl.arange(0, LANES)[None, :]


@triton.jit
def tile_statistics(z_ptr, bias_ptr, target_ptr, lse_ptr, picked_ptr, sum_ptr,
               scale_ptr, onehot_ptr, uniform_ptr, outside_ptr, rows, v, width, stride,
               HAS_BIAS: tl.constexpr, HAS_SUM: tl.constexpr, FUSE: tl.constexpr,
               HAS_UNIFORM: tl.constexpr, HAS_OUTSIDE: tl.constexpr, ACC: tl.constexpr,
               REPS: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    """Per row (a fixed grid of programs, each taking every ``num_programs``-th row): the
    log-sum-exp of ``z + b``, the target's logit (0 outside ``[0, v)``) and, ``HAS_SUM``, the
    logits' sum; ``FUSE``: then ``dz`` over the row, its coefficients given, ``p`` over the
    whole softmax where these columns are one block of it (``HAS_OUTSIDE``: the rest's
    log-sum-exp given)."""
    block = _lanes(REPS, LANES)
    for row in range(tl.program_id(0), rows, tl.num_programs(0)):
        z_row = z_ptr + tl.cast(row, tl.int64) * stride  # (an int in the interpreter)
        t = tl.load(target_ptr + row)
        inside = (t >= 0) & (t < v)  # the target's logit: one load, not a pass
        picked = tl.load(z_row + t, mask=inside, other=0.0).to(ACC)
        if HAS_BIAS:
            picked += tl.load(bias_ptr + t, mask=inside, other=0.0).to(ACC)
        top = tl.full([LANES], float("-inf"), ACC)
        total = tl.zeros([LANES], ACC)
        logit_sum = tl.zeros([LANES], ACC)
        # from the row's end: the dz pass then reads first what this pass read last, the
        # likeliest still in L2
        last = (tl.cdiv(v, REPS * LANES) - 1) * (REPS * LANES)
        for start in range(0, v, REPS * LANES):
            offs = (last - start) + block
            x = _block(z_row, bias_ptr, offs, v, width, HAS_BIAS, ACC)
            top, total = lanes_statistics(x, top, total)
            if HAS_SUM:
                logit_sum += tl.sum(tl.where(offs < v, x, 0.0), 0)
        lse = row_lse(top, total)
        tl.store(lse_ptr + row, lse)
        tl.store(picked_ptr + row, picked)
        if HAS_SUM:
            tl.store(sum_ptr + row, tl.sum(logit_sum, 0))
        if FUSE:  # one softmax: dz in the same program, its coefficients given
            if HAS_OUTSIDE:  # log Z = logaddexp(lse, the rest's): two sums of exp(0)
                high, total = merge_statistics(lse, 1.0, tl.load(outside_ptr + row), 1.0)
                lse = high + tl.log(total)  # both -inf: -inf + log 1
            scale = tl.load(scale_ptr + row)
            onehot = tl.load(onehot_ptr + row)
            uniform = 0.0
            if HAS_UNIFORM:
                uniform = tl.load(uniform_ptr + row)
            for start in range(0, width, REPS * LANES):
                _write_gradient(z_row, bias_ptr, start + block, t, lse, scale, onehot, uniform,
                                v, width, HAS_BIAS, ACC)  # fmt: skip


@triton.jit
def tile_gradient(z_ptr, bias_ptr, target_ptr, lse_ptr, scale_ptr, onehot_ptr, uniform_ptr,
             v, width, stride, HAS_BIAS: tl.constexpr, HAS_UNIFORM: tl.constexpr,
             ACC: tl.constexpr, REPS: tl.constexpr, LANES: tl.constexpr):  # fmt: skip
    """``dz`` over one block of one row (grid: rows x blocks of the padded width)."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * (REPS * LANES) + _lanes(REPS, LANES)
    uniform = 0.0
    if HAS_UNIFORM:
        uniform = tl.load(uniform_ptr + row)
    _write_gradient(z_ptr + row.to(tl.int64) * stride, bias_ptr, offs, tl.load(target_ptr + row),
                    tl.load(lse_ptr + row), tl.load(scale_ptr + row), tl.load(onehot_ptr + row),
                    uniform, v, width, HAS_BIAS, ACC)  # fmt: skip


cdiv = triton.cdiv
