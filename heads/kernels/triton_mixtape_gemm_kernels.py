"""The Triton kernel of :mod:`heads.kernels.triton_mixtape_gemm` (imported only from there, on
first use: importing this module imports Triton).

One program computes a ``[BLOCK_M tokens, BLOCK_N frequent columns]`` tile of Mixtape's
frequent block: the ``K - 1`` gate pre-activations and the ``K`` component logits as
products accumulated in float32 (the ``W`` tile loaded once a step for all ``K``
components), then, in the epilogue, the sigmoid tree (Eq. 3-4, gate noise drawn as
:mod:`heads.kernels.triton_mixtape_kernels` draws it), the gated logit (Eq. 2) and the
block's statistics, as :func:`heads.kernels.triton_gemm_kernels.logits_blocks` keeps them.
In place of the products' outputs it stores the gradient planes up to a factor per row and
block: ``U_k = pi_k e`` and ``G_j = pi_j (left_j - right_j) gamma_j (1 - gamma_j) e`` with
``e = exp(z - m)``, so that ``dL/d(h_k . w_x) = c U_k`` and ``dL/d pre_j = c G_j`` (``c =
scale exp(m - lse)``) off the target's column; there the one-hot term needs ``pi_k`` and
the gates' coefficient, kept per row.
"""

import triton
import triton.language as tl

from heads.kernels.triton_gemm_kernels import _grouped


