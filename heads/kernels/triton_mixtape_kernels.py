"""The Triton kernels of :mod:`heads.kernels.triton_mixtape` (imported only from there, on first
use: importing this module imports Triton).

A program reads one row's frequent block a block of columns at a time: the ``K`` component
logits ``h_{c,k} . w_x`` ``[K, BLOCK]`` and, level by level, the gate pre-activations of the
sigmoid tree's nodes (heap order: node j's children are 2j+1 and 2j+2). The tree is walked
on whole levels, ``[nodes, BLOCK]`` at a time (``tl.static_range`` unrolls the levels, so each
has its own shape): top down for the leaves' priors ``pi_k`` (Eq. 3), whose sum with the
component logits is the gated logit (Eq. 2); bottom up, in the gradient, for each node's
``left - right`` and prior (the sum of its leaves').

Gate noise is drawn inside the kernels, ``tl.randn`` keyed by the row (``seed + row``) at
offset ``node S + column``: the gradient draws what the statistics drew, and no noise tensor
is written or read.
"""

import triton
import triton.language as tl

from heads.kernels import triton_rows_kernels
from heads.kernels.triton_rows_kernels import merge_statistics, row_lse

# the statistics' dtype for each accumulation dtype (the rows kernels' table)
ACC = triton_rows_kernels.ACC


