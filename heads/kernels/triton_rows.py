"""The rows plan's elementwise passes over a tile's logits as two Triton kernels (CUDA, with
Triton installed: it ships with PyTorch's CUDA wheels; never needed on a CPU).

A tile's logits ``z = h W^T`` ``[R, V]`` come out of one product in the products' dtype (bf16
under autocast); then

- :func:`row_statistics` reads them once: per row the online log-sum-exp of ``z + b`` by
  blocks of columns (the block's maximum, then one ``exp`` per logit), the target's logit
  and, with label smoothing, the row's sum of logits;
- :func:`row_gradient_` reads them once more and writes ``dz = scale p - onehot [x = t] -
  uniform`` over them, in place, in their dtype (``p = exp(z + b - lse)``), for the two
  gradient products.

Two bytes read, then two read and two written per logit: no float32 copy of the tile, and the
tile's memory is its logits alone (the compiled body holds them and ``dz`` side by side).
Where a softmax's per-row coefficients are known before its log-sum-exp (one softmax: ``w``
and ``(1 - eps) w``), :func:`row_statistics` takes them and writes ``dz`` in the same program,
row by row (``fuse``). On an H200 (V = 100k, d = 512, 16,384 tokens, 2,684-row tiles, the
first form of the statistics kernel: per lane, two ``exp`` a logit) a softmax step took
12.9 ms against the compiled tiles' 14.0, with 631 MiB more than its inputs against 1,141
(2026-11-26).

Rows of ``-inf`` (masked columns) give ``lse = -inf`` and ``dz = -onehot [x = t] - uniform``:
the maximum they are shifted by is taken as 0 there (``-inf - -inf`` would be NaN).
``TRITON_INTERPRET=1`` runs the kernels on a CPU (the tests' float64 references).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

# columns a program reads per step (the load is this many elements of the row)
_BLOCK = 2048
_WARPS = 8


@functools.cache
def triton_available() -> bool:
    """Whether Triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels():
    """The kernels' module, imported on first use: importing this one never imports Triton
    (CPU installs have none)."""
    from heads.kernels import triton_rows_kernels

    return triton_rows_kernels


def _check(z: torch.Tensor, target: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1 or target.shape != z.shape[:1]:
        shapes = f"{tuple(z.shape)} (strides {z.stride()}) and {tuple(target.shape)}"
        raise ValueError(f"logits must be [R, V] with unit column stride, target [R]: {shapes}")


def row_statistics(
    z: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    want_sum: bool,
    fuse: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    acc: torch.dtype = torch.float32,
):
    """``(lse, z_target, sum_x z or None)`` per row of ``z + bias`` (``acc``; ``z_target``
    0 where ``target`` is outside ``[0, V)``). ``fuse = (scale, onehot, uniform)`` per row:
    ``z`` is overwritten by :func:`row_gradient_`'s ``dz`` in the same program."""
    _check(z, target)
    rows, v = z.shape
    lse, picked = z.new_empty(rows, dtype=acc), z.new_empty(rows, dtype=acc)
    total = z.new_empty(rows, dtype=acc) if want_sum else lse
    scale, onehot, uniform = fuse if fuse is not None else (lse, lse, None)
    if rows:
        _kernels().statistics[(rows,)](
            z, lse if bias is None else bias, target, lse, picked, total, scale, onehot,
            lse if uniform is None else uniform, v, z.stride(0), HAS_BIAS=bias is not None,
            HAS_SUM=want_sum, FUSE=fuse is not None, HAS_UNIFORM=uniform is not None,
            ACC=_kernels().ACC[acc], BLOCK=_BLOCK, num_warps=_WARPS,
        )  # fmt: skip
    return lse, picked, total if want_sum else None


def row_gradient_(
    z: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    onehot: torch.Tensor,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """In place: ``z <- scale exp(z + bias - lse) - onehot [x = target] - uniform`` per row,
    in ``z``'s dtype; returns ``z``."""
    _check(z, target)
    rows, v = z.shape
    if rows:
        k = _kernels()
        k.gradient[(rows, k.cdiv(v, _BLOCK))](
            z, lse if bias is None else bias, target, lse, scale, onehot,
            lse if uniform is None else uniform, v, z.stride(0), HAS_BIAS=bias is not None,
            HAS_UNIFORM=uniform is not None, ACC=k.ACC[lse.dtype], BLOCK=_BLOCK,
            num_warps=_WARPS,
        )  # fmt: skip
    return z
