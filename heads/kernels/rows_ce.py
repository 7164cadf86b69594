"""The rows plan of the fused cross-entropy: the mean loss and its gradient in one forward, by
row tiles over the whole vocabulary, for one softmax, a mixture of ``K`` softmaxes (MoS), or one
block of a larger softmax whose other block's log-sum-exp is given (Mixtape's rare tokens).

The gradient of the mean loss with respect to each row's logits is known once the row's
log-sum-exp is: for one softmax ``dL/dz_n = w_n (p_n - q_n)``, with ``w_n = 1 / count`` on kept
rows (0 on ignored ones), ``p_n = softmax(z_n)`` and ``q_n = (1 - eps) onehot(t_n) + eps / V``
(label smoothing ``eps``). For a mixture ``P(t) = sum_k pi_k softmax(z_k)_t``
(mos-hybrid-lightrnn-bpe.txt Eq. 1), ``dL/dz_{n,k} = w_n r_{n,k} (p_{n,k} - onehot(t_n))`` and
``dL/d log pi_{n,k} = -w_n r_{n,k}``, with the responsibilities
``r_{n,k} = pi_k p_{n,k,t} / P(t)``: a tile that holds all ``K`` component rows of its tokens
has everything it needs; for a block, ``dL/dz_n = w_n (e^(lse_n - lse_all) p_n - onehot)``.
So each tile forms its logits once, takes their log-sum-exp, turns them into ``dz`` in place
and runs both gradient products at once:

- three products in all, as an unfused loss runs (the column plans run four: their backward
  recomputes the logits), in the memory of one tile of logits (an unfused loss holds all);
- the backward only scales the stored gradients by the loss's incoming gradient (they are
  formed per unit of ``max w``, so that float16 products keep the small entries).

The per-token NLL is returned too (for the metrics). When something downstream differentiates it
as well, the backward adds its part, ``g_n r_{n,k} (p_{n,k} - onehot)``, with one more pass
over the tiles (the logits recomputed from the saved log-sum-exp): right in every use, fast in
the common one, where only the loss is differentiated.

Three tile bodies: in place on a flat buffer reused from tile to tile (CPUs, where the tile
runs from cache); on GPUs two Triton kernels over the tile's logits in the products' dtype, the
log-sum-exp's then ``dz``'s written over them (``heads/kernels/triton_rows.py``: the tile holds
its logits alone), or, where Triton is missing, compiled functions (one kernel for the
log-sum-exp, one for ``dz`` beside the logits). Nothing branches on values: no host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from heads.kernels.chunks import (
    accumulate_mm,
    accumulation_dtype,
    as_dtype,
    chunk_buffer,
    chunk_logits,
    exp_shifted_,
    exp_sum_,
    finite_shift,
    gpu_plans,
    span_of,
    spans,
    target_columns,
)
from heads.kernels.compiled_lse import compiled_body, joint_width, with_ones
from heads.kernels.triton_gemm import gradients, logits_blocks
from heads.kernels.triton_rows import row_gradient_, row_statistics, triton_available

# tiles run as compiled bodies on the devices that run the GPU plans (chunks.gpu_plans) and on
# these (tests add "cpu" to check the bodies alone, the rest of the CPU's plan kept)
COMPILED_DEVICES: tuple[str, ...] = ()
# tiles' passes over their logits run as Triton kernels (heads/kernels/triton_rows.py) on
# these devices where Triton is installed, for products in these dtypes (tests add "cpu",
# under TRITON_INTERPRET=1); elsewhere the compiled or eager bodies
TRITON_DEVICES: tuple[str, ...] = ("cuda",)
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# one softmax's tile: dz written by the statistics kernel itself, row by row
FUSE_SOFTMAX = True
# the Triton tiles as three Triton products with the softmax in their prologues and epilogue
# (heads/kernels/triton_gemm.py), for products in these dtypes (tests add float64): opt-in
# (LossOptions.fused_products, loss_backend fused; this switch: every tile, for the sweep):
# an H100 times them 2.5x slower than cuBLAS's products and the elementwise kernels (2026-11-27,
# heads/kernels/triton_gemm.py's docstring says why); float32 products keep cuBLAS's (Triton's
# would round them to tf32)
FUSED_PRODUCTS = False
FUSED_DTYPES = (torch.bfloat16, torch.float16)


# the Triton tiles' logits have a multiple of this many columns (zero columns after the
# vocabulary's): rows of 16-byte multiples, which Hopper's tensor-core GEMMs (cuBLAS's TMA
# loads) need for the products that write and read them, as nanoGPT pads GPT-2's 50,257 to
# 50,304; the vocabularies users bring (WikiText-103's 267,735) are no such multiple
COLUMN_MULTIPLE = 64


def padded_columns(v: int) -> int:
    """``v`` rounded up to :data:`COLUMN_MULTIPLE`."""
    return -(-v // COLUMN_MULTIPLE) * COLUMN_MULTIPLE


def tile_body(device: torch.device, dtype: torch.dtype) -> str:
    """Which body runs the tiles on ``device`` with products in ``dtype``: ``triton`` (where
    Triton is installed), ``compiled`` (the GPU plans' devices otherwise), ``eager``."""
    if device.type in TRITON_DEVICES and dtype in TRITON_DTYPES and triton_available():
        return "triton"
    if device.type in COMPILED_DEVICES or gpu_plans(device):
        return "compiled"
    return "eager"


def fused_products_missing(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused products would not run on ``device`` with products in ``dtype`` (the
    plain rows plan runs instead), or None where they run."""
    if device.type not in TRITON_DEVICES:
        return f"they run on CUDA, and this run's device is {device.type}"
    if not triton_available():
        return "Triton is not importable; CUDA builds of torch ship it"
    if dtype not in FUSED_DTYPES:
        return f"they take bf16 or fp16 products, and this run's are {dtype} (trainer.precision)"
    return None


def runs_fused_products(triton: bool, asked: bool, dtype: torch.dtype) -> bool:
    """Whether Triton tiles (``triton``) run as the fused products: where ``asked``
    (``LossOptions.fused_products``) or :data:`FUSED_PRODUCTS`, for products in
    :data:`FUSED_DTYPES`."""
    return triton and (asked or FUSED_PRODUCTS) and dtype in FUSED_DTYPES


def tile_bytes_per_logit(device: torch.device, dtype: torch.dtype) -> int:
    """What a tile holds per logit, for its planning: the Triton tiles their logits alone in
    the products' dtype (``dz`` written over them), the compiled ones the logits and ``dz``,
    the eager ones (CPUs) a float32 buffer."""
    body = tile_body(device, dtype)
    if body == "eager":
        return 4
    return dtype.itemsize * (1 if body == "triton" else 2)


class Mixing(NamedTuple):
    """What the tokens' rows mix with, per token: a mixture's ``log pi`` ``[N, K]`` (MoS), or
    the rest of the vocabulary when these rows are one block of a larger softmax: its
    log-sum-exp and its part of the target logit (Mixtape's rare tokens, outside the gated
    frequent block). All None: one softmax over the rows' columns."""

    log_prior: torch.Tensor | None = None
    outside_lse: torch.Tensor | None = None
    outside_logit: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return 1 if self.log_prior is None else self.log_prior.size(1)

    def tokens(self, t0: int, t1: int, view: bool = False) -> Mixing:
        """The tokens ``[t0, t1)``' inputs (:func:`~heads.kernels.chunks.span_of` each)."""
        return Mixing(*(span_of(x, t0, t1, view) for x in self))


class Terms:
    """The loss's per-token terms from the tile's per-row statistics: the NLL, the row loss
    (with label smoothing) and the coefficients of ``dL/dz = a p - b onehot(t) - c`` per row
    (``p`` the softmax over these columns; ``c`` None without smoothing), and the gradients of
    the mixing inputs (:class:`Mixing`; None where absent)."""

    def __init__(self, lse, picked, total_logit, mixing: Mixing, weight, eps: float, v: int):
        component_nll = (lse - picked).view(-1, mixing.k)  # CE_k = lse_k - z_{k,t}
        self.uniform = None
        self.grads = Mixing()
        if mixing.log_prior is not None:  # nll = -logsumexp_k(log pi_k - CE_k), Eq. 1
            log_posterior = mixing.log_prior - component_nll
            self.nll = -torch.logsumexp(log_posterior, 1)
            responsibility = torch.exp(log_posterior + self.nll[:, None])  # r, softmax over k
            self.grads = Mixing(log_prior=-weight[:, None] * responsibility)
            self.scale = (weight[:, None] * responsibility).reshape(-1)
            self.onehot = self.scale
        elif mixing.outside_lse is not None:  # a block: log Z = logaddexp(lse, lse_outside)
            total_lse = torch.logaddexp(lse, mixing.outside_lse)
            self.nll = total_lse - picked - mixing.outside_logit
            self.grads = Mixing(None, weight * torch.exp(mixing.outside_lse - total_lse), -weight)
            self.scale = weight * torch.exp(lse - total_lse)  # this block's share of Z
            self.onehot = weight
        else:
            self.nll = component_nll[:, 0]
            self.scale, self.onehot, self.uniform = self.softmax_coefficients(weight, eps, v)
        self.loss = self.nll
        if eps:
            self.loss = (1 - eps) * self.nll + eps * (lse - total_logit / v)

    @staticmethod
    def softmax_coefficients(weight, eps: float, v: int):
        """One softmax's ``(a, b, c)`` of ``dz = a p - b onehot(t) - c``: known before its
        log-sum-exp. With smoothing, ``mean_x(-log p_x) = lse - mean_x z_x``, whose ``dL/dz``
        is the uniform ``eps w / V``."""
        if not eps:  # (no product by 1: a launch on a GPU)
            return weight, weight, None
        return weight, (1 - eps) * weight, eps / v * weight


def nll_terms(lse, picked, mixing: Mixing, g):
    """For an incoming gradient ``g`` of the NLL output (the backward's extra pass), from the
    saved statistics: the coefficients of ``dz = a p - b onehot(t)`` per row and the mixing
    inputs' gradients."""
    if mixing.log_prior is not None:
        log_posterior = mixing.log_prior - (lse - picked).view(mixing.log_prior.shape)
        r = torch.softmax(log_posterior, 1)
        scale = (g[:, None] * r).reshape(-1)
        return scale, scale, Mixing(log_prior=-g[:, None] * r)
    if mixing.outside_lse is not None:
        total_lse = torch.logaddexp(lse, mixing.outside_lse)
        outside = g * torch.exp(mixing.outside_lse - total_lse)
        return g * torch.exp(lse - total_lse), g, Mixing(None, outside, -g)
    return g, g, Mixing()


# -- the tile bodies --------------------------------------------------------------------------
def eager_statistics(h, weight, bias, target, acc, buffer, want_sum):
    """In place on ``buffer``: ``z <- exp(z - m)`` and ``(exps, sum exp, lse, z_target,
    sum_x z)`` per row (``sum_x z`` when ``want_sum``)."""
    z = chunk_logits(h, weight, bias, acc, buffer)
    inside, column = target_columns(target, 0, z.size(1))
    picked = torch.where(inside, z.gather(1, column).squeeze(1), 0.0)
    total_logit = z.sum(1) if want_sum else None
    top, total = exp_sum_(z)
    return z, total, finite_shift(top) + total.log(), picked, total_logit


def eager_gradient_(exps, target, scale, onehot, uniform) -> torch.Tensor:
    """In place: ``dz = scale exps - onehot onehot(t) - uniform`` per row."""
    dz = exps.mul_(scale.unsqueeze(1))
    inside, column = target_columns(target, 0, dz.size(1))
    dz.scatter_add_(1, column, torch.where(inside, -onehot, 0.0).unsqueeze(1))
    if uniform is not None:
        dz.sub_(uniform.unsqueeze(1))
    return dz


def _statistics(h, weight, bias, target):
    z = torch.mm(h, weight.t()).to(bias.dtype) + bias
    v = z.size(1)
    inside = (target >= 0) & (target < v)
    picked = torch.where(inside, z.gather(1, target.clamp(0, v - 1)[:, None])[:, 0], 0.0)
    return z, picked


def _gradient(probs, target, scale, onehot, uniform, dtype):
    hit = torch.arange(probs.size(1), device=probs.device)[None, :] == target[:, None]
    dz = probs * scale[:, None] - torch.where(hit, onehot[:, None], 0.0)
    return (dz if uniform is None else dz - uniform[:, None]).to(dtype)


def compiled_forward_tile(h, weight, bias, target, mixing, row_weight, eps: float, want_dz):
    """One tile of the forward as one functional body for ``torch.compile`` (GPUs): ``(lse,
    z_target, nll, row loss, the mixing inputs' gradients, dz)`` with ``dz`` in the products'
    dtype (None unless ``want_dz``). ``bias`` is a tensor (zeros when the head has none);
    ``target`` per component row."""
    z, picked = _statistics(h, weight, bias, target)
    shift = finite_shift(z.amax(1))
    lse = shift + torch.exp(z - shift[:, None]).sum(1).log()
    terms = Terms(lse, picked, z.sum(1), mixing, row_weight, eps, z.size(1))
    if not want_dz:
        return lse, picked, terms.nll, terms.loss, terms.grads, None
    # p from z and lse, not from the reduction's exps: those stay inside the reduction's
    # kernel, and the tile keeps only its logits in the products' dtype and dz (no float32
    # [rows, V] buffer: a third of the tile's memory traffic and half its memory)
    probs = torch.exp(z - lse[:, None])
    dz = _gradient(probs, target, terms.scale, terms.onehot, terms.uniform, h.dtype)
    return lse, picked, terms.nll, terms.loss, terms.grads, dz


def compiled_recompute_tile(h, weight, bias, target, lse, scale, onehot):
    """The backward's extra pass over one tile: ``dz = scale p - onehot onehot(t)``."""
    z, _ = _statistics(h, weight, bias, target)
    return _gradient(torch.exp(z - lse[:, None]), target, scale, onehot, None, h.dtype)


class TileGradients:
    """``(dh, dW, db)`` filled tile by tile in the accumulation dtype: each tile writes its
    rows of ``dh``; the first tile writes ``dW`` and ``db``, later ones add to them.

    ``fold_bias`` (the GPU tiles): ``db`` comes out of the ``dW`` product, ``dz^T [h | 1 | 0]``
    into ``[dW | db | 0]`` (:func:`with_ones`), instead of a pass of its own over ``dz``. A
    tile's ``h`` and ``W`` may come joint already (the Triton tiles' products take the bias
    as a column: :func:`with_bias`); ``dh`` and ``dW`` use their first ``d`` columns.
    ``columns``: the tiles' logits' columns, the vocabulary's padded with zero columns (the
    Triton tiles); ``dW`` and ``db`` are the first ``V`` rows of what they accumulate into."""

    def __init__(self, hidden, weight, bias, acc, need, fold_bias: bool = False,
                 columns: int | None = None) -> None:  # fmt: skip
        n, (v, d) = hidden.size(0), weight.shape
        columns = columns or v
        self.any = any(need)
        new = weight.new_empty if n else weight.new_zeros  # no rows, no tile: zeros
        self.h = hidden.new_empty(n, d, dtype=acc) if need[0] else None
        want_w, want_b = need[1], bias is not None and need[2]
        self.joint = self.w_all = self.b_all = None
        if fold_bias and want_w and want_b:
            self.joint = new(columns, joint_width(d), dtype=acc)
            self.w_all, self.b_all = self.joint[:, :d], self.joint[:, d]
        else:
            self.w_all = new(columns, d, dtype=acc) if want_w else None
            self.b_all = new(columns, dtype=acc) if want_b else None
        self.w, self.b = span_of(self.w_all, 0, v), span_of(self.b_all, 0, v)
        self.d = d

    def add_tile(self, r0: int, r1: int, h_r, w_c, dz, dtype) -> None:
        """``dh[r0:r1] = dz W``, ``dW (+)= dz^T h``, ``db (+)= sum_rows dz``."""
        dz_c, d = as_dtype(dz, dtype), self.d
        if self.h is not None:
            accumulate_mm(self.h[r0:r1], dz_c, w_c[:, :d], False)
        if self.joint is not None:
            joint = h_r if h_r.size(1) == self.joint.size(1) else with_ones(h_r, h_r.dtype)
            accumulate_mm(self.joint, dz_c.t(), joint, r0 > 0)
            return
        if self.w_all is not None:
            accumulate_mm(self.w_all, dz_c.t(), h_r[:, :d], r0 > 0)
        if self.b_all is not None:
            if r0 > 0:
                self.b_all += dz.sum(0, dtype=self.b_all.dtype)
            else:
                torch.sum(dz, 0, dtype=self.b_all.dtype, out=self.b_all)


class _Walk:
    """The row tiles (whole tokens: all ``k`` component rows of each) and their bodies."""

    def __init__(self, hidden, weight, bias, target, dtype, tile, k, fused=False) -> None:
        self.acc = accumulation_dtype(hidden, weight)
        self.weight, self.bias, self.dtype, self.k = weight, bias, dtype, k
        body = tile_body(hidden.device, dtype)
        self.triton, self.compiled = body == "triton", body == "compiled"
        # the fused products: the bias added in the forward's epilogue, db from dz^T h's
        self.fused = runs_fused_products(self.triton, fused, dtype)
        # GPU tiles: db from the dW product
        self.fold_bias = (self.triton or self.compiled) and not self.fused
        # the Triton tiles' products: zero rows after W's, whose logits (and dz there) are 0,
        # and the bias as a column of them (a bias read a logit would be twice the logits')
        self.columns = padded_columns(weight.size(0)) if self.triton else weight.size(0)
        if self.triton and bias is not None and not self.fused:
            self.h = with_ones(hidden, dtype)
            self.w = with_bias(weight, bias, self.columns, dtype)
        else:
            self.h, self.w = as_dtype(hidden, dtype), padded_weight(weight, self.columns, dtype)
        self.rows_target = target.repeat_interleave(k) if k > 1 else target
        tokens = hidden.size(0) // k
        self.tiles = spans(tokens, None if tile is None else max(1, tile // k))
        self.buffer = None
        if self.fused:  # added to the float32 products, unrounded
            self.b = None if bias is None else as_dtype(bias, self.acc)
        elif self.triton:  # the bias in the products
            self.b = None
        elif self.compiled:
            b = bias if bias is not None else weight.new_zeros(weight.size(0))
            self.b = as_dtype(b, self.acc)
        elif self.tiles:
            rows = (self.tiles[0][1] - self.tiles[0][0]) * k
            self.buffer = chunk_buffer(hidden, rows, weight.size(0), self.acc)

    def forward(self, mixing: Mixing, row_weight, eps: float, grads: TileGradients):
        """Every tile: ``(lse, z_target)`` per component row, ``(nll, row loss)`` per token
        and the mixing inputs' gradients; each tile's ``dz`` products added into ``grads``."""
        k = self.k
        parts = []  # per tile: lse, z_target, nll, row loss, the mixing inputs' gradients
        for t0, t1 in self.tiles:
            r0, r1 = t0 * k, t1 * k
            # the compiled body's inputs always slices: Dynamo guards a view's base, so that
            # a whole tensor in one step and a view in the next would compile twice
            rows_mixing = mixing.tokens(t0, t1, view=self.compiled)
            weights = span_of(row_weight, t0, t1, view=self.compiled)
            if self.fused:  # the gradient products too: nothing for add_tile
                parts.append(self._fused_tile(r0, r1, rows_mixing, weights, eps, grads))
                continue
            if self.triton:
                stats, dz = self._triton_tile(r0, r1, rows_mixing, weights, eps, grads.any)
            elif self.compiled:
                body = compiled_body(compiled_forward_tile)
                *stats, dz = body(self.h[r0:r1], self.w, self.b, self.rows_target[r0:r1],
                                  rows_mixing, weights, eps, grads.any)  # fmt: skip
            else:
                target = span_of(self.rows_target, r0, r1)
                exps, total, lse, picked, total_logit = eager_statistics(
                    span_of(self.h, r0, r1), self.weight, self.bias, target, self.acc,
                    self.buffer, eps > 0,
                )  # fmt: skip
                terms = Terms(lse, picked, total_logit, rows_mixing, weights, eps,
                              self.weight.size(0))  # fmt: skip
                stats = (lse, picked, terms.nll, terms.loss, terms.grads)
                dz = None
                if grads.any:  # p = exps / total
                    dz = eager_gradient_(exps, target, terms.scale / total, terms.onehot,
                                         terms.uniform)  # fmt: skip
            parts.append(stats)
            if grads.any:
                grads.add_tile(r0, r1, span_of(self.h, r0, r1), self.w, dz, self.dtype)
            dz = None  # freed before the next tile's logits are allocated
        if not parts:  # no tokens
            empty = self.h.new_zeros(0, dtype=self.acc)
            zeros = Mixing(*(None if x is None else x * 0 for x in mixing))
            return empty, empty, empty, empty, zeros
        lse, picked, nll, loss, mixing_grads = zip(*parts, strict=True)
        joined = Mixing(*(join_tiles(tiles) for tiles in zip(*mixing_grads, strict=True)))
        return join_tiles(lse), join_tiles(picked), join_tiles(nll), join_tiles(loss), joined

    def _triton_tile(self, r0: int, r1: int, mixing: Mixing, row_weight, eps: float, want_dz):
        """One tile by the Triton kernels: its logits in the products' dtype, then their
        statistics and (``want_dz``) ``dz`` over them in place; one softmax's ``dz`` in the
        statistics' own program (:data:`FUSE_SOFTMAX`)."""
        target, v = span_of(self.rows_target, r0, r1), self.weight.size(0)
        z = torch.mm(span_of(self.h, r0, r1), self.w.t())  # [rows, columns]: V, then zeros
        plain = mixing.log_prior is None and mixing.outside_lse is None
        fuse = None
        if want_dz and plain and FUSE_SOFTMAX:
            fuse = Terms.softmax_coefficients(row_weight, eps, v)
        lse, picked, total_logit = row_statistics(z, self.b, target, eps > 0, fuse, self.acc, v)
        terms = Terms(lse, picked, total_logit, mixing, row_weight, eps, v)
        stats = (lse, picked, terms.nll, terms.loss, terms.grads)
        if not want_dz or fuse is not None:
            return stats, z if fuse is not None else None
        row_gradient_(z, self.b, target, lse, terms.scale, terms.onehot, terms.uniform, v)
        return stats, z

    def _fused_tile(self, r0: int, r1: int, mixing: Mixing, row_weight, eps: float,
                    grads: TileGradients):  # fmt: skip
        """One tile by the fused products (:mod:`heads.kernels.triton_gemm`): the logits'
        blocks and their statistics, then (where gradients are wanted) ``dz``'s two products
        straight into ``grads``."""
        h, target = span_of(self.h, r0, r1), span_of(self.rows_target, r0, r1)
        v = self.weight.size(0)
        blocks = logits_blocks(h, self.w, self.b, target, v, eps > 0, self.acc)
        terms = Terms(blocks.lse, blocks.picked, blocks.logit_sum, mixing, row_weight, eps, v)
        if grads.any:
            self._fused_gradients(r0, r1, blocks, terms.scale, terms.onehot, terms.uniform,
                                  grads)  # fmt: skip
        return blocks.lse, blocks.picked, terms.nll, terms.loss, terms.grads

    def _fused_gradients(self, r0, r1, blocks, scale, onehot, uniform, grads) -> None:
        dh = span_of(grads.h, r0, r1)
        h, target = span_of(self.h, r0, r1), span_of(self.rows_target, r0, r1)
        gradients(blocks, h, self.w, target, self.weight.size(0), scale, onehot, uniform, dh,
                  grads.w_all, grads.b_all, accumulate=r0 > 0)  # fmt: skip

    def recompute(self, lse, scale, onehot, grads: TileGradients) -> None:
        """The backward's extra pass: ``dz = scale p - onehot onehot(t)`` into ``grads``."""
        k = self.k
        for t0, t1 in self.tiles:
            r0, r1 = t0 * k, t1 * k
            if self.fused:  # the logits' blocks again (their lse is the saved one)
                target = self.rows_target[r0:r1]
                blocks = logits_blocks(self.h[r0:r1], self.w, self.b, target,
                                       self.weight.size(0), False, self.acc)  # fmt: skip
                self._fused_gradients(r0, r1, blocks, scale[r0:r1], onehot[r0:r1], None, grads)
                continue
            if self.triton:
                dz = torch.mm(self.h[r0:r1], self.w.t())
                row_gradient_(dz, self.b, self.rows_target[r0:r1], lse[r0:r1], scale[r0:r1],
                              onehot[r0:r1], v=self.weight.size(0))  # fmt: skip
            elif self.compiled:
                body = compiled_body(compiled_recompute_tile)
                dz = body(self.h[r0:r1], self.w, self.b, self.rows_target[r0:r1], lse[r0:r1],
                          scale[r0:r1], onehot[r0:r1])  # fmt: skip
            else:
                z = chunk_logits(self.h[r0:r1], self.weight, self.bias, self.acc, self.buffer)
                probs = exp_shifted_(z, lse[r0:r1])
                dz = eager_gradient_(probs, self.rows_target[r0:r1], scale[r0:r1],
                                     onehot[r0:r1], None)  # fmt: skip
            grads.add_tile(r0, r1, self.h[r0:r1], self.w, dz, self.dtype)
            dz = None  # freed before the next tile's logits are allocated


def padded_weight(weight: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype`` with zero rows up to ``rows``: cast and padded in one copy
    (none where it already is both)."""
    if rows == weight.size(0):
        return as_dtype(weight, dtype)
    out = weight.new_zeros(rows, weight.size(1), dtype=dtype)
    out[: weight.size(0)] = weight
    return out


def with_bias(weight: torch.Tensor, bias: torch.Tensor, rows: int, dtype: torch.dtype):
    """``[W | b | 0]`` in ``dtype``, with zero rows up to ``rows`` (:func:`padded_weight`):
    the bias rounded to ``dtype`` as the products' inputs are (``F.linear`` under autocast
    does the same)."""
    v, d = weight.shape
    out = weight.new_zeros(rows, joint_width(d), dtype=dtype)
    out[:v, :d] = weight
    out[:v, d] = bias
    return out


class RowWeights(NamedTuple):
    """Each token's weight in a loss as ``per_unit [N] * unit []``: for a mean, 1 on the kept
    tokens and 0 on the ignored ones, times ``1 / count`` (:meth:`mean`). The rows plans form
    their gradients per unit and the backward scales them by ``unit``: ``w p`` in float16
    products would underflow where the loss-scaled ``g p`` does not."""

    per_unit: torch.Tensor
    unit: torch.Tensor

    @classmethod
    def mean(cls, keep: torch.Tensor, dtype: torch.dtype) -> RowWeights:
        """A mean over the tokens where ``keep`` (``[N]`` bool), in ``dtype``."""
        per_unit = keep.to(dtype)
        return cls(per_unit, per_unit.sum().clamp_min(1).reciprocal())

    def rows(self, index: torch.Tensor | slice) -> RowWeights:
        """The weights of some tokens (an index tensor or a slice), in the same unit."""
        if isinstance(index, slice):
            return RowWeights(self.per_unit[index], self.unit)
        return RowWeights(self.per_unit.index_select(0, index), self.unit)

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """``sum_n w_n values_n``."""
        return self.unit * torch.dot(self.per_unit, as_dtype(values, self.per_unit.dtype))


def weighted_loss(per_unit, unit, nll, row_loss, smoothed: bool):
    """``(sum_n w_n loss_n, nll)`` with ignored tokens' (``per_unit`` 0) NLL 0 and out of
    the sum (whatever their rows held)."""
    nll = torch.where(per_unit > 0, nll, 0.0)
    if smoothed:  # (else each token's loss is its NLL)
        row_loss = torch.where(per_unit > 0, row_loss, 0.0)
    else:
        row_loss = nll
    return unit * torch.dot(per_unit, row_loss), nll


def join_tiles(parts):
    """The tiles' per-token tensors as one (None where the tiles have none; one tile's as it
    is, no copy)."""
    if parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# the engine's flag for the running backward (private, read by AOTAutograd for the same purpose)
_KEEP_GRAPH = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def graph_kept() -> bool:
    """Whether the backward running now keeps its graph for another (``retain_graph``, or
    ``create_graph``'s default), as autograd's engine knows it; True outside a backward and
    under ``torch.compile`` (AOTAutograd plans a traced backward's memory itself). Where it
    is False each saved tensor is read this once: AOTAutograd's own backward asks the same
    (``saved_tensors_use_once``) to hand its saved buffers over."""
    if torch.compiler.is_compiling() or _KEEP_GRAPH is None:
        return True  # (a torch without the engine's flag: the copy, as before)
    return _KEEP_GRAPH()


def scaled_gradients(stored, need, factor: torch.Tensor | None,
                     in_place: bool | None = None) -> list:  # fmt: skip
    """Each stored gradient that is needed, times ``factor`` (None where not needed, missing,
    or without ``factor``): one multi-tensor launch on CUDA (``torch._foreach_mul``), not one
    product each.

    ``in_place`` (None: where the running backward's graph is not kept, :func:`graph_kept`):
    the stored tensors scaled in place and handed out themselves, not copied. The graph's
    saved tensors are freed after this backward, so a parameter's gradient takes the stored
    one's memory (autograd's ``AccumulateGrad`` keeps a lone gradient as ``.grad``, or adds it
    into the existing one): one copy of every gradient, not two, at the backward's peak (a
    [V, d] float32 ``dW`` each: 428 MB at WikiText-103's V = 267,735, d = 400). Where the
    graph is kept (a second backward may read them, with another factor: 0 too), out of place:
    the stored values stay exact for the next backward."""
    keep = [g is not None and w and factor is not None for g, w in zip(stored, need, strict=True)]
    wanted = [g for g, k in zip(stored, keep, strict=True) if k]
    if in_place is None:
        in_place = not graph_kept()
    if wanted and in_place:
        torch._foreach_mul_(wanted, factor)
        products = iter(wanted)
    else:
        products = iter(torch._foreach_mul(wanted, factor) if wanted else [])
    return [next(products) if k else None for k in keep]


def added_gradients(scaled: list, extra, need, in_place: bool | None = None) -> list:
    """``scaled`` (:func:`scaled_gradients`) plus the NLL output's ``extra`` gradients, where
    needed: added into ``scaled``'s own tensors when they are handed over (``in_place``, as
    :func:`scaled_gradients`'s), so that no third copy is made."""
    if in_place is None:
        in_place = not graph_kept()
    return [
        x if y is None or not wanted else (y if x is None else x.add_(y) if in_place else x + y)
        for x, y, wanted in zip(scaled, extra, need, strict=True)
    ]


class RowsCrossEntropy(torch.autograd.Function):
    """``(sum_n w_n loss_n, nll [N])`` of one softmax over ``hidden W^T + b`` (``hidden``
    ``[N, d]``), of a mixture (``log_prior`` ``[N, K]``; ``hidden`` the ``[N K, d]``
    component rows, token-major) or of one block of a larger softmax (``outside_lse`` and
    ``outside_logit`` ``[N]``: :class:`Mixing`), against ``target`` ``[N]`` (outside
    ``[0, V)``: another block's token, or ignored), with the gradient computed in the forward
    (module docstring). ``w_n = row_weight_n unit`` (:class:`RowWeights`: for the mean loss
    1 on kept tokens and 0 on ignored ones, whose NLL is 0, times ``1 / count``). Label
    smoothing: one softmax only."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, log_prior, outside_lse, outside_logit,
                row_weight, unit, eps, dtype, tile, grad, fused=False):  # fmt: skip
        ctx.set_materialize_grads(False)  # an undifferentiated NLL output gives None, not 0s
        mixing = Mixing(log_prior, outside_lse, outside_logit)
        walk = _Walk(hidden, weight, bias, target, dtype, tile, mixing.k, fused)
        # `grad`: the caller's grad mode (needs_input_grad ignores no_grad)
        need = ctx.needs_input_grad[:3] if grad else (False,) * 3
        grads = TileGradients(hidden, weight, bias, walk.acc, need, fold_bias=walk.fold_bias,
                              columns=walk.columns)  # fmt: skip
        row_weight, unit = as_dtype(row_weight, walk.acc), as_dtype(unit, walk.acc)
        with torch.autocast(hidden.device.type, enabled=False):
            lse, picked, nll, row_loss, mixing_grads = walk.forward(mixing, row_weight, eps, grads)
        loss, nll = weighted_loss(row_weight, unit, nll, row_loss, eps > 0)
        ctx.save_for_backward(hidden, weight, bias, target, row_weight, unit, lse, picked,
                              *mixing, grads.h, grads.w, grads.b, *mixing_grads)  # fmt: skip
        ctx.layout = dtype, tile, fused
        return loss, nll

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_nll):
        hidden, weight, bias, target, row_weight, unit, lse, picked, *rest = ctx.saved_tensors
        mixing, stored = Mixing(*rest[:3]), rest[3:]
        dtype, tile, fused = ctx.layout
        need = (*ctx.needs_input_grad[:3], *ctx.needs_input_grad[4:7])
        factor = None if grad_loss is None else as_dtype(grad_loss, unit.dtype) * unit
        in_place = not graph_kept()  # the stored gradients handed over, not copied
        scaled = scaled_gradients(stored, need, factor, in_place)
        if grad_nll is not None:  # the NLL output is differentiated too: g r (p - onehot)
            g = torch.where(row_weight > 0, as_dtype(grad_nll, lse.dtype), 0.0)
            scale, onehot, mixing_extra = nll_terms(lse, picked, mixing, g)
            walk = _Walk(hidden, weight, bias, target, dtype, tile, mixing.k, fused)
            extra = TileGradients(hidden, weight, bias, lse.dtype, ctx.needs_input_grad[:3],
                                  fold_bias=walk.fold_bias, columns=walk.columns)  # fmt: skip
            with torch.autocast(hidden.device.type, enabled=False):
                walk.recompute(lse, scale, onehot, extra)
            added = (extra.h, extra.w, extra.b, *mixing_extra)
            scaled = added_gradients(scaled, added, need, in_place)
        dh, dw, db, *d_mixing = scaled
        return (
            None if dh is None else as_dtype(dh, hidden.dtype),
            None if dw is None else as_dtype(dw, weight.dtype),
            None if db is None or bias is None else as_dtype(db, bias.dtype),
            None,
            *(
                None if d is None else as_dtype(d, x.dtype)
                for d, x in zip(d_mixing, mixing, strict=True)
            ),  # fmt: skip
            *([None] * 7),
        )
