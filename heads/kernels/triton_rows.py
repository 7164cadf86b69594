"""The rows plan's elementwise passes over a tile's logits as two Triton kernels (CUDA, with
Triton installed: it ships with PyTorch's CUDA wheels; never needed on a CPU).

A tile's logits ``z = h W^T`` ``[R, C]`` come out of one product in the products' dtype (bf16
under autocast), ``C`` the vocabulary ``V`` padded to a multiple of 64 with zero columns;
then

- :func:`row_statistics` reads them once: per row the online log-sum-exp of ``z + b`` (kept
  per lane, one ``exp`` a logit), the target's logit (one load) and, with label smoothing,
  the row's sum of logits (``b``: the rows plan passes none, its products take the bias as a
  column);
- :func:`row_gradient_` reads them once more and writes ``dz = scale p - onehot [x = t] -
  uniform`` over them, in place, in their dtype (``p = exp(z + b - lse)``; 0 in the padding),
  for the two gradient products.

Two bytes read, then two read and two written per logit: no float32 copy of the tile, and the
tile's memory is its logits alone (the compiled body holds them and ``dz`` side by side).
Where a softmax's per-row coefficients are known before its log-sum-exp (one softmax: ``w``
and ``(1 - eps) w``; also one block of it, the rest's log-sum-exp given: Mixtape's rare
block), :func:`row_statistics` takes them and writes ``dz`` in the same program, row by row
(``fuse``). Its programs are a fixed grid (:class:`Launch`'s ``programs_per_sm`` a streaming
multiprocessor), each taking every so many rows, so that the rows read at once (and read
again for ``dz``) stay few; each reads its row from the end for the statistics, then from
the start for ``dz``: the columns read last are read again first, the likeliest still in the
GPU's L2 cache (read again in the order first read, rows that together overflow the cache
would find none of themselves there: each column is evicted just before it is reached).

Why the kernels are shaped so (``python -m app.bench.kernels`` shows it in the compiled
code): every load is 16 bytes (the loads are masked by the padded width ``C``, which Triton
then proves a multiple of 16: masked by ``V`` they were one 2-byte load a logit wherever
``V`` is no multiple of 16, e.g. WikiText's 33,278 and 267,735), a thread has ``reps`` of
them in flight, and a row's loop has no barrier (a lane's ``reps`` logits are one thread's;
the lanes meet once a row). On an H200 (V = 100k, d = 512, 16,384 tokens, 2,684-row tiles,
the first form of the statistics kernel: per lane, two ``exp`` a logit, one load in flight a
thread) a softmax step took 12.9 ms against the compiled tiles' 14.0, with 631 MiB more than
its inputs against 1,141 (2026-11-26); its statistics kernel 3.7 ms of it, reading at about
half the card's bandwidth.

Rows of ``-inf`` (masked columns) give ``lse = -inf`` and ``dz = -onehot [x = t] - uniform``:
the maximum they are shifted by is taken as 0 there (``-inf - -inf`` would be NaN).
``TRITON_INTERPRET=1`` runs the kernels on a CPU (the tests' float64 references).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Launch:
    """How the kernels are launched (set by reasoning and the compiled code, not yet by a GPU's
    clock: ``python -m app.bench.sweep`` times others).

    ``warps`` a program; a block of a row is ``reps`` lane rows of ``lanes`` columns, 8 a
    thread (one 16-byte load of bf16): ``reps`` loads in flight a thread (4: 128 registers, two
    8-warp programs an SM); ``programs_per_sm``: the statistics' fixed grid (on an H100, 264
    rows of 100k bf16 logits read at once, ~53 MB, about its L2, which the dz pass reads
    again)."""

    programs_per_sm: int = 2
    reps: int = 4
    warps: int = 8

    @property
    def lanes(self) -> int:
        return 8 * 32 * self.warps

    @property
    def block(self) -> int:
        return self.reps * self.lanes


LAUNCH = Launch()
# the grid under Triton's interpreter (a CPU): a few programs, so that each takes several rows
_INTERPRETED_PROGRAMS = 3


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


def bias_to_width(bias: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """``bias`` with zeros up to ``width`` entries (the kernels read it as they read a row)."""
    if bias is None or bias.numel() >= width:
        return bias
    return torch.nn.functional.pad(bias, (0, width - bias.numel()))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _programs(z: torch.Tensor, rows: int) -> int:
    """The statistics' grid: ``LAUNCH.programs_per_sm`` an SM (at most one a row)."""
    if z.device.type != "cuda":
        return min(rows, _INTERPRETED_PROGRAMS)
    return min(rows, LAUNCH.programs_per_sm * _multiprocessors(z.device.index or 0))


def _geometry(z: torch.Tensor, v: int | None) -> dict:
    return dict(v=z.size(1) if v is None else v, width=z.size(1), stride=z.stride(0),
                REPS=LAUNCH.reps, LANES=LAUNCH.lanes, num_warps=LAUNCH.warps)  # fmt: skip


def row_statistics(
    z: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    want_sum: bool,
    fuse: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    acc: torch.dtype = torch.float32,
    v: int | None = None,
    outside_lse: torch.Tensor | None = None,
):
    """``(lse, z_target, sum_x z or None)`` per row of ``z + bias`` over its first ``v``
    columns (default all; the rest are padding: read with the row, for aligned loads)
    (``acc``; ``z_target`` 0 where ``target`` is outside ``[0, v)``). ``fuse = (scale,
    onehot, uniform)`` per row: ``z`` is overwritten by :func:`row_gradient_`'s ``dz`` in the
    same program, with ``p`` over a softmax these columns are one block of where
    ``outside_lse`` (per row, the rest's log-sum-exp) is given: ``p = exp(z + b - logaddexp(
    lse, outside_lse))``."""
    if outside_lse is not None and fuse is None:
        raise ValueError("outside_lse is what the fused dz is taken over: pass fuse as well")
    _check(z, target)
    rows = z.size(0)
    lse, picked = z.new_empty(rows, dtype=acc), z.new_empty(rows, dtype=acc)
    total = z.new_empty(rows, dtype=acc) if want_sum else lse
    scale, onehot, uniform = fuse if fuse is not None else (lse, lse, None)
    bias = bias_to_width(bias, z.size(1))
    if rows:
        _kernels().tile_statistics[(_programs(z, rows),)](
            z, lse if bias is None else bias, target, lse, picked, total, scale, onehot,
            lse if uniform is None else uniform, lse if outside_lse is None else outside_lse,
            rows, HAS_BIAS=bias is not None, HAS_SUM=want_sum, FUSE=fuse is not None,
            HAS_UNIFORM=uniform is not None, HAS_OUTSIDE=outside_lse is not None,
            ACC=_kernels().ACC[acc], **_geometry(z, v),
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
    v: int | None = None,
) -> torch.Tensor:
    """In place: ``z <- scale exp(z + bias - lse) - onehot [x = target] - uniform`` per row
    over its first ``v`` columns (default all), 0 over the rest, in ``z``'s dtype; returns
    ``z``."""
    _check(z, target)
    rows = z.size(0)
    bias = bias_to_width(bias, z.size(1))
    if rows:
        k = _kernels()
        k.tile_gradient[(rows, k.cdiv(z.size(1), LAUNCH.block))](
            z, lse if bias is None else bias, target, lse, scale, onehot,
            lse if uniform is None else uniform, HAS_BIAS=bias is not None,
            HAS_UNIFORM=uniform is not None, ACC=k.ACC[lse.dtype], **_geometry(z, v),
        )  # fmt: skip
    return z
