"""Mixtape's frequent block (Eq. 2-4) in a row tile as two Triton kernels (CUDA, with Triton
installed; never needed on a CPU): the elementwise half of ``heads/kernels/mixtape_rows.py``'s
tile, between its products.

A tile's component logits ``h_{c,k} . w_x`` ``[R K, S]`` and gate pre-activations
``[R (K-1), S]`` come out of two products in the products' dtype (bf16 under autocast); then

- :func:`frequent_statistics` reads them once: per row the gated logits (the sigmoid tree of
  Eq. 3 over the gates, the mix of Eq. 2, the bias), their online log-sum-exp, the target's
  logit and, with label smoothing, their sum;
- :func:`frequent_gradient_` reads them once more and, given the row's log-sum-exp over the
  whole vocabulary, writes the gradients of the two products' outputs over them, in place:
  ``dz pi_k`` over the component logits, ``dz pi_node (left - right) gamma (1 - gamma)`` over
  the pre-activations, for the four gradient products.

So no ``[R, K, S]`` float32 tensor exists: the tile holds the products' outputs alone, each
read twice and written once, where the compiled column plan stored, recomputed and re-read
them block by block. Gate noise is drawn in the kernels from ``seed`` (a one-element int64
tensor, on the device: no host read), the same in both (``triton_mixtape_kernels``).
``TRITON_INTERPRET=1`` runs the kernels on a CPU (the tests' float64 references).

Why the tree is not in the gradient products' prologues, as the softmax's ``dz`` is
(``heads/kernels/triton_gemm.py``): a frequent column's gradient needs its whole tree (all K
component logits and K - 1 gates: 14 bytes in bf16 at K = 4) and costs ~4 exponentials and
~40 other operations, against the softmax's one exponential a row and block. A gradient
product's program covers one component and one slice of ``d``, so in its prologue the tree
would be rebuilt K x (d / tile) times (8 at K = 4, d = 512, 256-wide tiles): more time in the
exponential and ALU units than in the tensor cores. Here it is built twice in all, at about
84 bytes of traffic a token and frequent column (products' outputs written 14, read 14 by
each kernel, gradients written 14 and read 28 by the four products). The fused products
(``heads/kernels/triton_mixtape_gemm.py``, ``loss_backend: fused``) build it once, in their
forward's epilogue, and store planes that the gradient products only scale (42 bytes); these
kernels remain for label smoothing and K = 8.
"""

from __future__ import annotations

import functools

import torch

from heads.kernels.sigmoid_tree import level_widths
from heads.kernels.triton_rows import bias_to_width, triton_available

__all__ = ["frequent_gradient_", "frequent_statistics", "gate_noise", "triton_available"]

_WARPS = 8
# columns a thread holds of each of a block's 2K - 1 rows: K = 2, 8 (one 16-byte load a row);
# K = 4, 4; K >= 8, 1 (K = 8 at 2 spills); more would hold a thread's column trees in over
# 128 registers
COLUMNS_PER_THREAD = {2: 8, 4: 4}


@functools.cache
def _kernels():
    """The kernels' module, imported on first use (CPU installs have no Triton)."""
    from heads.kernels import triton_mixtape_kernels

    return triton_mixtape_kernels


def _block(k: int) -> int:
    """A program's columns a step: every thread's columns of each row."""
    return COLUMNS_PER_THREAD.get(k, 1) * 32 * _WARPS


def _check(values: torch.Tensor, pre: torch.Tensor, target: torch.Tensor, s: int) -> int:
    """K, after checking ``values [R K, >= s]`` and ``pre [R (K-1), >= s]`` (unit column
    strides, K a power of two >= 2) against ``target [R]``."""
    rows = target.size(0)
    k = values.size(0) // max(rows, 1)
    planes = values.dim() == pre.dim() == 2 and (values.size(0), pre.size(0)) == (
        rows * k, rows * (k - 1))  # fmt: skip
    columns = planes and min(values.size(1), pre.size(1)) >= s
    unit_stride = planes and values.stride(1) == pre.stride(1) == 1
    power_of_two = k >= 2 and not k & (k - 1)
    if rows and not (planes and columns and unit_stride and power_of_two):
        raise ValueError(
            f"expected values [R K, S] and gate pre-activations [R (K-1), S] with unit column "
            f"strides, K a power of two >= 2, for R = {rows} rows: got "
            f"{tuple(values.shape)} and {tuple(pre.shape)}"
        )
    return k


