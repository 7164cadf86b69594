"""The Triton kernels of :mod:`heads.kernels.triton_gemm` (imported only from there, on first
use: importing this module imports Triton).

The tile's logits are column blocks of ``BLOCK_N`` (the forward's output tiles); block ``b`` of
row ``r`` is stored as ``u = exp(z - m_rb)``, its maximum ``m_rb`` and sum ``s_rb`` beside it.
``p = exp(m_rb - lse_r) u``, so the gradient products' prologues form
``dz = scale p - onehot [x = t] - uniform`` with one ``exp`` a row and block, none a logit
(:func:`block_factor`, :func:`gradient_block`).
"""

import triton
import triton.language as tl

from heads.kernels.triton_rows_kernels import merge_statistics


@triton.jit
def _grouped(pid, blocks_m, blocks_n, GROUP_M: tl.constexpr):
    """Output tile ``(m, n)`` of program ``pid``, ``GROUP_M`` row blocks at a time: programs
    running together share their rows' and their columns' operands in L2."""
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def logits_blocks(h_ptr, w_ptr, bias_ptr, target_ptr, u_ptr, top_ptr, sum_ptr, picked_ptr,
                  logit_sum_ptr, rows, v, width, d, stride_h, stride_w, stride_u, blocks,
                  HAS_BIAS: tl.constexpr, HAS_SUM: tl.constexpr, ACC: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr):  # fmt: skip
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``z = h W^T + b`` (float32 accumulation over ``d``)
    and, in the epilogue, its rows' block statistics: ``u = exp(z - m)`` stored in the
    products' dtype (0 past column ``v``), ``m`` and ``s = sum u`` (of ``u`` as stored: the
    probabilities the gradient uses sum to one) per row, the target's logit where it falls
    in this block, and (``HAS_SUM``) the block's sum of logits."""
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(rows, BLOCK_M), blocks, GROUP_M)
    rows_ = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    in_rows, in_width = rows_ < rows, cols < width
    h_rows = h_ptr + rows_.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], ACC)
    for k in range(0, d, BLOCK_K):
        inside = k + ks < d
        a = tl.load(h_rows + (k + ks)[None, :], mask=in_rows[:, None] & inside[None, :], other=0.0)
        b = tl.load(w_rows + (k + ks)[None, :], mask=in_width[:, None] & inside[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    if HAS_BIAS:  # the bias padded to the width by the wrapper
        acc += tl.load(bias_ptr + cols, mask=in_width, other=0.0).to(ACC)[None, :]
    real = cols < v
    x = tl.where(real[None, :], acc, float("-inf"))
    t = tl.load(target_ptr + rows_, mask=in_rows, other=-1)
    hit = cols[None, :] == t[:, None]
    here = (t >= pid_n * BLOCK_N) & (t < pid_n * BLOCK_N + BLOCK_N) & (t < v) & in_rows
    tl.store(picked_ptr + rows_, tl.sum(tl.where(hit, x, 0.0), 1), mask=here)
    top = tl.max(x, 1)
    shift = tl.where(top == float("-inf"), 0.0, top)  # a block of -inf: u 0, sum 0
    u = tl.exp(x - shift[:, None]).to(u_ptr.dtype.element_ty)
    u_rows = u_ptr + rows_.to(tl.int64)[:, None] * stride_u
    tl.store(u_rows + cols[None, :], u, mask=in_rows[:, None] & in_width[None, :])
    at = rows_.to(tl.int64) * blocks + pid_n
    tl.store(top_ptr + at, top, mask=in_rows)
    tl.store(sum_ptr + at, tl.sum(u.to(ACC), 1), mask=in_rows)
    if HAS_SUM:
        tl.store(logit_sum_ptr + at, tl.sum(tl.where(real[None, :], x, 0.0), 1), mask=in_rows)


@triton.jit
def rows_statistics(top, s):
    """Blocks' ``(m, s)`` ``[rows, n]`` as one ``(m, s)`` per row (0 from a block of ``-inf``)."""
    high = tl.max(top, 1)
    shift = tl.where(high == float("-inf"), 0.0, high)
    return high, tl.sum(tl.where(top == float("-inf"), 0.0, s * tl.exp(top - shift[:, None])), 1)


@triton.jit
def merge_blocks(top_ptr, sum_ptr, logit_sum_ptr, lse_ptr, total_ptr, rows, blocks,
                 HAS_SUM: tl.constexpr, ACC: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_B: tl.constexpr):  # fmt: skip
    """Per row: ``lse = log sum_b s_b exp(m_b)`` over its blocks' statistics, read once and
    merged ``BLOCK_B`` blocks at a time (``-inf`` for a row of ``-inf``), and (``HAS_SUM``)
    the sum of its blocks' logit sums."""
    rows_ = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows_ < rows
    base = rows_.to(tl.int64)[:, None] * blocks
    high = tl.full([BLOCK_M], float("-inf"), ACC)
    total = tl.zeros([BLOCK_M], ACC)
    logits = tl.zeros([BLOCK_M], ACC)
    for b in range(0, blocks, BLOCK_B):
        bs = b + tl.arange(0, BLOCK_B)
        inside = in_rows[:, None] & (bs < blocks)[None, :]
        top = tl.load(top_ptr + base + bs[None, :], mask=inside, other=float("-inf"))
        s = tl.load(sum_ptr + base + bs[None, :], mask=inside, other=0.0)
        high, total = merge_statistics(high, total, *rows_statistics(top, s))
        if HAS_SUM:
            logits += tl.sum(tl.load(logit_sum_ptr + base + bs[None, :], mask=inside, other=0.0), 1)
    shift = tl.where(high == float("-inf"), 0.0, high)
    tl.store(lse_ptr + rows_, shift + tl.log(total), mask=in_rows)
    if HAS_SUM:
        tl.store(total_ptr + rows_, logits, mask=in_rows)


@triton.jit
def block_factor(top_ptr, rows_, in_rows, block, blocks, lse, scale):
    """Per row, ``scale exp(m_b - lse)``: block ``b``'s ``u`` times it is ``scale p`` (0 for a
    row or block of ``-inf``)."""
    top = tl.load(top_ptr + rows_.to(tl.int64) * blocks + block, mask=in_rows, other=float("-inf"))
    live = (top != float("-inf")) & (lse != float("-inf"))
    return tl.where(live, scale * tl.exp(top - tl.where(live, lse, 0.0)), 0.0)


@triton.jit
def gradient_block(u, cols, v, t, factor, onehot, uniform, ACC: tl.constexpr):
    """``dz = factor u - onehot [x = t] - uniform`` over ``[rows, cols]`` (0 from column
    ``v`` on), in ``u``'s dtype for the products."""
    return _dz(factor[:, None] * u.to(ACC), cols, v, t, onehot, uniform).to(u.dtype)


@triton.jit
def _dz(scaled, cols, v, t, onehot, uniform):
    """``dz = scaled - onehot [x = t] - uniform`` (``scaled``: ``scale p``), 0 from ``v`` on."""
    dz = scaled - tl.where(cols[None, :] == t[:, None], onehot[:, None], 0.0)
    return tl.where(cols[None, :] < v, dz - uniform[:, None], 0.0)


@triton.jit
def _row_terms(target_ptr, lse_ptr, scale_ptr, onehot_ptr, uniform_ptr, rows_, in_rows,
               HAS_UNIFORM: tl.constexpr):  # fmt: skip
    """A block of rows' target and coefficients (0 past the last row: no gradient there)."""
    t = tl.load(target_ptr + rows_, mask=in_rows, other=-1)
    lse = tl.load(lse_ptr + rows_, mask=in_rows, other=0.0)
    scale = tl.load(scale_ptr + rows_, mask=in_rows, other=0.0)
    onehot = tl.load(onehot_ptr + rows_, mask=in_rows, other=0.0)
    uniform = tl.zeros_like(onehot)
    if HAS_UNIFORM:
        uniform = tl.load(uniform_ptr + rows_, mask=in_rows, other=0.0)
    return t, lse, scale, onehot, uniform


@triton.jit
def gradient_hidden(u_ptr, top_ptr, target_ptr, lse_ptr, scale_ptr, onehot_ptr, uniform_ptr,
                    w_ptr, out_ptr, rows, v, width, d, stride_u, stride_w, stride_out,
                    stride_split, blocks, steps, steps_per_split, HAS_UNIFORM: tl.constexpr,
                    ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """``dh = dz W`` for one ``[BLOCK_M, BLOCK_D]`` tile, ``BLOCK_K`` columns a step (within
    one of the forward's ``BLOCK_N``-column blocks), over the steps of one split
    (``program_id(1)``; the wrapper adds the splits up): ``dz`` formed step by step from ``u``
    in the prologue."""
    blocks_d = tl.cdiv(d, BLOCK_D)
    pid_m, pid_d = tl.program_id(0) // blocks_d, tl.program_id(0) % blocks_d
    rows_ = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ds = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    in_rows = rows_ < rows
    t, lse, scale, onehot, uniform = _row_terms(
        target_ptr, lse_ptr, scale_ptr, onehot_ptr, uniform_ptr, rows_, in_rows, HAS_UNIFORM
    )
    u_rows = u_ptr + rows_.to(tl.int64)[:, None] * stride_u
    acc = tl.zeros([BLOCK_M, BLOCK_D], ACC)
    first = tl.program_id(1) * steps_per_split
    for step in range(first, tl.minimum(first + steps_per_split, steps)):
        cols = step * BLOCK_K + tl.arange(0, BLOCK_K)
        u = tl.load(u_rows + cols[None, :], mask=in_rows[:, None] & (cols < width)[None, :],
                    other=0.0)  # fmt: skip
        block = (step * BLOCK_K) // BLOCK_N
        factor = block_factor(top_ptr, rows_, in_rows, block, blocks, lse, scale)
        dz = gradient_block(u, cols, v, t, factor, onehot, uniform, ACC)
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * stride_w + ds[None, :],
                    mask=(cols < width)[:, None] & (ds < d)[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(dz, w, acc)
    out = out_ptr + tl.program_id(1) * stride_split + rows_.to(tl.int64)[:, None] * stride_out
    tl.store(out + ds[None, :], acc, mask=in_rows[:, None] & (ds < d)[None, :])


@triton.jit
def gradient_weight(u_ptr, top_ptr, target_ptr, lse_ptr, scale_ptr, onehot_ptr, uniform_ptr,
                    h_ptr, dw_ptr, db_ptr, rows, v, width, d, stride_u, stride_h, stride_dw,
                    blocks, HAS_UNIFORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ACCUMULATE: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_D: tl.constexpr):  # fmt: skip
    """``dW (+)= dz^T h`` for one ``[BLOCK_C, BLOCK_D]`` tile (its columns within one of the
    forward's ``BLOCK_N``-column blocks, or whole ones of them) over every row, ``BLOCK_R`` a
    step, ``dz`` formed from ``u`` in the prologue; the first ``d`` block also ``db (+)=
    sum_rows dz`` (of ``dz`` as the products take it)."""
    blocks_d = tl.cdiv(d, BLOCK_D)
    tile, pid_d = tl.program_id(0) // blocks_d, tl.program_id(0) % blocks_d
    cols = tile * BLOCK_C + tl.arange(0, BLOCK_C)
    block = (tile * BLOCK_C) // BLOCK_N
    ds = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    in_width = cols < width
    acc = tl.zeros([BLOCK_C, BLOCK_D], ACC)
    bias_acc = tl.zeros([BLOCK_C], ACC)
    for r in range(0, rows, BLOCK_R):
        rows_ = r + tl.arange(0, BLOCK_R)
        in_rows = rows_ < rows
        t, lse, scale, onehot, uniform = _row_terms(
            target_ptr, lse_ptr, scale_ptr, onehot_ptr, uniform_ptr, rows_, in_rows, HAS_UNIFORM
        )
        u = tl.load(u_ptr + rows_.to(tl.int64)[:, None] * stride_u + cols[None, :],
                    mask=in_rows[:, None] & in_width[None, :], other=0.0)  # fmt: skip
        if BLOCK_C > BLOCK_N:  # several blocks: each's factor over its columns (a block's
            # statistics are narrower than a tile that feeds the products well)
            scaled = tl.zeros([BLOCK_R, BLOCK_C], ACC)
            wide = u.to(ACC)
            for b in tl.static_range(BLOCK_C // BLOCK_N):
                # C's last tile may end inside its blocks: no statistics past them
                real = in_rows & (rows_ * 0 + block + b < blocks)
                factor = block_factor(top_ptr, rows_, real, block + b, blocks, lse, scale)
                mine = (tl.arange(0, BLOCK_C) // BLOCK_N == b)[None, :]
                scaled = tl.where(mine, factor[:, None] * wide, scaled)
            dz = _dz(scaled, cols, v, t, onehot, uniform).to(u.dtype)
        else:
            factor = block_factor(top_ptr, rows_, in_rows, block, blocks, lse, scale)
            dz = gradient_block(u, cols, v, t, factor, onehot, uniform, ACC)
        h = tl.load(h_ptr + rows_.to(tl.int64)[:, None] * stride_h + ds[None, :],
                    mask=in_rows[:, None] & (ds < d)[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(tl.trans(dz), h, acc)
        if HAS_BIAS:
            bias_acc += tl.sum(dz.to(ACC), 0)
    at = dw_ptr + cols.to(tl.int64)[:, None] * stride_dw + ds[None, :]
    inside = in_width[:, None] & (ds < d)[None, :]
    if ACCUMULATE:
        acc += tl.load(at, mask=inside, other=0.0)
    tl.store(at, acc, mask=inside)
    if HAS_BIAS:
        if pid_d == 0:
            if ACCUMULATE:
                bias_acc += tl.load(db_ptr + cols, mask=in_width, other=0.0)
            tl.store(db_ptr + cols, bias_acc, mask=in_width)
