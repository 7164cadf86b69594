"""Mixtape output layer (Yang, Luong, Salakhutdinov, Le, NeurIPS 2019; mixtape.txt).

One softmax over vector-gated logits (Eq. 2)::

    logit_{c,x} = sum_k pi_{c,x,k} (h_{c,k} . w_x) + b_x

with priors from a sigmoid tree (Eq. 3) over gate pre-activations (Eq. 4)
``l_{c,x,k} = v_x . tanh(U_k g_c) + u_k . g_c + b_{x,k}`` for the S most frequent tokens,
and the shared ``l_{c,k} = u_k . g_c`` (Eq. 6) for all others. Context embeddings
``h_{c,k} = tanh(H_k g_c)`` (Eq. 5). For the shared-gate tokens the K contexts are mixed
first and multiplied with ``W`` once, so no ``[N, K, V]`` tensor is built.

Training (``forward``) never builds the ``[N, V]`` logits: the frequent tokens' gated logits
go through ``_MixtapeFrequentLSE`` (the same equations by vocabulary blocks, recomputed in a
hand-written backward), the shared-gate tokens are one plain linear block on the mixed context
(the fused primitive, ``heads/fused_cross_entropy.py``), and the two partial log-sum-exps
combine into the one normaliser of Eq. 2. ``logits`` / ``log_prob`` build the exact ``[N, V]``
for evaluation, a block of rows at a time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from heads.base import (
    HeadOutput,
    SingleSoftmaxHead,
    check_label_smoothing,
    check_positive_int,
    float32_no_autocast,
    output_bias,
    upcast,
)
from heads.cross_entropy import IGNORE_INDEX
from heads.errors import HeadConfigError
from heads.fused_cross_entropy import (
    LinearLSE,
    accumulate_mm,
    accumulation_dtype,
    as_dtype,
    chunk_buffer,
    chunk_logits,
    combine_chunk,
    combine_lse,
    compute_dtype,
    exp_shifted_,
    exp_sum_,
    linear_lse,
    plan_tiles,
    resolve_backend,
    spans,
    target_columns,
)


def sigmoid_tree_priors(gate_logits: torch.Tensor) -> torch.Tensor:
    """Eq. 3 for any power-of-two K: ``[..., K-1]`` pre-activations -> ``[..., K]`` priors.

    Internal nodes are in heap order (node j has children 2j+1, 2j+2); leaf k's prior is the
    product of ``gamma`` (left branch) or ``1 - gamma`` (right branch) along its path. For
    K = 4: pi_1 = g1 g2, pi_2 = g1 (1-g2), pi_3 = (1-g1) g3, pi_4 = (1-g1)(1-g3).
    """
    gammas = torch.sigmoid(gate_logits)
    num_nodes = gammas.size(-1)
    priors = torch.ones_like(gammas[..., :1])
    level_start = 0
    while level_start < num_nodes:
        width = priors.size(-1)
        gamma = gammas[..., level_start : level_start + width]
        left = priors * gamma
        priors = torch.stack((left, priors - left), dim=-1).flatten(-2)
        level_start += width
    return priors


# rows per block of the exact log_prob (evaluation): [rows, K, S] products and [rows, V] logits
_EVAL_ROWS = 1024


class MixtapeHead(SingleSoftmaxHead):
    """Mixtape: logit-space vector gating with sigmoid-tree gates and gate sharing.

    Args:
        hidden_size: size ``d1`` of the last-layer hidden states ``g_c``.
        vocab_size: number of classes; ids must be sorted by decreasing frequency.
        num_components: K, a power of two >= 2 (the paper uses 4).
        frequent_ratio: r = S / V, the share of most frequent tokens with their own gates
            (0.1 for language modelling, 0.5 for translation in the paper). r = 1 disables
            gate sharing.
        gate_embedding_size: ``d2``, size of the gate embeddings ``v_x``.
        embedding_size: size ``d`` of ``h_{c,k}`` and of the token embeddings ``w_x``.
            Default: ``hidden_size``.
        gate_dropout: dropout on ``tanh(U_k g_c)`` (Eq. 4).
        context_dropout: dropout on ``h_{c,k}`` (Eq. 5).
        gate_noise: std of the Gaussian noise added to gate pre-activations in training.
        weight_norm_scale: if set, ``U_k`` is weight-normalised per row with this constant
            scale (the paper's choice for language modelling).
        zipf_bias_init: start the output bias ``b_x`` at the centred log-probabilities of a
            Zipf law over the frequency-sorted ids (``b_x = -log(x + 1) + const``) instead of
            zeros. Without it, the first updates fit the unigram through the bounded
            ``tanh`` contexts: Adam drives the backbone's outputs and ``H_k g_c`` to
            saturation, the gradient through both tanh vanishes and training sits on a
            context-free plateau (issue 18's seed-7 run; see ``zipf_log_prior``).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_components: int = 4,
        frequent_ratio: float = 0.1,
        gate_embedding_size: int = 64,
        embedding_size: int | None = None,
        gate_dropout: float = 0.0,
        context_dropout: float = 0.0,
        gate_noise: float = 0.0,
        weight_norm_scale: float | None = None,
        zipf_bias_init: bool = True,
    ) -> None:
        super().__init__(hidden_size, vocab_size)
        if (
            not isinstance(num_components, int)
            or num_components < 2
            or num_components & (num_components - 1)
        ):
            raise HeadConfigError(
                f"MixtapeHead num_components must be a power of two >= 2 (sigmoid tree, Eq. 3), "
                f"got {num_components!r}"
            )
        if not 0.0 < frequent_ratio <= 1.0:
            raise HeadConfigError(
                f"MixtapeHead frequent_ratio r must be in (0, 1], got {frequent_ratio!r}"
            )
        check_positive_int("gate_embedding_size", gate_embedding_size)
        embedding_size = hidden_size if embedding_size is None else embedding_size
        check_positive_int("embedding_size", embedding_size)
        if gate_noise < 0:
            raise HeadConfigError(f"MixtapeHead gate_noise must be >= 0, got {gate_noise!r}")
        if weight_norm_scale is not None and weight_norm_scale <= 0:
            raise HeadConfigError(
                f"MixtapeHead weight_norm_scale must be positive, got {weight_norm_scale!r}"
            )

        self.num_components = num_components
        self.num_gates = num_components - 1  # K - 1 sigmoids for K leaves
        self.frequent_ratio = frequent_ratio
        self.num_frequent = min(vocab_size, max(1, math.ceil(frequent_ratio * vocab_size)))
        self.gate_embedding_size = gate_embedding_size
        self.embedding_size = embedding_size
        self.gate_noise = gate_noise
        self.weight_norm_scale = weight_norm_scale

        # Eq. 5: h_{c,k} = tanh(H_k g_c)
        self.context = nn.Linear(hidden_size, num_components * embedding_size)
        # Eq. 4: tanh(U_k g_c), one block of d2 rows per gate
        self.gate_projection = nn.Linear(hidden_size, self.num_gates * gate_embedding_size)
        # Eq. 4 / Eq. 6: u_k . g_c
        self.gate_context = nn.Linear(hidden_size, self.num_gates, bias=False)
        # Eq. 4: v_x and b_{x,k} for the S frequent tokens only
        self.gate_embedding = nn.Parameter(torch.empty(self.num_frequent, gate_embedding_size))
        self.gate_bias = nn.Parameter(torch.zeros(self.num_frequent, self.num_gates))
        # Eq. 2: token embeddings w_x and bias
        self.weight = nn.Parameter(torch.empty(vocab_size, embedding_size))
        self.bias = output_bias(vocab_size, zipf_bias_init)
        self.gate_dropout = nn.Dropout(gate_dropout)
        self.context_dropout = nn.Dropout(context_dropout)
        nn.init.normal_(self.weight, std=embedding_size**-0.5)
        nn.init.normal_(self.gate_embedding, std=gate_embedding_size**-0.5)
        self.zipf_bias_init = zipf_bias_init

    def _gate_projection_weight(self) -> torch.Tensor:
        weight = self.gate_projection.weight
        if self.weight_norm_scale is None:
            return weight
        # weight normalisation with a constant (not learnt) scale, per output row
        return self.weight_norm_scale * weight / weight.norm(dim=1, keepdim=True).clamp_min(1e-12)

    def _noisy(self, gate_logits: torch.Tensor) -> torch.Tensor:
        if self.training and self.gate_noise > 0:
            return gate_logits + torch.randn_like(gate_logits) * self.gate_noise
        return gate_logits

    def _pieces(
        self, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What both paths share: contexts ``[N, K, d]`` (Eq. 5), the two factors of the
        frequent tokens' gate pre-activations and the shared pre-activations ``[N, K-1]``.

        Eq. 4, ``v_x . tanh(U_k g) + u_k . g + b_{x,k}``, is one product ``A B^T`` with
        ``A = [tanh(U_k g) | u_k . g | e_k]`` ``[N, K-1, d2 + K]`` and
        ``B = [v_x | 1 | b_x]`` ``[S, d2 + K]``: the two broadcast adds over ``[N, K-1, S]``
        happen inside the product's inner dimension (K more multiply-adds per entry).
        """
        n, kg = hidden.size(0), self.num_gates
        contexts = self.context_dropout(torch.tanh(self.context(hidden)).view(n, kg + 1, -1))
        # Gate pre-activations shared by every token: u_k . g_c  (Eq. 6)
        shared = self.gate_context(hidden)  # [N, K-1]
        gate_hidden = torch.tanh(
            F.linear(hidden, self._gate_projection_weight(), self.gate_projection.bias)
        )
        gate_hidden = self.gate_dropout(gate_hidden).view(n, kg, self.gate_embedding_size)
        dtype = gate_hidden.dtype
        eye = torch.eye(kg, dtype=dtype, device=hidden.device).expand(n, kg, kg)
        gate_inputs = torch.cat((gate_hidden, shared.unsqueeze(-1).to(dtype), eye), dim=-1)
        embedding = self.gate_embedding
        ones = embedding.new_ones(embedding.size(0), 1)
        gate_weights = torch.cat((embedding, ones, self.gate_bias.to(embedding.dtype)), dim=-1)
        return contexts, gate_inputs, gate_weights, shared

    def _mixed_context(self, contexts: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """Infrequent tokens: one shared prior, so the contexts are mixed first ``[N, d]``."""
        shared_priors = sigmoid_tree_priors(self._noisy(shared))  # [N, K]
        return torch.bmm(shared_priors.unsqueeze(1).to(contexts.dtype), contexts).squeeze(1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vector-gated logits ``[N, V]`` (Eq. 2 before the softmax)."""
        s = self.num_frequent
        contexts, gate_inputs, gate_weights, shared = self._pieces(hidden)
        if s < self.vocab_size:
            w_freq, w_rare = self.weight.split([s, self.vocab_size - s])
            b_freq, b_rare = self.bias.split([s, self.vocab_size - s])
        else:
            w_freq, b_freq = self.weight, self.bias
        # Frequent tokens, Eq. 4: one [N (K-1), d2 + K] x [d2 + K, S] product -> [N, K-1, S]
        gate_logits = torch.matmul(gate_inputs, gate_weights.t())
        values = F.linear(contexts, w_freq)  # [N, K, S]
        frequent_logits = _SigmoidTreeMix.apply(self._noisy(gate_logits), values)  # Eq. 2-3
        # the bias after the mix (sum_k pi = 1): one pass over [N, S], not over [N, K, S]
        frequent_logits = frequent_logits + b_freq.to(frequent_logits.dtype)
        if s == self.vocab_size:
            return frequent_logits
        mixed_context = self._mixed_context(contexts, shared)
        return _FrequentThenRareLogits.apply(frequent_logits, mixed_context, w_rare, b_rare)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact ``[N, V]`` log-probabilities, ``_EVAL_ROWS`` rows at a time: the frequent
        tokens' ``[rows, K, S]`` products stay bounded however large N is."""
        self.check_inputs(hidden)
        parts = []
        for start in range(0, hidden.size(0), _EVAL_ROWS):
            logits = self.logits(hidden[start : start + _EVAL_ROWS])
            with float32_no_autocast(hidden.device):
                parts.append(upcast(logits).log_softmax(dim=-1))
        if not parts:
            return hidden.new_zeros(0, self.vocab_size, dtype=upcast(hidden).dtype)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def forward(
        self, hidden: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
    ) -> HeadOutput:
        """The loss without the ``[N, V]`` logits: the frequent block (``_MixtapeFrequentLSE``)
        and the shared-gate block (one linear block on the mixed context) each give a partial
        log-sum-exp and their part of the target logit; Eq. 2's normaliser is their
        ``logsumexp``."""
        self.check_inputs(hidden, target)
        check_label_smoothing(label_smoothing)
        s, v = self.num_frequent, self.vocab_size
        contexts, gate_inputs, gate_weights, shared = self._pieces(hidden)
        ids = torch.where(target != IGNORE_INDEX, target, -1)  # -1: no target logit
        smoothing = bool(label_smoothing)
        # one split of each parameter: its backward writes one [V, d] gradient, where two
        # slices would each write a zero-filled one
        w_freq, w_rare = self.weight.split([s, v - s])
        b_freq, b_rare = self.bias.split([s, v - s])
        noise = self.gate_noise if self.training else 0.0
        parts = [
            mixtape_frequent_lse(
                gate_inputs,
                gate_weights,
                contexts,
                w_freq,
                b_freq,
                ids,
                smoothing,
                noise,
                self.loss_options,
            )  # fmt: skip
        ]
        if s < v:  # Eq. 6: one prior for every rare token, so the contexts are mixed first
            mixed = self._mixed_context(contexts, shared)
            rare_target = torch.where(ids >= s, ids - s, -1)
            parts.append(linear_lse(mixed, w_rare, b_rare, rare_target, logit_sum=smoothing,
                                    options=self.loss_options))  # fmt: skip
        lse = combine_lse(*(p.lse for p in parts)) if len(parts) > 1 else parts[0].lse
        nll = lse - sum(p.target_logit for p in parts)
        mean_logit = sum(p.logit_sum for p in parts) / v if smoothing else None
        return self.output(
            nll, target, smoothing=None if mean_logit is None else lse - mean_logit,
            label_smoothing=label_smoothing,
        )  # fmt: skip


class _SigmoidTreeMix(torch.autograd.Function):
    """``sum_k pi_k v_k`` over the sigmoid tree (Eq. 2-3) without forming the priors.

    Bottom up, a node's value is ``gamma * left + (1 - gamma) * right``. Inputs: gate
    pre-activations ``[N, K-1, S]`` (heap order) and values ``[N, K, S]``; output ``[N, S]``.
    The backward is written by hand: autograd's version of the same lerps allocates and
    stacks a gradient per slice, and the tree on ``[N, K, S]`` is Mixtape's largest cost
    after the matrix products (README, "Output-layer benchmark").
    """

    @staticmethod
    def forward(ctx, gate_logits: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        n, k, s = values.shape
        gammas = torch.sigmoid(gate_logits.to(values.dtype))
        levels = [values]  # node values, leaves first: [N, K, S], [N, K/2, S], ..., [N, 1, S]
        width = k // 2
        while width >= 1:
            left, right = levels[-1].view(n, width, 2, s).unbind(2)
            levels.append(torch.lerp(right, left, gammas[:, width - 1 : 2 * width - 1]))
            width //= 2
        ctx.save_for_backward(gammas, *levels[:-1])
        ctx.gate_dtype = gate_logits.dtype
        return levels[-1].view(n, s)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gammas, *levels = ctx.saved_tensors
        n, _, s = levels[0].shape
        grad_gates = torch.empty_like(gammas)
        grad = grad_out.reshape(n, 1, s)
        width = 1
        for children in reversed(levels):  # top down
            gamma = gammas[:, width - 1 : 2 * width - 1]
            left, right = children.view(n, width, 2, s).unbind(2)
            # d node / d pre-activation = (left - right) * sigmoid' = (left - right) g (1 - g)
            grad_gate = grad_gates[:, width - 1 : 2 * width - 1]
            torch.sub(left, right, out=grad_gate)
            grad_gate.mul_(grad).mul_(gamma).mul_(1 - gamma)
            grad_children = grad.new_empty(n, width, 2, s)
            torch.mul(grad, gamma, out=grad_children[:, :, 0])
            torch.sub(grad, grad_children[:, :, 0], out=grad_children[:, :, 1])
            grad = grad_children.view(n, 2 * width, s)
            width *= 2
        return grad_gates.to(ctx.gate_dtype), grad


class _FrequentThenRareLogits(torch.autograd.Function):
    """``[frequent | mixed W_rare^T + b_rare]`` as one ``[N, V]`` tensor.

    The rare block's product is written straight into its columns of the output, so the
    ``[N, V]`` logits are not copied again by a ``torch.cat`` (and its backward only views
    the gradient's two blocks).
    """

    @staticmethod
    def forward(
        ctx,
        frequent: torch.Tensor,
        mixed: torch.Tensor,
        w_rare: torch.Tensor,
        b_rare: torch.Tensor,
    ) -> torch.Tensor:
        # under autocast, the products run in the dtype the frequent logits came in
        dtype = frequent.dtype
        n, s = frequent.shape
        out = frequent.new_empty(n, s + w_rare.size(0))
        out[:, :s].copy_(frequent)
        with torch.autocast(mixed.device.type, enabled=False):
            torch.addmm(b_rare.to(dtype), mixed.to(dtype), w_rare.to(dtype).t(), out=out[:, s:])
        ctx.save_for_backward(mixed, w_rare)
        ctx.num_frequent = s
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        mixed, w_rare = ctx.saved_tensors
        s = ctx.num_frequent
        grad_rare = grad[:, s:]
        grad_mixed = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_mixed = (grad_rare @ w_rare.to(grad.dtype)).to(mixed.dtype)
        if ctx.needs_input_grad[2]:
            grad_w = (grad_rare.t() @ mixed.to(grad.dtype)).to(w_rare.dtype)
        if ctx.needs_input_grad[3]:
            grad_b = grad_rare.sum(0).to(w_rare.dtype)
        return grad[:, :s], grad_mixed, grad_w, grad_b


def _tree_levels(values: torch.Tensor, gammas: torch.Tensor):
    """The sigmoid tree's levels, bottom up, as views of the ``[N, K, S]`` leaves.

    Yields ``(left, right, gamma)``, each ``[N, nodes, S]``. A node lives in the slot of
    the rightmost leaf under it, so each level's left and right children are two strided
    views of the same buffer and the tree runs in place: the left slot keeps
    ``left - right`` (what the backward needs) and the right slot the node's value.
    """
    n, k, s = values.shape
    span = 1  # leaves under each child
    while span < k:
        nodes = k // (2 * span)
        pairs = values.view(n, nodes, 2, span, s)
        yield pairs[:, :, 0, -1], pairs[:, :, 1, -1], gammas[:, nodes - 1 : 2 * nodes - 1]
        span *= 2


# -- the frequent tokens' block of the training loss ------------------------------------
def mixtape_frequent_lse(
    gate_inputs: torch.Tensor,
    gate_weights: torch.Tensor,
    contexts: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    target: torch.Tensor,
    logit_sum: bool,
    gate_noise: float,
    options,
):
    """``(lse, target logit, logit sum or None)`` per row over the S frequent tokens' gated
    logits (Eq. 2-4), block by block over the S columns with nothing ``[N, K, S]`` kept
    beyond ``options.saved_bytes``. ``target`` outside ``[0, S)``: no target logit."""
    n, k, _ = contexts.shape
    resolve_backend(options.backend, contexts)  # cce/liger: CUDA only; the torch path runs
    # a block holds [N, K-1, w] gates, [N, K, w] values and [N, w] logits: 2K floats a column
    _, width = plan_tiles(n, weight.size(0), contexts.device, options, entries_per_column=2 * k)
    saved = options.saved_bytes
    lse, target_logit, total = _MixtapeFrequentLSE.apply(
        gate_inputs, gate_weights, contexts, weight, bias, target, logit_sum,
        compute_dtype(contexts, weight), width, saved, float(gate_noise),
    )  # fmt: skip
    return LinearLSE(lse, target_logit, total if logit_sum else None)


def _frequent_block(
    flat_inputs: torch.Tensor,
    flat_contexts: torch.Tensor,
    gate_weights: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    noise: torch.Tensor | None,
    noise_std: float,
    shape: tuple[int, int],
    acc: torch.dtype,
    buffer: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block of columns: ``(gammas [N, K-1, w], values [N, K, w], logits [N, w])``,
    written into ``buffer`` (flat storage of ``2K N w`` entries reused from block to block;
    see ``heads.fused_cross_entropy.chunk_buffer``) when one is given.

    Eq. 4 then the sigmoids of Eq. 3, in place; ``h_{c,k} . w_x``, then the tree (Eq. 2-3) in
    place, which leaves ``left - right`` in each node's left slot for the backward
    (``_tree_levels``); the bias after the tree (``sum_k pi = 1``), on ``[N, w]`` only."""
    n, k = shape
    width = weight.size(0)
    gates_out = values_out = logits_out = None
    if buffer is not None:
        sizes = [n * (k - 1) * width, n * k * width, n * width]
        gates_out, values_out, logits_out = buffer[: sum(sizes)].split(sizes)
    gammas = chunk_logits(flat_inputs, gate_weights, None, acc, gates_out)
    gammas = gammas.view(n, k - 1, width)
    if noise is not None:
        gammas.add_(noise, alpha=noise_std)
    gammas.sigmoid_()
    values = chunk_logits(flat_contexts, weight, None, acc, values_out).view(n, k, width)
    logits = None
    for left, right, gamma in _tree_levels(values, gammas):
        left.sub_(right)
        if right.size(1) > 1:
            right.addcmul_(gamma, left)
        elif logits_out is None:  # the root: this block's logits, a new [N, w] tensor
            logits = torch.addcmul(right, gamma, left).squeeze(1)
        else:
            logits = torch.addcmul(right, gamma, left, out=logits_out.view(n, 1, width))
            logits = logits.view(n, width)
    return gammas, values, logits.add_(bias.to(acc))


def _into(out: torch.Tensor, op, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = op(a, b)`` for a strided view ``out``: straight into it eagerly, through a
    temporary under ``torch.compile`` (which fuses it; Dynamo refuses strided ``out=``)."""
    if torch.compiler.is_compiling():
        return out.copy_(op(a, b))
    return op(a, b, out=out)


def _rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


class _ReplayNoise:
    """The gate noise of the blocks not kept, drawn again in the backward exactly as in the
    forward: the generator is set back to its state before the first such block (and restored
    after), and the blocks are drawn in the same order and shapes. Under ``torch.compile``
    (no generator state to trace) the forward keeps those blocks' noise instead."""

    def __init__(self, state: torch.Tensor | None, kept: list[torch.Tensor], device) -> None:
        self.state, self.kept, self.device = state, kept, device
        self.fork = None

    def __enter__(self) -> _ReplayNoise:
        if self.state is not None:
            devices = [self.device] if self.device.type == "cuda" else []
            self.fork = torch.random.fork_rng(devices=devices)
            self.fork.__enter__()
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(self.state, self.device)
            else:
                torch.set_rng_state(self.state)
        return self

    def next(self, shape, dtype) -> torch.Tensor:
        if self.state is None:
            return self.kept.pop(0)
        return torch.randn(shape, dtype=dtype, device=self.device)

    def __exit__(self, *exc) -> None:
        if self.fork is not None:
            self.fork.__exit__(*exc)


class _MixtapeFrequentLSE(torch.autograd.Function):
    """The frequent tokens' part of Mixtape's loss (Eq. 2-4) by vocabulary blocks.

    Inputs: ``gate_inputs`` ``[N, K-1, e]`` and ``gate_weights`` ``[S, e]``, whose product is
    the gate pre-activations (``MixtapeHead._pieces``), ``contexts`` ``[N, K, d]``, ``weight``
    ``[S, d]``, ``bias`` ``[S]``, ``target`` ``[N]``. Outputs per row: the block's
    log-sum-exp, the target logit (0 for targets outside ``[0, S)``) and the logit sum.

    The forward keeps a block's gates, tree and probabilities for the backward while they fit
    ``saved_bytes`` (a prefix of the blocks) and recomputes the others in the backward. The
    backward is written by hand: ``dL/dz = g p + g_t onehot + g_s`` for one block, the tree
    top down in buffers allocated once (a node's gradient sits in its own slot, as its value
    did), then four products into the gradients of the contexts, ``W``, the gate inputs and
    the gate weights.
    """

    @staticmethod
    def forward(
        ctx,
        gate_inputs,
        gate_weights,
        contexts,
        weight,
        bias,
        target,
        want_sum: bool,
        dtype: torch.dtype,
        width: int,
        saved_bytes: int,
        noise_std: float,
    ):
        acc = accumulation_dtype(contexts, weight)
        n, k, d = contexts.shape
        s = weight.size(0)
        flat_inputs = gate_inputs.reshape(n * (k - 1), -1).to(dtype)
        flat_contexts = contexts.reshape(n * k, d).to(dtype)
        top = contexts.new_full((n,), -math.inf, dtype=acc)
        total = contexts.new_zeros(n, dtype=acc)
        target_logit = contexts.new_zeros(n, dtype=acc)
        logit_sum = contexts.new_zeros(n, dtype=acc)
        compiling = torch.compiler.is_compiling()
        noise_state, noise_kept, blocks = None, [], []
        budget = saved_bytes
        buffer = None
        for a, b in spans(s, width):
            keep = False  # a prefix of the blocks is kept: the backward counts them
            if budget > 0:
                budget -= n * (2 * k) * (b - a) * torch.finfo(acc).bits // 8
                keep = budget >= 0
            noise = None
            if noise_std > 0:
                if not keep and noise_state is None and not compiling:
                    noise_state = _rng_state(contexts.device)
                noise = torch.randn(n, k - 1, b - a, dtype=acc, device=contexts.device)
                if not keep and compiling:
                    noise_kept.append(noise)
            if not keep and buffer is None:
                buffer = chunk_buffer(contexts, n * 2 * k, width, acc)
            gammas, values, logits = _frequent_block(
                flat_inputs, flat_contexts, gate_weights[a:b], weight[a:b], bias[a:b], noise,
                noise_std, (n, k), acc, None if keep else buffer,
            )  # fmt: skip
            inside, column = target_columns(target, a, b)
            target_logit = torch.where(inside, logits.gather(1, column).squeeze(1), target_logit)
            if want_sum:
                logit_sum += logits.sum(1)
            block_top, block_total = exp_sum_(logits)  # logits now hold their exps
            top, total = combine_chunk(top, total, block_top, block_total)
            if keep:
                blocks.append((gammas, values, logits, block_top))
        lse = top + total.log()
        kept = []
        for gammas, values, exps, shift in blocks:  # exp(z - m_b) e^(m_b - lse) = p
            kept += [gammas, values, exps.mul_(torch.exp(shift - lse).unsqueeze(1))]
        ctx.save_for_backward(
            gate_inputs, gate_weights, contexts, weight, bias, target, lse, noise_state,
            *noise_kept, *kept,
        )  # fmt: skip
        ctx.counts = len(noise_kept), len(blocks)
        ctx.layout = dtype, width, noise_std
        ctx.want_sum = want_sum
        return lse, target_logit, logit_sum

    @staticmethod
    def backward(ctx, grad_lse, grad_target, grad_sum):
        gate_inputs, gate_weights, contexts, weight, bias, target, lse, noise_state, *rest = (
            ctx.saved_tensors
        )
        num_noise, num_kept = ctx.counts
        noise_kept, kept = rest[:num_noise], rest[num_noise:]
        dtype, width, noise_std = ctx.layout
        acc = lse.dtype
        n, k, d = contexts.shape
        s = weight.size(0)
        flat_inputs = gate_inputs.reshape(n * (k - 1), -1).to(dtype)
        flat_contexts = contexts.reshape(n * k, d).to(dtype)
        g = grad_lse.to(acc).unsqueeze(1)
        inside_any = (target >= 0) & (target < s)
        g_t = torch.where(inside_any, grad_target.to(acc), 0.0).unsqueeze(1)
        g_s = grad_sum.to(acc).unsqueeze(1) if ctx.want_sum and grad_sum is not None else None
        # the first block writes the input gradients, the others add to them
        new = torch.empty if s else torch.zeros
        grad_contexts = new(n * k, d, dtype=acc, device=contexts.device)
        grad_inputs = new(flat_inputs.shape, dtype=acc, device=contexts.device)
        grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device)
        grad_gate_weights = torch.empty(gate_weights.shape, dtype=acc, device=weight.device)
        grad_bias = torch.empty(s, dtype=acc, device=weight.device)
        # one block's tree gradients at a time, in buffers allocated once
        most = min(s, width)
        grad_values_buffer = contexts.new_empty(n * k * most, dtype=acc)
        grad_gates_buffer = contexts.new_empty(n * (k - 1) * most, dtype=acc)
        buffer = (
            None
            if num_kept == len(spans(s, width))
            else chunk_buffer(contexts, n * 2 * k, width, acc)
        )
        with _ReplayNoise(noise_state, list(noise_kept), contexts.device) as noise_source:
            for index, (a, b) in enumerate(spans(s, width)):
                w = b - a
                if index < num_kept:
                    gammas, values, probs = kept[3 * index : 3 * index + 3]
                    grad = probs * g
                else:
                    noise = None
                    if noise_std > 0:
                        noise = noise_source.next((n, k - 1, w), acc)
                    gammas, values, logits = _frequent_block(
                        flat_inputs, flat_contexts, gate_weights[a:b], weight[a:b], bias[a:b],
                        noise, noise_std, (n, k), acc, buffer,
                    )  # fmt: skip
                    grad = exp_shifted_(logits, lse).mul_(g)
                inside, column = target_columns(target, a, b)
                grad.scatter_add_(1, column, g_t * inside.unsqueeze(1))
                if g_s is not None:
                    grad.add_(g_s)
                grad_bias[a:b] = grad.sum(0)
                grad_values = grad_values_buffer[: n * k * w].view(n, k, w)
                grad_gates = grad_gates_buffer[: n * (k - 1) * w].view(n, k - 1, w)
                for (diff, _, gamma), (grad_left, grad_right, grad_gate) in zip(
                    reversed(list(_tree_levels(values, gammas))),
                    reversed(list(_tree_levels(grad_values, grad_gates))),
                    strict=True,
                ):
                    grad_node = grad.view(n, 1, w) if grad_right.size(1) == 1 else grad_right
                    _into(grad_left, torch.mul, grad_node, gamma)
                    _into(grad_right, torch.sub, grad_node, grad_left)
                    # d node / d pre-activation = (left - right) gamma (1 - gamma)
                    _into(grad_gate, torch.mul, grad_right, gamma).mul_(diff)
                flat_values = grad_values.view(n * k, w).to(dtype)
                flat_gates = grad_gates.view(n * (k - 1), w).to(dtype)
                # straight into the gradients: no [N K, d] temporary per block
                later = index > 0
                accumulate_mm(grad_contexts, flat_values, as_dtype(weight[a:b], dtype), later)
                accumulate_mm(grad_weight[a:b], flat_values.t(), flat_contexts, False)
                gates_w = as_dtype(gate_weights[a:b], dtype)
                accumulate_mm(grad_inputs, flat_gates, gates_w, later)
                accumulate_mm(grad_gate_weights[a:b], flat_gates.t(), flat_inputs, False)
        return (
            grad_inputs.view(gate_inputs.shape).to(gate_inputs.dtype),
            grad_gate_weights.to(gate_weights.dtype),
            grad_contexts.view(contexts.shape).to(contexts.dtype),
            grad_weight.to(weight.dtype),
            grad_bias.to(bias.dtype),
            *([None] * 6),
        )