def _width(values: torch.Tensor, pre: torch.Tensor) -> int:
    """The columns the kernels read (the products' padded width: 16-byte loads)."""
    return min(values.size(1), pre.size(1))


def _common(values, pre, s: int, k: int, seed, noise_std: float, row0: int, acc):
    """The arguments both kernels take after their own pointers."""
    return dict(
        s=s, width=_width(values, pre), stride_v=values.stride(0), stride_p=pre.stride(0),
        noise_std=float(noise_std), row0=row0, K=k, LEVELS=len(level_widths(k)),
        HAS_NOISE=seed is not None and noise_std > 0, ACC=_kernels().ACC[acc], BLOCK=_block(k),
        num_warps=_WARPS,
    )  # fmt: skip


def frequent_statistics(
    values: torch.Tensor,
    pre: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    s: int,
    want_sum: bool,
    seed: torch.Tensor | None = None,
    noise_std: float = 0.0,
    row0: int = 0,
    acc: torch.dtype = torch.float32,
):
    """``(lse, z_target, sum_x z or None)`` per row (``acc``) of the gated logits over the
    first ``s`` columns: ``values`` ``[R K, >= s]`` (row-major by token, then component),
    ``pre`` ``[R (K-1), >= s]`` (gates in heap order), ``bias`` ``[s]`` or None, ``target``
    ``[R]`` (outside ``[0, s)``: z_target 0). Gate noise ``noise_std N(0, 1)`` from ``seed``
    (``[1]`` int64) for the tile's rows from ``row0`` on."""
    k = _check(values, pre, target, s)
    rows = target.size(0)
    bias = bias_to_width(bias, _width(values, pre))
    lse, picked = values.new_empty(rows, dtype=acc), values.new_empty(rows, dtype=acc)
    total = values.new_empty(rows, dtype=acc) if want_sum else lse
    if rows:
        _kernels().frequent_statistics[(rows,)](
            values, pre, lse if bias is None else bias, target, lse if seed is None else seed,
            lse, picked, total, HAS_BIAS=bias is not None, HAS_SUM=want_sum,
            **_common(values, pre, s, k, seed, noise_std, row0, acc),
        )  # fmt: skip
    return lse, picked, total if want_sum else None


def frequent_gradient_(
    values: torch.Tensor,
    pre: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    s: int,
    lse: torch.Tensor,
    scale: torch.Tensor,
    onehot: torch.Tensor,
    uniform: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    noise_std: float = 0.0,
    row0: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place over the first ``s`` columns, with ``dz = scale p - onehot [x = t] -
    uniform`` (``p = exp(z - lse)``, ``lse`` the row's over the whole softmax): ``values``
    becomes ``dL/d(h_k . w_x) = dz pi_k`` and ``pre`` ``dL/d pre``, 0 over the columns from
    ``s`` on both have (the products' padding: read and written with the rest, in 16-byte
    accesses); returns both. The noise arguments as :func:`frequent_statistics` was given
    them."""
    k = _check(values, pre, target, s)
    rows = target.size(0)
    bias = bias_to_width(bias, _width(values, pre))
    if rows:
        kernels = _kernels()
        kernels.frequent_gradient[(rows, kernels.cdiv(_width(values, pre), _block(k)))](
            values, pre, lse if bias is None else bias, target, lse if seed is None else seed,
            lse, scale, onehot, lse if uniform is None else uniform, HAS_BIAS=bias is not None,
            HAS_UNIFORM=uniform is not None,
            **_common(values, pre, s, k, seed, noise_std, row0, lse.dtype),
        )  # fmt: skip
    return values, pre


def gate_noise(seed: torch.Tensor, rows: int, k: int, s: int, row0: int = 0) -> torch.Tensor:
    """The standard normal noise the kernels add to rows ``row0 ..`` of a tile's gate
    pre-activations, ``[rows, K-1, s]`` float32 (the tests' references draw it here)."""
    out = seed.new_empty(rows, k - 1, s, dtype=torch.float32)
    if rows and s:
        kernels = _kernels()
        block = _block(k)
        kernels.gate_noise[(rows, kernels.cdiv(s, block))](out, seed, s, row0, K=k, BLOCK=block)
    return out