@triton.jit
def _split(x, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """``[2 HALF, BLOCK]`` rows -> ``(even rows, odd rows)``: each node's left and right child."""
    return tl.split(tl.permute(tl.reshape(x, [HALF, 2, BLOCK]), (0, 2, 1)))


@triton.jit
def _gates(pre_row, stride_p, seed, cols, mask, s, noise_std, FIRST: tl.constexpr,
           NODES: tl.constexpr, HAS_NOISE: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """The sigmoids ``[NODES, BLOCK]`` of nodes ``FIRST .. FIRST + NODES - 1`` (Eq. 3-4),
    their pre-activations' noise drawn at offset ``node S + column`` (``mask``: the loads',
    the padded width's)."""
    nodes = FIRST + tl.arange(0, NODES)
    pre = tl.load(pre_row + nodes[:, None] * stride_p + cols[None, :], mask=mask[None, :],
                  other=0.0).to(ACC)  # fmt: skip
    if HAS_NOISE:
        pre += noise_std * tl.randn(seed, nodes[:, None] * s + cols[None, :]).to(ACC)
    return tl.sigmoid(pre)


@triton.jit
def _priors(pre_row, stride_p, seed, cols, mask, s, noise_std, K: tl.constexpr,
            LEVELS: tl.constexpr, HAS_NOISE: tl.constexpr, ACC: tl.constexpr,
            BLOCK: tl.constexpr):  # fmt: skip
    """The leaves' priors ``[K, BLOCK]``, top down: a node passes ``gamma`` of its prior to
    its left child and ``1 - gamma`` to its right (Eq. 3)."""
    priors = tl.full([1, BLOCK], 1.0, ACC)
    for level in tl.static_range(LEVELS):  # level with 2^level nodes, the first 2^level - 1
        gamma = _gates(pre_row, stride_p, seed, cols, mask, s, noise_std, (1 << level) - 1,
                       1 << level, HAS_NOISE, ACC)  # fmt: skip
        both = tl.join(priors * gamma, priors * (1 - gamma))  # [nodes, BLOCK, 2]
        priors = tl.reshape(tl.permute(both, (0, 2, 1)), [2 << level, BLOCK])
    return priors


@triton.jit
def _logits(values_row, pre_row, bias_ptr, seed, cols, mask, s, stride_v, stride_p,
            noise_std, K: tl.constexpr, LEVELS: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_NOISE: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``(z [BLOCK], priors [K, BLOCK], values [K, BLOCK])``: Eq. 2's gated logits plus the
    bias, ``-inf`` outside the block's ``s`` columns (``mask``: the loads', ``cols <
    width``; the bias padded to ``width``)."""
    priors = _priors(pre_row, stride_p, seed, cols, mask, s, noise_std, K, LEVELS, HAS_NOISE,
                     ACC, BLOCK)  # fmt: skip
    leaves = tl.arange(0, K)
    values = tl.load(values_row + leaves[:, None] * stride_v + cols[None, :],
                     mask=mask[None, :], other=0.0).to(ACC)  # fmt: skip
    z = tl.sum(priors * values, 0)
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(ACC)
    return tl.where(cols < s, z, float("-inf")), priors, values


@triton.jit(do_not_specialize=["row0"])
def statistics(values_ptr, pre_ptr, bias_ptr, target_ptr, seed_ptr, lse_ptr, picked_ptr,
               sum_ptr, s, width, stride_v, stride_p, noise_std, row0, K: tl.constexpr,
               LEVELS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NOISE: tl.constexpr,
               HAS_SUM: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Per row: the online log-sum-exp of the gated logits, kept per lane (a column of the
    block: one ``exp`` a logit, no barrier in the loop), the target's logit (0 outside
    ``[0, s)``) and, ``HAS_SUM``, their sum."""
    row = tl.program_id(0)
    values_row = values_ptr + (row * K).to(tl.int64) * stride_v
    pre_row = pre_ptr + (row * (K - 1)).to(tl.int64) * stride_p
    seed = tl.load(seed_ptr) + row0 + row
    t = tl.load(target_ptr + row)
    top = tl.full([BLOCK], float("-inf"), ACC)
    total = tl.zeros([BLOCK], ACC)
    picked = tl.zeros([BLOCK], ACC)
    logit_sum = tl.zeros([BLOCK], ACC)
    for start in range(0, s, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z, _, _ = _logits(values_row, pre_row, bias_ptr, seed, cols, cols < width, s, stride_v,
                          stride_p, noise_std, K, LEVELS, HAS_BIAS, HAS_NOISE, ACC,
                          BLOCK)  # fmt: skip
        top, total = merge_statistics(top, total, z, 1.0)  # a lane's one logit: sum exp(0)
        picked += tl.where((cols == t) & (cols < s), z, 0.0)
        if HAS_SUM:
            logit_sum += tl.where(cols < s, z, 0.0)
    tl.store(lse_ptr + row, row_lse(top, total))
    tl.store(picked_ptr + row, tl.sum(picked, 0))
    if HAS_SUM:
        tl.store(sum_ptr + row, tl.sum(logit_sum, 0))


@triton.jit(do_not_specialize=["row0"])
def gradient(values_ptr, pre_ptr, bias_ptr, target_ptr, seed_ptr, lse_ptr, scale_ptr,
             onehot_ptr, uniform_ptr, s, width, stride_v, stride_p, noise_std, row0,
             K: tl.constexpr, LEVELS: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_NOISE: tl.constexpr, HAS_UNIFORM: tl.constexpr, ACC: tl.constexpr,
             BLOCK: tl.constexpr):  # fmt: skip
    """In place, per row and block of columns: ``dz = scale p - onehot [x = t] - uniform``,
    then the component logits' gradients ``dz pi_k`` over the component logits and the
    pre-activations' ``dz pi_node (left - right) gamma (1 - gamma)`` over the
    pre-activations (a node's ``left``/``right``: its children's values, Eq. 3); 0 over
    the padding, ``[s, width)``."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    values_row = values_ptr + (row * K).to(tl.int64) * stride_v
    pre_row = pre_ptr + (row * (K - 1)).to(tl.int64) * stride_p
    seed = tl.load(seed_ptr) + row0 + row
    z, priors, values = _logits(values_row, pre_row, bias_ptr, seed, cols, mask, s, stride_v,
                                stride_p, noise_std, K, LEVELS, HAS_BIAS, HAS_NOISE, ACC,
                                BLOCK)  # fmt: skip
    lse = tl.load(lse_ptr + row)
    p = tl.where(lse == float("-inf"), 0.0, tl.exp(z - lse))  # a row of -inf: p = 0
    dz = tl.load(scale_ptr + row) * p - tl.where(cols == tl.load(target_ptr + row),
                                                 tl.load(onehot_ptr + row), 0.0)  # fmt: skip
    if HAS_UNIFORM:
        dz -= tl.load(uniform_ptr + row)
    dz = tl.where(cols < s, dz, 0.0)
    leaves = tl.arange(0, K)
    grad_values = (dz[None, :] * priors).to(values_ptr.dtype.element_ty)
    tl.store(values_row + leaves[:, None] * stride_v + cols[None, :], grad_values,
             mask=mask[None, :])  # fmt: skip
    # bottom up: a level's node values and priors from its children's
    nodes_values, nodes_priors = values, priors
    for up in tl.static_range(LEVELS):  # the level with K / 2^(up + 1) nodes
        left, right = _split(nodes_values, K >> (up + 1), BLOCK)
        left_prior, right_prior = _split(nodes_priors, K >> (up + 1), BLOCK)
        first = (K >> (up + 1)) - 1
        gamma = _gates(pre_row, stride_p, seed, cols, mask, s, noise_std, first, K >> (up + 1),
                       HAS_NOISE, ACC)  # fmt: skip
        diff = left - right
        nodes_priors = left_prior + right_prior
        grad_pre = dz[None, :] * nodes_priors * diff * gamma * (1 - gamma)
        nodes = first + tl.arange(0, K >> (up + 1))
        tl.store(pre_row + nodes[:, None] * stride_p + cols[None, :],
                 grad_pre.to(pre_ptr.dtype.element_ty), mask=mask[None, :])  # fmt: skip
        nodes_values = right + gamma * diff


@triton.jit(do_not_specialize=["row0"])
def gate_noise(out_ptr, seed_ptr, s, row0, K: tl.constexpr, BLOCK: tl.constexpr):
    """The gate noise the kernels draw, ``[rows (K - 1), s]`` (for the tests' references)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seed_ptr) + row0 + row
    for node in tl.static_range(K - 1):
        noise = tl.randn(seed, node * s + cols)
        tl.store(out_ptr + (row * (K - 1) + node).to(tl.int64) * s + cols, noise,
                 mask=cols < s)  # fmt: skip


cdiv = triton.cdiv
