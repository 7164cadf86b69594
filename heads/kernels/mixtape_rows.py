"""Mixtape's rows plan: the whole mean loss of Eq. 2's one softmax over the S frequent tokens'
gated logits and the rare tokens' shared-gate ones (Eq. 6), and its gradient, in one forward,
by row tiles over the whole vocabulary (the maths: ``heads/mixtape.py``; the plan's idea for
one softmax: ``heads/kernels/rows_ce.py``).

A tile of R tokens runs three products for its logits: the component logits
``h_{c,k} . w_x`` ``[R K, S]``, the gate pre-activations ``[R (K-1), S]`` (Eq. 4's one
product, ``MixtapeHead``'s gate factors) and the rare logits ``mixed W_rare^T`` ``[R, V - S]``.
Their log-sum-exps give the row's over all V; then ``dz = w (p - q)`` (``q`` the smoothed
one-hot) goes down the sigmoid tree to the two frequent products' outputs,
``dL/d(h_k . w_x) = dz pi_k`` and ``dL/d pre_j = dz pi_j (left_j - right_j) gamma_j
(1 - gamma_j)`` (a node's prior ``pi_j`` is the sum of its leaves'), and six products give the
gradients of the contexts, ``W``, the gate inputs, the gate embeddings, the mixed context and
``W_rare`` (the biases folded into the ``W`` products on GPUs; the rare one into its logits'
product too). So each product runs once forward and twice backward, the FLOP floor, with
nothing recomputed and nothing ``[N, K, S]`` held beyond a tile: the column plans recompute
the frequent block in their backward.

Two tile bodies: on GPUs with Triton the products' outputs in their dtype, with the frequent
block's passes as two Triton kernels (``heads/kernels/triton_mixtape.py``) and the rare
block's as the rows plan's fused one (``heads/kernels/triton_rows.py``: its ``dz`` in its
statistics' pass, given the frequent block's log-sum-exp), all in place, or, with the fused
products (``loss_backend: fused``), the rare block as Triton GEMMs with the softmax inside
them (``heads/kernels/triton_gemm.py``) and, without label smoothing at K <= 4, the
frequent block too (``heads/kernels/triton_mixtape_gemm.py``); elsewhere plain
tensor operations in the accumulation dtype (CPUs, and the float64 reference's equal). Gate
noise is drawn per tile: in the kernels from one seed drawn on the device, or from the
device's generator, whose state is kept for the backward's extra pass (when the NLL output is
differentiated too, the tiles are walked again with its gradient as the rows' weights); under
``torch.compile``, which traces no generator state, the draws themselves are kept.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from heads.kernels.chunks import (
    accumulation_dtype,
    as_dtype,
    as_input,
    exp_shifted_,
    finite_shift,
    span_of,
    spans,
    target_columns,
)
from heads.kernels.compiled_lse import with_ones
from heads.kernels.mixtape_frequent import ReplayNoise, capturing, rng_state
from heads.kernels.rows_ce import (
    Mixing,
    Terms,
    TileGradients,
    added_gradients,
    eager_gradient_,
    graph_kept,
    join_tiles,
    padded_columns,
    padded_weight,
    runs_fused_products,
    scaled_gradients,
    tile_body,
    weighted_loss,
    with_bias,
)
from heads.kernels.sigmoid_tree import heap_level, level_widths
from heads.kernels.triton_gemm import gradients, logits_blocks
from heads.kernels.triton_mixtape import frequent_gradient_, frequent_statistics
from heads.kernels.triton_mixtape_gemm import (
    FUSED_COMPONENTS,
    FrequentGradients,
    frequent_blocks,
    frequent_gradients,
)
from heads.kernels.triton_rows import bias_to_width, row_statistics


def tile_logits_per_row(device: torch.device, dtype: torch.dtype, k: int, s: int, rare: int):
    """``(logits, bytes each)`` a tile holds per token, for its planning: the Triton tiles the
    three products' outputs (``(2K - 1) S + V - S`` columns, padded) in their dtype; the
    eager ones about six ``[K, S]`` float32 slices (values, priors, gates, their gradients
    and the tree's temporaries) and two of the rare logits."""
    if tile_body(device, dtype) == "triton":
        columns = (2 * k - 1) * padded_columns(s) + (padded_columns(rare) if rare else 0)
        return columns, dtype.itemsize
    return 6 * k * s + 2 * rare, 4


def leaf_priors(gammas: torch.Tensor) -> torch.Tensor:
    """The sigmoid tree's leaf priors ``[R, K, S]`` from its gates ``[R, K-1, S]`` (heap
    order), top down (Eq. 3): a node passes ``gamma`` of its prior left, the rest right."""
    rows, _, s = gammas.shape
    priors = gammas.new_ones(rows, 1, s)
    for nodes in level_widths(gammas.size(1) + 1):
        left = priors * gammas[:, heap_level(nodes)]
        priors = torch.stack((left, priors - left), 2).view(rows, 2 * nodes, s)
    return priors


def gate_gradients(dz, values, priors, gammas) -> torch.Tensor:
    """``dL/d pre`` ``[R, K-1, S]`` for ``dL/dz`` ``[R, S]``, bottom up: a node's value
    ``right + gamma (left - right)`` and prior (its children's sum) from its children's, and
    ``dz pi_node (left - right) gamma (1 - gamma)`` for its gate."""
    rows, _, s = values.shape
    grad = torch.empty_like(gammas)
    node_values, node_priors = values, priors
    for nodes in reversed(level_widths(values.size(1))):
        left, right = node_values.view(rows, nodes, 2, s).unbind(2)
        left_prior, right_prior = node_priors.view(rows, nodes, 2, s).unbind(2)
        gamma = gammas[:, heap_level(nodes)]
        diff = left - right
        node_priors = left_prior + right_prior
        grad[:, heap_level(nodes)] = dz[:, None] * node_priors * diff * gamma * (1 - gamma)
        node_values = right + gamma * diff
    return grad


class _Walk:
    """The row tiles and their bodies; ``run`` fills the three products' gradients."""

    def __init__(self, contexts, gate_inputs, mixed, w_freq, b_freq, gate_weights, w_rare,
                 b_rare, target, dtype, tile, noise_std, seed, fused=False,
                 eps: float = 0.0) -> None:  # fmt: skip
        n, k, d = contexts.shape
        self.k, self.s, self.dtype = k, w_freq.size(0), dtype
        self.noise_std, self.seed = noise_std, seed
        # the eager tiles' noise under torch.compile, which traces no generator state: drawn
        # into ``kept`` by the forward's walk, taken back from ``replay`` by the backward's
        self.kept: list[torch.Tensor] | None = None
        self.replay: ReplayNoise | None = None
        self.rare = 0 if mixed is None else w_rare.size(0)
        self.v = self.s + self.rare
        self.acc = accumulation_dtype(contexts, w_freq)
        self.triton = tile_body(contexts.device, dtype) == "triton"
        # the rare block by the fused products (its bias added in their epilogue, in the
        # statistics' dtype); the frequent block's too without label smoothing, whose uniform
        # term its planes cannot give, at K <= 4 (heads/kernels/triton_mixtape_gemm.py)
        self.fused = runs_fused_products(self.triton, fused, dtype)
        self.fused_frequent = self.fused and not eps and k in FUSED_COMPONENTS
        # the Triton tiles' products: zero rows after each weight's, whose outputs stay 0
        pad = padded_columns if self.triton else (lambda columns: columns)
        self.columns = pad(self.s), pad(self.rare)
        self.gate_inputs = as_dtype(gate_inputs.reshape(n * (k - 1), gate_inputs.size(-1)), dtype)
        self.gate_weights = padded_weight(gate_weights, self.columns[0], dtype)
        # the Triton tiles' rare product takes the bias as a column (rows_ce.with_bias); the
        # frequent ones not: the gates' gradients take differences of component logits
        # (Eq. 3), which a bias inside them would leave to bf16's rounding at |b|
        self.contexts, self.w_freq, self.b_freq = self._product(
            contexts.reshape(n * k, d), w_freq, b_freq, self.columns[0], fold=False
        )
        self.mixed = self.w_rare = self.b_rare = None
        if self.rare:
            self.mixed, self.w_rare, self.b_rare = self._product(
                mixed, w_rare, b_rare, self.columns[1], fold=not self.fused
            )
        # each block's targets: every body leaves a target outside its block's columns out
        # (the kernels' and chunks.target_columns' masks), so the rare block's are the ids
        # shifted (negative: a frequent token, or ignored) and the frequent block's the ids
        self.frequent_target = target
        self.rare_target = target - self.s if self.rare else None
        self.tiles = spans(n, tile)

    def _product(self, hidden, weight, bias, columns: int, fold: bool = True):
        """A product's inputs ``(h, W, b)``: the Triton tiles' with the bias folded in (b
        None), or padded to the products' columns as the kernels read it."""
        if self.triton and fold and bias is not None:
            return with_ones(hidden, self.dtype), with_bias(weight, bias, columns, self.dtype), None
        if bias is not None:
            bias = bias_to_width(as_dtype(bias, self.acc), columns)
        return as_dtype(hidden, self.dtype), padded_weight(weight, columns, self.dtype), bias

    def run(self, row_weight, eps: float, grads: tuple[TileGradients, ...]):
        """Every tile: ``(nll, row loss)`` per token, the products' gradients (for
        ``dL/dz = w (p - q)`` per row) added into ``grads`` (frequent, gates, rare or None)."""
        parts = []
        for t0, t1 in self.tiles:
            if self.triton:
                terms, outputs = self._triton_tile(t0, t1, span_of(row_weight, t0, t1), eps,
                                                   grads)  # fmt: skip
            else:
                terms, outputs = self._eager_tile(t0, t1, span_of(row_weight, t0, t1), eps)
            parts.append((terms.nll, terms.loss))
            k = self.k
            if outputs[0] is not None:  # (the fused products' are added)
                grads[0].add_tile(t0 * k, t1 * k, span_of(self.contexts, t0 * k, t1 * k),
                                  self.w_freq, outputs[0], self.dtype)  # fmt: skip
                grads[1].add_tile(t0 * (k - 1), t1 * (k - 1),
                                  span_of(self.gate_inputs, t0 * (k - 1), t1 * (k - 1)),
                                  self.gate_weights, outputs[1], self.dtype)  # fmt: skip
            if self.rare and outputs[2] is not None:  # (the fused products' are added)
                grads[2].add_tile(t0, t1, span_of(self.mixed, t0, t1), self.w_rare, outputs[2],
                                  self.dtype)  # fmt: skip
            outputs = None  # freed before the next tile's are allocated
        if not parts:
            empty = self.contexts.new_zeros(0, dtype=self.acc)
            return empty, empty
        nll, loss = zip(*parts, strict=True)
        return join_tiles(nll), join_tiles(loss)

    def _terms(self, lse_parts, picked, total_logit, row_weight, eps: float):
        """``(lse, terms)`` of one softmax over both blocks, its log-sum-exp from theirs."""
        lse = lse_parts[0] if len(lse_parts) == 1 else torch.logaddexp(*lse_parts)
        return lse, Terms(lse, picked, total_logit, Mixing(), row_weight, eps, self.v)

    def _triton_tile(self, t0: int, t1: int, row_weight, eps: float, grads):
        """One tile by the Triton kernels: ``(terms, (dL/d values, dL/d pre, dL/d rare
        logits))``, the gradients written over the products' outputs; a block by the fused
        products straight into its ``grads`` instead (then None)."""
        k, s, acc, smoothing = self.k, self.s, self.acc, eps > 0
        contexts = span_of(self.contexts, t0 * k, t1 * k)
        gate_inputs = span_of(self.gate_inputs, t0 * (k - 1), t1 * (k - 1))
        noise = dict(seed=self.seed, noise_std=self.noise_std, row0=t0)
        target = span_of(self.frequent_target, t0, t1)
        mixed, rare_target = span_of(self.mixed, t0, t1), span_of(self.rare_target, t0, t1)
        if self.fused_frequent:  # products and tree in one kernel, its planes for the backward
            frequent = frequent_blocks(contexts, self.w_freq, gate_inputs, self.gate_weights,
                                       self.b_freq, target, s, acc=acc, **noise)  # fmt: skip
            values = pre = None
            lse, picked, total = frequent.lse, frequent.picked, None
        else:
            values = torch.mm(contexts, self.w_freq.t())  # [R K, S]
            pre = torch.mm(gate_inputs, self.gate_weights.t())
            lse, picked, total = frequent_statistics(values, pre, self.b_freq, target, s,
                                                     smoothing, acc=acc, **noise)  # fmt: skip
        lse_parts, rare, rare_grads = [lse], None, grads[2]
        # the rare block's dz in its statistics' pass (the rows kernels' fused form, as a block
        # of the one softmax: dz's coefficients are known before any log-sum-exp, and the rest
        # of the softmax's, the frequent block's, is given)
        if self.rare and self.fused:  # its gradient products once the whole lse is known
            blocks = logits_blocks(mixed, self.w_rare, self.b_rare, rare_target, self.rare,
                                   smoothing, acc)  # fmt: skip
            lse_parts.append(blocks.lse)
            picked = picked + blocks.picked
            total = total + blocks.logit_sum if smoothing else None
        elif self.rare:
            rare = torch.mm(mixed, self.w_rare.t())
            fuse = Terms.softmax_coefficients(row_weight, eps, self.v)
            rare_lse, rare_picked, rare_total = row_statistics(
                rare, self.b_rare, rare_target, smoothing, fuse, acc, self.rare, outside_lse=lse
            )
            lse_parts.append(rare_lse)
            picked = picked + rare_picked
            total = total + rare_total if smoothing else None
        lse, terms = self._terms(lse_parts, picked, total, row_weight, eps)
        if self.fused_frequent:
            out = FrequentGradients(span_of(grads[0].h, t0 * k, t1 * k),
                                    span_of(grads[1].h, t0 * (k - 1), t1 * (k - 1)),
                                    grads[0].w_all, grads[0].b_all, grads[1].w_all)  # fmt: skip
            frequent_gradients(frequent, contexts, self.w_freq, gate_inputs, self.gate_weights,
                               target, s, lse, terms.scale, terms.onehot, out,
                               accumulate=t0 > 0)  # fmt: skip
        else:
            frequent_gradient_(values, pre, self.b_freq, target, s, lse, terms.scale,
                               terms.onehot, terms.uniform, **noise)  # fmt: skip
        if self.rare and self.fused and rare_grads is not None and rare_grads.any:
            gradients(blocks, mixed, self.w_rare, rare_target, self.rare, terms.scale,
                      terms.onehot, terms.uniform, span_of(rare_grads.h, t0, t1),
                      rare_grads.w_all, rare_grads.b_all, accumulate=t0 > 0, lse=lse)  # fmt: skip
        return terms, (values, pre, rare)

    def _eager_tile(self, t0: int, t1: int, row_weight, eps: float):
        """One tile as plain tensor operations in the accumulation dtype."""
        k, s, acc, rows = self.k, self.s, self.acc, t1 - t0
        values = torch.mm(span_of(self.contexts, t0 * k, t1 * k), self.w_freq.t()).to(acc)
        values = values.view(rows, k, s)
        pre = torch.mm(span_of(self.gate_inputs, t0 * (k - 1), t1 * (k - 1)),
                       self.gate_weights.t())  # fmt: skip
        pre = pre.to(acc).view(rows, k - 1, s)
        if self.noise_std > 0:  # Eq. 4's training noise on the pre-activations
            pre = pre + self.noise_std * self._noise(pre)
        gammas = torch.sigmoid(pre)
        priors = leaf_priors(gammas)
        logits = [(priors * values).sum(1) + self.b_freq]  # Eq. 2
        targets = [span_of(self.frequent_target, t0, t1)]
        if self.rare:
            rare = torch.mm(span_of(self.mixed, t0, t1), self.w_rare.t()).to(acc) + self.b_rare
            logits.append(rare)
            targets.append(span_of(self.rare_target, t0, t1))
        picked = sum(_picked(z, t) for z, t in zip(logits, targets, strict=True))
        total = sum(z.sum(1) for z in logits) if eps > 0 else None
        # each block's exps in place over its logits: one exp a logit
        shifts = [finite_shift(z.amax(1)) for z in logits]
        exps = [exp_shifted_(z, shift) for z, shift in zip(logits, shifts, strict=True)]
        lse, terms = self._terms([m + e.sum(1).log() for m, e in zip(shifts, exps, strict=True)],
                                 picked, total, row_weight, eps)  # fmt: skip
        dz = [_gradient_(e, m, t, lse, terms) for e, m, t in zip(exps, shifts, targets,
                                                                strict=True)]  # fmt: skip
        frequent = (dz[0][:, None] * priors).view(rows * k, s)
        gates = gate_gradients(dz[0], values, priors, gammas).view(rows * (k - 1), s)
        return terms, (frequent, gates, dz[1] if self.rare else None)

    def _noise(self, pre: torch.Tensor) -> torch.Tensor:
        """An eager tile's gate noise: drawn (and kept where ``kept`` is a list), or the
        forward's own draw again (``replay``)."""
        if self.replay is not None:
            return self.replay.next(pre.shape, pre.dtype)
        noise = torch.randn_like(pre)
        if self.kept is not None:
            self.kept.append(noise)
        return noise


def _picked(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    inside, column = target_columns(target, 0, z.size(1))
    return torch.where(inside, z.gather(1, column).squeeze(1), 0.0)


def _gradient_(exps, shift, target, lse, terms: Terms) -> torch.Tensor:
    """In place over one block's ``exps = exp(z - shift)``: ``dz = scale p - onehot [x = t] -
    uniform``, with ``p = exps exp(shift - lse)`` (0 where the whole softmax is ``-inf``)."""
    to_p = torch.where(lse == -math.inf, 0.0, torch.exp(shift - lse))
    return eager_gradient_(exps, target, terms.scale * to_p, terms.onehot, terms.uniform)


def _gradients(walk: _Walk, inputs, need, acc) -> tuple:
    """The three products' gradient accumulators: frequent (contexts, ``W_freq``,
    ``b_freq``), gates (gate inputs, gate embeddings), rare (mixed, ``W_rare``, ``b_rare``)."""
    contexts, gate_inputs, mixed, w_freq, b_freq, gate_weights, w_rare, b_rare = inputs
    fold, columns = walk.triton, walk.columns
    frequent = TileGradients(walk.contexts, w_freq, b_freq, acc, (need[0], need[3], need[4]),
                             fold_bias=fold and not walk.fused_frequent,
                             columns=columns[0])  # fmt: skip
    gates = TileGradients(walk.gate_inputs, gate_weights, None, acc, (need[1], need[5], False),
                          columns=columns[0])  # fmt: skip
    rare = None
    if walk.rare:
        rare = TileGradients(mixed, w_rare, b_rare, acc, (need[2], need[6], need[7]),
                             fold_bias=fold and not walk.fused, columns=columns[1])  # fmt: skip
    return frequent, gates, rare


def _grads_of(grads) -> list:
    """The eight inputs' gradients (None where not needed) from :func:`_gradients`'."""
    frequent, gates, rare = grads
    h, w, b = (None, None, None) if rare is None else (rare.h, rare.w, rare.b)
    return [frequent.h, gates.h, h, frequent.w, frequent.b, gates.w, w, b]


class MixtapeRowsCrossEntropy(torch.autograd.Function):
    """``(sum_n w_n loss_n, nll [N])`` of Mixtape's softmax (module docstring), with the
    gradient computed in the forward. Inputs: ``contexts`` ``[N, K, d]`` (Eq. 5),
    ``gate_inputs`` ``[N, K-1, e]`` and ``gate_weights`` ``[S, e]`` (Eq. 4's two factors),
    ``mixed`` ``[N, d]`` (Eq. 6's mixed context; None when every token is frequent),
    ``w_freq`` ``[S, d]``, ``b_freq`` ``[S]``, ``w_rare`` ``[V-S, d]``, ``b_rare``
    ``[V-S]``, ``target`` ``[N]`` (ids in ``[0, V)``, -1: ignored), ``row_weight`` ``[N]``
    and ``unit`` ``[]`` (``w_n = row_weight_n unit``: :class:`~heads.kernels.rows_ce.RowWeights`,
    for the mean 1 on kept tokens and 0 on ignored ones times ``1 / count``), label smoothing
    ``eps``, the gate noise's std (0 outside training), ``seed`` (``[1]`` int64: the Triton
    tiles' noise; None: drawn on the device), the products' ``dtype``, the ``tile`` rows and
    the caller's grad mode."""

    @staticmethod
    def forward(ctx, contexts, gate_inputs, mixed, w_freq, b_freq, gate_weights, w_rare,
                b_rare, target, row_weight, unit, eps, noise_std, seed, dtype, tile, grad,
                fused=False):  # fmt: skip
        ctx.set_materialize_grads(False)  # an undifferentiated NLL output gives None, not 0s
        inputs = (contexts, gate_inputs, mixed, w_freq, b_freq, gate_weights, w_rare, b_rare)
        walk = _Walk(*inputs, target, dtype, tile, noise_std, seed, fused, eps)
        state = None
        if noise_std > 0 and walk.triton and seed is None:  # one seed, drawn on the device
            seed = walk.seed = torch.randint(2**62, (1,), device=contexts.device)
        elif noise_std > 0 and not walk.triton and torch.compiler.is_compiling():
            walk.kept = []  # no generator state to trace: the tiles keep their noise (as the
            # column plan's blocks do, mixtape_frequent.block_noise), [N, K-1, S] in all
        elif noise_std > 0 and not walk.triton and not capturing(contexts.device):
            state = rng_state(contexts.device)  # the generator's state replays the noise
        need = ctx.needs_input_grad[:8] if grad else (False,) * 8
        grads = _gradients(walk, inputs, need, walk.acc)
        # gradients per unit, scaled in the backward
        row_weight, unit = as_dtype(row_weight, walk.acc), as_dtype(unit, walk.acc)
        with torch.autocast(contexts.device.type, enabled=False):
            nll, row_loss = walk.run(row_weight, eps, grads)
        loss, nll = weighted_loss(row_weight, unit, nll, row_loss, eps > 0)
        kept = walk.kept or []
        ctx.save_for_backward(*inputs, target, row_weight, unit, seed, state, *kept,
                              *_grads_of(grads))  # fmt: skip
        ctx.layout = noise_std, dtype, tile, fused, len(kept)
        return loss, nll

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_nll):
        saved = ctx.saved_tensors
        noise_std, dtype, tile, fused, num_kept = ctx.layout
        inputs, (target, row_weight, unit, seed, state) = saved[:8], saved[8:13]
        kept, stored = list(saved[13 : 13 + num_kept]), saved[13 + num_kept :]
        need = ctx.needs_input_grad[:8]
        factor = None if grad_loss is None else as_dtype(grad_loss, unit.dtype) * unit
        in_place = not graph_kept()  # the stored gradients handed over, not copied
        out = scaled_gradients(stored, need, factor, in_place)
        if grad_nll is not None:  # the NLL output is differentiated too: walk again, w = g
            if noise_std > 0 and seed is None and state is None and not kept:
                raise RuntimeError(
                    "Mixtape's rows plan replays its gate noise for the NLL output's gradient "
                    "from the generator's state, which a CUDA graph's capture cannot read: "
                    "differentiate the loss alone there (heads/graphs.py does)"
                )
            g = torch.where(row_weight > 0, as_dtype(grad_nll, row_weight.dtype), 0.0)
            walk = _Walk(*inputs, target, dtype, tile, noise_std, seed, fused)
            extra = _gradients(walk, inputs, need, row_weight.dtype)
            device = inputs[0].device
            replay = ReplayNoise(state, kept, device)
            with replay, torch.autocast(device.type, enabled=False):
                walk.replay = replay if kept else None  # (a state: the generator's draws)
                walk.run(g, 0.0, extra)
            out = added_gradients(out, _grads_of(extra), need, in_place)
        grads = [None if g is None or x is None else as_input(g, x)
                 for g, x in zip(out, inputs, strict=True)]  # fmt: skip
        return (*grads, *([None] * 10))
