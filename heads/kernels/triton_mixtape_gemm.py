"""Mixtape's frequent block as fused products (CUDA, with Triton installed; ``loss_backend:
fused``, without label smoothing): the rows plan's tile of :mod:`heads.kernels.mixtape_rows`
with no pass between its products.

The cuBLAS tile writes the ``K`` component logits and ``K - 1`` gate pre-activations of
every token and frequent column (14 bytes at K = 4, bf16), reads them in a statistics pass
and again in a gradient pass that writes their gradients over them, which the four gradient
products read: about 84 bytes a token and column. Here one kernel
(:func:`frequent_blocks`) runs the gate and component products of a tile of tokens and
columns and, in its epilogue, the sigmoid tree, the gated logit and the block's statistics
(as :func:`heads.kernels.triton_gemm.logits_blocks` keeps them); it stores the gradient
planes up to a factor per row and block, ``U_k = pi_k e`` and ``G_j = pi_j (left_j -
right_j) gamma_j (1 - gamma_j) e`` with ``e = exp(z - m)``. Each plane is then one
product's ``u`` for :func:`heads.kernels.triton_gemm.gradients`: ``dz = c u - onehot'
[x = t]`` with ``c = scale exp(m - lse)`` formed in the gradient products' prologues, where
``onehot'`` is the row's one-hot weight times the plane's coefficient at the target's
column (kept per row). 14 bytes written, each read twice: 42 a token and column, and no
kernel between the products. The bias's gradient comes out of the component planes' ``dW``
products: ``sum_k dz pi_k = dz``.

Label smoothing's uniform term needs ``pi_k`` at every column, which the planes do not
keep: with it, or at K = 8 (:data:`FUSED_COMPONENTS`), the cuBLAS tile runs.
``TRITON_INTERPRET=1`` runs the kernel on a CPU (the tests' float64 references).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from heads.kernels import triton_gemm
from heads.kernels.sigmoid_tree import level_widths
from heads.kernels.triton_gemm import Blocks, gradients, merge_blocks, statistics_type
from heads.kernels.triton_rows import bias_to_width


@dataclass(frozen=True)
class FrequentLaunch:
    """:func:`frequent_blocks`'s tiles: ``block_m`` tokens by ``block_n`` columns (the
    statistics' blocks), ``block_k`` of ``d`` and ``block_e`` of the gate inputs a step. A
    program holds about ``2K`` float32 tiles at once (the gates, the tree's differences, a
    pair of components' logits): at K = 4 and 8 warps (Triton 3.9, sm_90) 64 x 32 takes 143
    registers with no spill (its 32-byte stack frame: the gate noise's ``cos`` range
    reduction, never run for arguments in ``[0, 2 pi)``); 64 x 64 spills at 255, and 16 warps
    cap it at 128 registers, spilling too."""

    block_m: int = 64
    block_n: int = 32
    block_k: int = 64
    block_e: int = 32
    group_m: int = 8
    warps: int = 8
    stages: int = 3


FREQUENT_LAUNCH = FrequentLaunch()
# the K the heads run this way: at K = 8 the kernel's 15 tiles spill (16 bytes at 255
# registers), and the cuBLAS tile runs
FUSED_COMPONENTS = (2, 4)
# the gate planes' dz g products: the gate inputs are d2 + K wide, rounded up to 8 (72 at
# d2 = 64, K = 4): output tiles this wide, not the components' (GEMM_LAUNCH's)
GATE_BLOCK_D = 128


def _plane_launches() -> tuple:
    """The gradient products' tiles for the component and the gate planes: the fused
    products' (``triton_gemm.GEMM_LAUNCH``) over this kernel's blocks of ``block_n``."""
    base, block_n = triton_gemm.GEMM_LAUNCH, FREQUENT_LAUNCH.block_n
    # dz^T h's column tiles: whole blocks of this kernel's, as wide as the fused products'
    column_tile = max(block_n, base.weight_block_c // block_n * block_n)
    values = dataclasses.replace(base, block_n=block_n, hidden_step=min(base.hidden_step, block_n),
                                 weight_block_c=column_tile)  # fmt: skip
    return values, dataclasses.replace(values, hidden_block_d=min(base.hidden_block_d,
                                                                  GATE_BLOCK_D))  # fmt: skip


@functools.cache
def _kernels():
    """The kernel's module, imported on first use (CPU installs have no Triton)."""
    from heads.kernels import triton_mixtape_gemm_kernels

    return triton_mixtape_gemm_kernels


class FrequentBlocks(NamedTuple):
    """A tile's frequent block as :func:`frequent_blocks` keeps it: the planes ``U [R K, C]``
    and ``G [R (K-1), C]``, the blocks' maxima ``top [R, C / block_n]``; per token the
    block's log-sum-exp and target logit (0 where the target is not in the block), and
    ``pi_k`` ``[R, K]`` and the gates' coefficients ``[R, K-1]`` at the target's column."""

    values: torch.Tensor
    gates: torch.Tensor
    top: torch.Tensor
    lse: torch.Tensor
    picked: torch.Tensor
    pick_values: torch.Tensor
    pick_gates: torch.Tensor


def frequent_blocks(
    h: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    gw: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    s: int,
    seed: torch.Tensor | None = None,
    noise_std: float = 0.0,
    row0: int = 0,
    acc: torch.dtype = torch.float32,
) -> FrequentBlocks:
    """The frequent block of a tile of ``R = target.size(0)`` tokens: contexts ``h [R K, d]``
    (token-major), ``w [C, d]`` (``C >= s``: the ``s`` frequent tokens, then zero rows), gate
    inputs ``g [R (K-1), e]`` and gate weights ``gw [C, e]``, the bias ``[s]`` or None,
    targets ``[R]`` (outside ``[0, s)``: none here). Gate noise ``noise_std N(0, 1)`` from
    ``seed`` (``[1]`` int64) for the tile's rows from ``row0`` on, as the cuBLAS tile's
    kernels draw it. Statistics in ``acc``."""
    launch = FREQUENT_LAUNCH
    rows = target.size(0)
    k, width = h.size(0) // max(rows, 1), w.size(0)
    d, e = h.size(1), g.size(1)
    layout = (h.shape == (rows * k, d) and g.shape == (rows * (k - 1), e)
              and w.shape == (width, d) and gw.shape == (width, e) and width >= s)  # fmt: skip
    unit = all(x.stride(1) == 1 for x in (h, w, g, gw))
    if rows and not (layout and unit and k >= 2 and not k & (k - 1)):
        raise ValueError(f"expected h [R K, d], w [C, d], g [R (K-1), e], gw [C, e] with unit "
                         f"column strides, K a power of two >= 2, R = {rows}: got "
                         f"{tuple(h.shape)}, {tuple(w.shape)}, {tuple(g.shape)}, "
                         f"{tuple(gw.shape)}")  # fmt: skip
    blocks = -(-width // launch.block_n)
    values, gates = h.new_empty(rows * k, width), h.new_empty(rows * (k - 1), width)
    top, sums = h.new_empty(rows, blocks, dtype=acc), h.new_empty(rows, blocks, dtype=acc)
    lse, picked = h.new_empty(rows, dtype=acc), h.new_zeros(rows, dtype=acc)
    pick_values = h.new_zeros(rows, k, dtype=acc)
    pick_gates = h.new_zeros(rows, k - 1, dtype=acc)
    bias = bias_to_width(bias, width)
    if rows:
        mixtape, types = _kernels(), statistics_type(acc)
        noisy = seed is not None and noise_std > 0
        grid = (-(-rows // launch.block_m) * blocks,)
        mixtape.frequent_blocks[grid](
            h, w, g, gw, top if bias is None else bias, target, seed if noisy else target,
            values, gates, top, sums, picked, pick_values, pick_gates, rows, s, width, d, e,
            h.stride(0), w.stride(0), g.stride(0), gw.stride(0), values.stride(0),
            gates.stride(0), blocks, float(noise_std), row0, K=k, LEVELS=len(level_widths(k)),
            HAS_BIAS=bias is not None, HAS_NOISE=noisy, ACC=types, BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, BLOCK_E=launch.block_e,
            GROUP_M=launch.group_m, num_warps=launch.warps, num_stages=launch.stages,
        )  # fmt: skip
        merge_blocks(top, sums, lse)
    return FrequentBlocks(values, gates, top, lse, picked, pick_values, pick_gates)


@dataclass
class FrequentGradients:
    """Where :func:`frequent_gradients` puts the products' gradients (None: not wanted), in
    the statistics' dtype: the contexts' ``[R K, d]`` and the gate inputs' ``[R (K-1), e]``
    (written), ``W``'s ``[C, d]``, the bias's ``[C]`` and the gate weights' ``[C, e]``
    (added to where ``accumulate``)."""

    h: torch.Tensor | None = None
    g: torch.Tensor | None = None
    w: torch.Tensor | None = None
    b: torch.Tensor | None = None
    gw: torch.Tensor | None = None


def frequent_gradients(
    blocks: FrequentBlocks,
    h: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    gw: torch.Tensor,
    target: torch.Tensor,
    s: int,
    lse: torch.Tensor,
    scale: torch.Tensor,
    onehot: torch.Tensor,
    out: FrequentGradients,
    accumulate: bool,
) -> None:
    """With ``dz = scale p - onehot [x = t]`` per token over the frequent columns (``p =
    exp(z - lse)``, ``lse`` the token's over the whole softmax): each plane's two products
    (module docstring) into ``out``."""
    rows = target.size(0)
    if not rows:
        return
    k, width = blocks.values.size(0) // rows, w.size(0)
    d, e = h.size(1), g.size(1)
    value_launch, gate_launch = _plane_launches()
    planes = (
        (blocks.values, h, w, blocks.pick_values, k, out.h, out.w, out.b, d, value_launch),
        (blocks.gates, g, gw, blocks.pick_gates, k - 1, out.g, out.gw, None, e, gate_launch),
    )
    for plane, inputs, weight, picks, count, dh, dw, db, depth, launch in planes:
        if dh is None and dw is None and db is None:
            continue
        for i in range(count):
            u = plane.view(rows, count, width)[:, i]
            dh_i = None if dh is None else dh.view(rows, count, depth)[:, i]
            gradients(Blocks(u, blocks.top, lse, blocks.picked, None),
                      inputs.view(rows, count, depth)[:, i], weight, target, s, scale,
                      onehot * picks[:, i], None, dh_i, dw, db, accumulate or i > 0,
                      launch=launch)  # fmt: skip