@triton.jit
def _product(a_ptr, stride_a, a_rows, in_rows, w_rows, in_cols, depth, acc,
             BLOCK_K: tl.constexpr):  # fmt: skip
    """``acc + A W^T`` over ``depth``: ``A``'s rows at ``a_rows``, ``W``'s at ``w_rows``."""
    ks = tl.arange(0, BLOCK_K)
    for k in range(0, depth, BLOCK_K):
        inside = k + ks < depth
        a = tl.load(a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + (k + ks)[None, :],
                    mask=in_rows[:, None] & inside[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_rows + (k + ks)[None, :], mask=in_cols[:, None] & inside[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit(do_not_specialize=["row0"])  # a tile's first row: one compiled kernel for all
def frequent_blocks(h_ptr, w_ptr, g_ptr, gw_ptr, bias_ptr, target_ptr, seed_ptr, u_ptr,
                    gate_ptr, top_ptr, sum_ptr, picked_ptr, pick_u_ptr, pick_g_ptr, rows, s,
                    width, d, e, stride_h, stride_w, stride_g, stride_gw, stride_u, stride_gp,
                    blocks, noise_std, row0, K: tl.constexpr, LEVELS: tl.constexpr,
                    HAS_BIAS: tl.constexpr, HAS_NOISE: tl.constexpr, ACC: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_E: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    """One tile (module docstring): ``h [R K, d]`` (token r's component k at row ``r K + k``)
    against ``W [C, d]``; gate inputs ``g [R (K-1), e]`` against gate weights ``[C, e]``;
    ``U`` over ``[R K, C]`` and ``G`` over ``[R (K-1), C]`` in the products' dtype (0 from
    column ``s`` on), the block's maximum and sum of ``e`` per token, and where the token's
    target falls in the block: its logit, ``pi_k`` and the gates' coefficients."""
    pid_m, pid_n = _grouped(tl.program_id(0), tl.cdiv(rows, BLOCK_M), blocks, GROUP_M)
    tokens = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows, in_cols = tokens < rows, cols < width
    zero = tl.zeros([BLOCK_M, BLOCK_N], ACC)
    # Eq. 4: the gates, heap order
    gw_rows = gw_ptr + cols.to(tl.int64)[:, None] * stride_gw
    gates = ()
    if HAS_NOISE:
        seed = tl.load(seed_ptr) + row0 + tokens
    for node in tl.static_range(K - 1):
        pre = _product(g_ptr, stride_g, tokens * (K - 1) + node, in_rows, gw_rows, in_cols, e,
                       zero, BLOCK_E)  # fmt: skip
        if HAS_NOISE:  # the cuBLAS tile's kernels' draw: seed + row, offset node S + column
            pre += noise_std * tl.randn(seed[:, None], node * s + cols[None, :]).to(ACC)
        gates = gates + (tl.sigmoid(pre),)
    # Eq. 2-3 bottom up, the components' logits a pair at a time: a node's value is
    # right + gamma (left - right), and only its difference is kept (the gate's gradient):
    # the tree's K leaf priors never live at once
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    values = ()
    diffs = ()
    for i in tl.static_range(K // 2):
        left = _product(h_ptr, stride_h, tokens * K + 2 * i, in_rows, w_rows, in_cols, d, zero,
                        BLOCK_K)  # fmt: skip
        right = _product(h_ptr, stride_h, tokens * K + 2 * i + 1, in_rows, w_rows, in_cols, d,
                         zero, BLOCK_K)  # fmt: skip
        diff = left - right
        values = values + (right + gates[K // 2 - 1 + i] * diff,)
        diffs = diffs + (diff,)
    for level in tl.static_range(LEVELS - 2, -1, -1):
        above = ()
        level_diffs = ()
        for i in tl.static_range(1 << level):
            diff = values[2 * i] - values[2 * i + 1]
            above = above + (values[2 * i + 1] + gates[(1 << level) - 1 + i] * diff,)
            level_diffs = level_diffs + (diff,)
        values = above
        diffs = level_diffs + diffs  # heap order
    z = values[0]
    if HAS_BIAS:  # padded to the width by the wrapper
        z += tl.load(bias_ptr + cols, mask=in_cols, other=0.0).to(ACC)[None, :]
    real = cols < s
    z = tl.where(real[None, :], z, float("-inf"))
    top = tl.max(z, 1)
    shift = tl.where(top == float("-inf"), 0.0, top)  # a block of -inf: e 0, sum 0
    ex = tl.exp(z - shift[:, None])
    at = tokens.to(tl.int64) * blocks + pid_n
    tl.store(top_ptr + at, top, mask=in_rows)
    tl.store(sum_ptr + at, tl.sum(ex, 1), mask=in_rows)
    t = tl.load(target_ptr + tokens, mask=in_rows, other=-1)
    hit = (cols[None, :] == t[:, None]) & real[None, :]
    here = (t >= pid_n * BLOCK_N) & (t < pid_n * BLOCK_N + BLOCK_N) & (t < s) & in_rows
    tl.store(picked_ptr + tokens, tl.sum(tl.where(hit, z, 0.0), 1), mask=here)
    # top down: a node's prior (Eq. 3), its gate's coefficient and plane, the leaves' planes
    inside = in_rows[:, None] & in_cols[None, :]
    priors = (zero + 1.0,)
    for level in tl.static_range(LEVELS):
        below = ()
        for i in tl.static_range(1 << level):
            gamma = gates[(1 << level) - 1 + i]
            coefficient = priors[i] * diffs[(1 << level) - 1 + i] * gamma * (1 - gamma)
            node = tokens * (K - 1) + (1 << level) - 1 + i
            tl.store(gate_ptr + node.to(tl.int64)[:, None] * stride_gp + cols[None, :],
                     (coefficient * ex).to(gate_ptr.dtype.element_ty), mask=inside)  # fmt: skip
            tl.store(pick_g_ptr + node, tl.sum(tl.where(hit, coefficient, 0.0), 1), mask=here)
            left, right = priors[i] * gamma, priors[i] * (1 - gamma)
            if level == LEVELS - 1:  # the leaves' planes, stored as they come
                _leaf(u_ptr, pick_u_ptr, tokens * K + 2 * i, stride_u, cols, left, ex, hit,
                      inside, here)  # fmt: skip
                _leaf(u_ptr, pick_u_ptr, tokens * K + 2 * i + 1, stride_u, cols, right, ex, hit,
                      inside, here)  # fmt: skip
            else:
                below = below + (left, right)
        priors = below


@triton.jit
def _leaf(u_ptr, pick_ptr, rows, stride_u, cols, prior, ex, hit, inside, here):
    """A component's plane ``U_k = pi_k e`` at ``rows``, and ``pi_k`` at the target."""
    plane = u_ptr + rows.to(tl.int64)[:, None] * stride_u + cols[None, :]
    tl.store(plane, (prior * ex).to(u_ptr.dtype.element_ty), mask=inside)
    tl.store(pick_ptr + rows, tl.sum(tl.where(hit, prior, 0.0), 1), mask=here)
