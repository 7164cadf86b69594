"""The rows plan's tile as three Triton products with the softmax fused into them (CUDA, with
Triton installed; opt-in, ``loss_backend: fused``). An H100 (2026-11-27, Triton 3.6; docs/
results/profile_gpu_fused_100k.json) times them 2.5x slower than cuBLAS's products with the
elementwise kernels of :mod:`heads.kernels.triton_rows` (softmax at V = 100k, d = 512, 16,384
tokens: 33.5 against 13.2 ms a step): :func:`logits_blocks` runs at half cuBLAS's rate (5.0
ms), and the gradient products re-form ``dz`` for every ``BLOCK_D`` slice of ``d`` they cover
(``gradient_weight``: 4 times at d = 512, 18.6 ms, 90 TFLOP/s; ``gradient_hidden``: twice,
7.1 ms), where the prologue's elementwise work and its transposition, not the tensor cores,
set the pace. Wider ``BLOCK_D`` tiles (``GemmLaunch``; ``python -m app.bench.sweep --groups
fused``) are the next thing to time.

A tile's ``[R, C]`` logits ``z = h W^T + b`` are formed in ``BLOCK_N``-column blocks, and
:func:`logits_blocks`'s epilogue keeps of each block, per row, its maximum ``m``, its sum
``s`` and ``u = exp(z - m)`` in the products' dtype, in place of ``z`` itself (one ``exp`` a
logit, taken on the float32 accumulator). The row's log-sum-exp is then ``log sum_b s_b
exp(m_b)`` (:func:`merge_blocks`: a pass over ``[R, C / BLOCK_N]``, not over the logits), and
its softmax ``p = exp(m_b - lse) u``: the two gradient products (:func:`gradients`) form
``dz = scale p - onehot [x = t] - uniform`` block by block in their prologues, with one
``exp`` a row and block, so that ``dz`` is never stored and nothing reads the logits between
the products. Per logit: two bytes written, then read by each gradient product, against the
cuBLAS tile's two written, then two read, two read and two written by the elementwise
kernels, and two read by each product.

``u`` is also the better number to keep: in bf16 it holds ``p`` to ``2^-9`` relative, where
``exp`` of a bf16 logit is off by up to ``|z| 2^-9`` relative (2% at ``|z| = 10``). The
log-sum-exp and the target's logit come from the float32 accumulator, not from rounded
logits.

The same three quantities per row (``scale``, ``onehot``, ``uniform``) give every form of the
rows plan's ``dz``: one softmax, a mixture's components (MoS), a block of a larger softmax
(Mixtape's rare tokens). ``TRITON_INTERPRET=1`` runs the kernels on a CPU (the tests' float64
references).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from heads.kernels.triton_rows import bias_to_width


@dataclass(frozen=True)
class GemmLaunch:
    """The fused products' tiles (Hopper; set by what compiles without spilling, ``python -m
    app.bench.kernels``, not yet by a GPU's clock: ``python -m app.bench.sweep`` times others).

    The forward's output tiles ``block_m x block_n`` (``block_n``: the columns a block's
    statistics are kept over) over ``block_k`` of ``d`` at a time; the gradient products' tiles
    ``hidden_block_m x hidden_block_d`` (``dz W``, ``hidden_step`` columns a step, its steps
    split where there are too few row tiles to fill the GPU) and ``weight_block_c x
    weight_block_d`` (``dz^T h``, ``block_r`` rows a step); the steps' and tiles' columns divide
    ``block_n`` (``dz^T h``'s may be whole blocks instead). The larger a tile, the more products
    a byte of operands loaded feeds (``m n / 2 (m + n)``: 32 at 128 x 128, 43 at 128 x 256; an
    H100's tensor cores want ~160 from its memory, ~50 from L2), but ``dz``'s prologue holds
    registers a plain product does not (Triton 3.9, sm_90): the forward takes 127 (two programs
    an SM, one's epilogue under the other's products), ``dz W`` at 128 x 256 with 32 columns a
    step 210, ``dz^T h`` at 128 x 128 223 (at 128 x 256 it spills)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    hidden_block_m: int = 128
    hidden_block_d: int = 256
    hidden_step: int = 32
    weight_block_c: int = 128
    weight_block_d: int = 128
    block_r: int = 64
    group_m: int = 8
    warps: int = 8
    stages: int = 3

    def __post_init__(self) -> None:
        whole = self.weight_block_c % self.block_n == 0  # dz^T h's tile: whole blocks, or in one
        if self.block_n % self.hidden_step or (self.block_n % self.weight_block_c and not whole):
            raise ValueError(f"the gradient products' columns must divide block_n (dz^T h's "
                             f"may be a multiple of it): {self}")  # fmt: skip


GEMM_LAUNCH = GemmLaunch()
# merge_blocks' rows a program and blocks a step (4 warps: 56 registers; 32 blocks spill)
MERGE_ROWS, MERGE_STEP = 32, 16
# the split of dz W's column blocks aims at this many programs an SM
_PROGRAMS_PER_SM = 2
_INTERPRETED_SMS = 1


@functools.cache
def _kernels():
    """The kernels' module, imported on first use (CPU installs have no Triton)."""
    from heads.kernels import triton_gemm_kernels

    return triton_gemm_kernels


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def statistics_type(dtype: torch.dtype) -> object:
    """Triton's type for statistics in ``dtype`` (float64 in the tests' references)."""
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


class Blocks(NamedTuple):
    """A tile's logits as :func:`logits_blocks` keeps them: ``u [R, C]`` (``exp(z - m)`` per
    block, products' dtype) and each row's block maxima ``top [R, C / BLOCK_N]``; per row the
    log-sum-exp, the target's logit and (label smoothing) the sum of logits."""

    u: torch.Tensor
    top: torch.Tensor
    lse: torch.Tensor
    picked: torch.Tensor
    logit_sum: torch.Tensor | None


def logits_blocks(
    h: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    v: int,
    want_sum: bool,
    acc: torch.dtype = torch.float32,
) -> Blocks:
    """``h [R, d]`` times ``w [C, d]`` (``C >= v`` columns: the vocabulary's, then padding)
    plus ``bias`` as :class:`Blocks`: ``lse`` and the rest over the first ``v`` columns
    (statistics in ``acc``; ``picked`` 0 where ``target`` is outside ``[0, v)``)."""
    launch = GEMM_LAUNCH
    rows, d = h.shape
    width = w.size(0)
    if w.size(1) != d or h.stride(1) != 1 or w.stride(1) != 1 or target.shape != (rows,):
        raise ValueError(f"h [R, d], w [C, d] with unit column strides and target [R], got "
                         f"{tuple(h.shape)}, {tuple(w.shape)}, {tuple(target.shape)}")  # fmt: skip
    blocks = -(-width // launch.block_n)
    u = h.new_empty(rows, width)
    top, sums = h.new_empty(rows, blocks, dtype=acc), h.new_empty(rows, blocks, dtype=acc)
    logit_sums = h.new_empty(rows, blocks, dtype=acc) if want_sum else top
    picked = h.new_zeros(rows, dtype=acc)
    lse = h.new_empty(rows, dtype=acc)
    total = h.new_empty(rows, dtype=acc) if want_sum else lse
    bias = bias_to_width(bias, width)
    if rows:
        k, types = _kernels(), statistics_type(acc)
        grid = (-(-rows // launch.block_m) * blocks,)
        k.logits_blocks[grid](
            h, w, top if bias is None else bias, target, u, top, sums, picked, logit_sums,
            rows, v, width, d, h.stride(0), w.stride(0), u.stride(0), blocks,
            HAS_BIAS=bias is not None, HAS_SUM=want_sum, ACC=types,
            BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
            GROUP_M=launch.group_m, num_warps=launch.warps, num_stages=launch.stages,
        )  # fmt: skip
        merge_blocks(top, sums, lse, logit_sums if want_sum else None, total)
    return Blocks(u, top, lse, picked, total if want_sum else None)


def merge_blocks(top: torch.Tensor, sums: torch.Tensor, lse: torch.Tensor,
                 logit_sums: torch.Tensor | None = None, total: torch.Tensor | None = None,
                 ) -> None:  # fmt: skip
    """Each row's log-sum-exp into ``lse`` from its blocks' maxima and sums ``[R, blocks]``
    (and, given ``logit_sums``, the sum of its blocks' into ``total``)."""
    rows, blocks = top.shape
    want_sum = logit_sums is not None
    _kernels().merge_blocks[(-(-rows // MERGE_ROWS),)](
        top, sums, logit_sums if want_sum else sums, lse, total if want_sum else lse, rows,
        blocks, HAS_SUM=want_sum, ACC=statistics_type(lse.dtype), BLOCK_M=MERGE_ROWS,
        BLOCK_B=MERGE_STEP, num_warps=4,
    )  # fmt: skip


def _splits(rows: int, d: int, steps: int, device: torch.device, launch: GemmLaunch) -> int:
    """How many ways ``dz W`` splits its column steps: enough programs to fill the GPU (a
    tile of a few thousand rows at d = 512 is a few dozen output tiles)."""
    tiles = -(-rows // launch.hidden_block_m) * -(-d // launch.hidden_block_d)
    sms = _multiprocessors(device.index or 0) if device.type == "cuda" else _INTERPRETED_SMS
    return max(1, min(steps, -(-_PROGRAMS_PER_SM * sms // tiles)))


def gradients(
    blocks: Blocks,
    h: torch.Tensor,
    w: torch.Tensor,
    target: torch.Tensor,
    v: int,
    scale: torch.Tensor,
    onehot: torch.Tensor,
    uniform: torch.Tensor | None,
    dh: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
    accumulate: bool,
    lse: torch.Tensor | None = None,
    launch: GemmLaunch | None = None,
) -> None:
    """``dz = scale p - onehot [x = t] - uniform`` per row (``p = exp(z - lse)``, ``lse`` by
    default the blocks' own, another where these columns are one block of a larger softmax;
    0 from column ``v`` on) into ``dh = dz w[:, :d]`` (written) and ``dw (+)= dz^T h``, ``db
    (+)= sum_rows dz`` (added to where ``accumulate``), each where given, in their dtype (the
    statistics'); ``dw`` and ``db`` have ``w``'s ``C`` rows. ``launch``: the tiles (by default
    :data:`GEMM_LAUNCH`; its ``block_n`` the one the blocks were formed with)."""
    launch = launch or GEMM_LAUNCH
    rows, d = h.shape
    width = w.size(0)
    u, top = blocks.u, blocks.top
    count = top.size(1)
    if not rows:
        return
    k = _kernels()
    acc = statistics_type(blocks.lse.dtype)
    lse = blocks.lse if lse is None else lse
    common = (u, top, target, lse, scale, onehot, scale if uniform is None else uniform)
    if dh is not None:
        steps = -(-width // launch.hidden_step)
        splits = _splits(rows, d, steps, h.device, launch)
        per_split = -(-steps // splits)
        splits = -(-steps // per_split)
        out = dh if splits == 1 else dh.new_empty(splits, rows, d)
        grid = (-(-rows // launch.hidden_block_m) * -(-d // launch.hidden_block_d), splits)
        k.gradient_hidden[grid](
            *common, w, out, rows, v, width, d, u.stride(0), w.stride(0), out.stride(-2),
            0 if splits == 1 else out.stride(0), count, steps, per_split,
            HAS_UNIFORM=uniform is not None, ACC=acc, BLOCK_M=launch.hidden_block_m,
            BLOCK_N=launch.block_n, BLOCK_K=launch.hidden_step, BLOCK_D=launch.hidden_block_d,
            num_warps=launch.warps, num_stages=launch.stages,
        )  # fmt: skip
        if splits > 1:  # summed in a fixed order: the same gradient run after run
            torch.sum(out, 0, out=dh)
    if dw is not None or db is not None:
        dw_out = dw if dw is not None else db.new_empty(width, d)
        grid = (-(-width // launch.weight_block_c) * -(-d // launch.weight_block_d),)
        k.gradient_weight[grid](
            *common, h, dw_out, dw_out if db is None else db, rows, v, width, d, u.stride(0),
            h.stride(0), dw_out.stride(0), count, HAS_UNIFORM=uniform is not None,
            HAS_BIAS=db is not None, ACCUMULATE=accumulate, ACC=acc, BLOCK_N=launch.block_n,
            BLOCK_C=launch.weight_block_c, BLOCK_R=launch.block_r, BLOCK_D=launch.weight_block_d,
            num_warps=launch.warps, num_stages=launch.stages,
        )  # fmt: skip
