"""The Triton kernels of :mod:`heads.kernels.triton_mixtape` (imported only from there, on first
use: importing this module imports Triton).

A program reads one row's frequent block a block of columns at a time: the ``K`` component
logits ``h_{c,k} . w_x`` and the ``K - 1`` gate pre-activations of the sigmoid tree's nodes
(heap order: node j's children are 2j+1 and 2j+2), each a ``[BLOCK]`` vector of the same
layout, held in tuples (``tl.static_range`` unrolls the tree, node by node): top down for
the leaves' priors ``pi_k`` (Eq. 3), whose sum with the component logits is the gated logit
(Eq. 2); bottom up, in the gradient, for each node's ``left - right`` and prior (the sum of
its leaves'). A column's whole tree is one thread's: no value crosses threads in the loop (no
layout conversion, no barrier), and the loads are masked by the products' padded width
(16-byte loads where the columns a thread holds make 16 bytes).

Gate noise is drawn inside the kernels, ``tl.randn`` keyed by the row (``seed + row``) at
offset ``node S + column``: the gradient draws what the statistics drew, and no noise tensor
is written or read.
"""

import triton
import triton.language as tl

from heads.kernels import triton_rows_kernels
from heads.kernels.triton_rows_kernels import merge_statistics, row_lse, softmax_gradient

# the statistics' dtype for each accumulation dtype (the rows kernels' table)
ACC = triton_rows_kernels.ACC


@triton.jit
def _tree(pre_row, stride_p, seed, cols, mask, s, noise_std, LEVELS: tl.constexpr,
          HAS_NOISE: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``(gates, priors)``: the nodes' sigmoids in heap order (Eq. 4, the pre-activations'
    noise drawn at offset ``node S + column``) and the leaves' priors, top down: a node
    passes ``gamma`` of its prior to its left child and ``1 - gamma`` to its right (Eq. 3)."""
    gates = ()
    priors = (tl.full([BLOCK], 1.0, ACC),)
    for level in tl.static_range(LEVELS):
        below = ()
        for i in tl.static_range(1 << level):
            node = (1 << level) - 1 + i
            pre = tl.load(pre_row + node * stride_p + cols, mask=mask, other=0.0).to(ACC)
            if HAS_NOISE:
                pre += noise_std * tl.randn(seed, node * s + cols).to(ACC)
            gamma = tl.sigmoid(pre)
            gates = gates + (gamma,)
            below = below + (priors[i] * gamma, priors[i] * (1 - gamma))
        priors = below
    return gates, priors


@triton.jit
def _logits(values_row, pre_row, bias_ptr, seed, cols, mask, s, stride_v, stride_p,
            noise_std, K: tl.constexpr, LEVELS: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_NOISE: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``(z, gates, priors, values)``: Eq. 2's gated logits plus the bias, ``-inf`` outside
    the block's ``s`` columns (``mask``: the loads', ``cols < width``; the bias padded to
    ``width``), and the tree's and components' tuples."""
    gates, priors = _tree(pre_row, stride_p, seed, cols, mask, s, noise_std, LEVELS, HAS_NOISE,
                          ACC, BLOCK)  # fmt: skip
    values = ()
    z = tl.zeros([BLOCK], ACC)
    for k in tl.static_range(K):
        value = tl.load(values_row + k * stride_v + cols, mask=mask, other=0.0).to(ACC)
        values = values + (value,)
        z += priors[k] * value
    if HAS_BIAS:
        z += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(ACC)
    return tl.where(cols < s, z, float("-inf")), gates, priors, values


@triton.jit(do_not_specialize=["row0"])
def frequent_statistics(values_ptr, pre_ptr, bias_ptr, target_ptr, seed_ptr, lse_ptr, picked_ptr,
               sum_ptr, s, width, stride_v, stride_p, noise_std, row0, K: tl.constexpr,
               LEVELS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NOISE: tl.constexpr,
               HAS_SUM: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Per row: the online log-sum-exp of the gated logits, kept per lane (a column of the
    block: one ``exp`` a logit), the target's logit (0 outside ``[0, s)``) and,
    ``HAS_SUM``, their sum."""
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
        z, _, _, _ = _logits(values_row, pre_row, bias_ptr, seed, cols, cols < width, s,
                             stride_v, stride_p, noise_std, K, LEVELS, HAS_BIAS, HAS_NOISE, ACC,
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
def frequent_gradient(values_ptr, pre_ptr, bias_ptr, target_ptr, seed_ptr, lse_ptr, scale_ptr,
             onehot_ptr, uniform_ptr, s, width, stride_v, stride_p, noise_std, row0,
             K: tl.constexpr, LEVELS: tl.constexpr, HAS_BIAS: tl.constexpr,
             HAS_NOISE: tl.constexpr, HAS_UNIFORM: tl.constexpr, ACC: tl.constexpr,
             BLOCK: tl.constexpr):  # fmt: skip
    """In place, per row and block of columns: ``dz = scale p - onehot [x = t] - uniform``,
    then the component logits' gradients ``dz pi_k`` over the component logits and the
    pre-activations' ``dz pi_node (left - right) gamma (1 - gamma)`` over the
    pre-activations (a node's ``left``/``right``: its children's values, Eq. 3); 0 over
    the padding, ``[s, width)``. Every load precedes the first store."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    values_row = values_ptr + (row * K).to(tl.int64) * stride_v
    pre_row = pre_ptr + (row * (K - 1)).to(tl.int64) * stride_p
    seed = tl.load(seed_ptr) + row0 + row
    z, gates, priors, values = _logits(values_row, pre_row, bias_ptr, seed, cols, mask, s,
                                       stride_v, stride_p, noise_std, K, LEVELS, HAS_BIAS,
                                       HAS_NOISE, ACC, BLOCK)  # fmt: skip
    uniform = 0.0
    if HAS_UNIFORM:
        uniform = tl.load(uniform_ptr + row)
    dz = softmax_gradient(z, cols, tl.load(target_ptr + row), tl.load(lse_ptr + row),
                          tl.load(scale_ptr + row), tl.load(onehot_ptr + row), uniform)  # fmt: skip
    dz = tl.where(cols < s, dz, 0.0)
    for k in tl.static_range(K):
        tl.store(values_row + k * stride_v + cols, (dz * priors[k]).to(values_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip
    # bottom up: a level's node values and priors from its children's
    for level in tl.static_range(LEVELS - 1, -1, -1):
        above_values = ()
        above_priors = ()
        for i in tl.static_range(1 << level):
            node = (1 << level) - 1 + i
            left, right = values[2 * i], values[2 * i + 1]
            prior = priors[2 * i] + priors[2 * i + 1]
            gamma, diff = gates[(1 << level) - 1 + i], left - right  # (node: not a constexpr)
            grad_pre = dz * prior * diff * gamma * (1 - gamma)
            tl.store(pre_row + node * stride_p + cols, grad_pre.to(pre_ptr.dtype.element_ty),
                     mask=mask)  # fmt: skip
            above_values = above_values + (right + gamma * diff,)
            above_priors = above_priors + (prior,)
        values, priors = above_values, above_priors


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
