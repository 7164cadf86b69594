"""Mixtape output layer (Yang, Luong, Salakhutdinov, Le, NeurIPS 2019; mixtape.txt).

One softmax over vector-gated logits (Eq. 2)::

    logit_{c,x} = sum_k pi_{c,x,k} (h_{c,k} . w_x) + b_x

with priors from a sigmoid tree (Eq. 3) over gate pre-activations (Eq. 4)
``l_{c,x,k} = v_x . tanh(U_k g_c) + u_k . g_c + b_{x,k}`` for the S most frequent tokens,
and the shared ``l_{c,k} = u_k . g_c`` (Eq. 6) for all others. Context embeddings
``h_{c,k} = tanh(H_k g_c)`` (Eq. 5). For the shared-gate tokens the K contexts are mixed
first and multiplied with ``W`` once, so no ``[N, K, V]`` tensor is built.

Training (``forward``) computes the loss with ``_MixtapeCrossEntropy``: the same equations,
by blocks of the vocabulary, with a hand-written backward and no ``[N, V]`` tensor;
``logits`` / ``log_prob`` and autocast keep the plain autograd path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from heads.base import HeadOutput, SingleSoftmaxHead, check_label_smoothing, check_positive_int
from heads.cross_entropy import HALF_DTYPES, IGNORE_INDEX, ROW_ALIGN, add_exp_sums_
from heads.errors import HeadConfigError


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


def _zipf_log_prior(vocab_size: int) -> torch.Tensor:
    """Centred ``log p(x)`` of a Zipf law over ids sorted by decreasing frequency (rank x + 1).

    The initial logits then carry the unigram's shape, so the first gradients are about the
    context, not about the one direction shared by every context. Fitting that shared direction
    through Eq. 5's ``tanh(H_k g_c)`` (bounded, unlike the softmax's ``W g_c``) pushes every
    context to the same saturated corner, where the tanh gradients vanish. Measured on PTB
    (tied LSTM 64, the issue's dropouts, Adam 5e-3, 20 updates, seeds 1-3): mean |g_c|
    0.88-0.95 and 68-78% of ``|H_k g_c|`` above 3 with a zero bias, 0.09 and 0% with this
    prior (docs/results/mixtape_stability_cpu.json).
    """
    log_prior = -torch.arange(1, vocab_size + 1, dtype=torch.float64).log()
    return (log_prior - log_prior.mean()).float()


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
            context-free plateau (issue 18's seed-7 run; see ``_zipf_log_prior``).
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
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        self.gate_dropout = nn.Dropout(gate_dropout)
        self.context_dropout = nn.Dropout(context_dropout)
        nn.init.normal_(self.weight, std=embedding_size**-0.5)
        nn.init.normal_(self.gate_embedding, std=gate_embedding_size**-0.5)
        self.zipf_bias_init = zipf_bias_init
        if zipf_bias_init:
            with torch.no_grad():
                self.bias.copy_(_zipf_log_prior(vocab_size))

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

    def forward(
        self, hidden: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
    ) -> HeadOutput:
        """The loss without the ``[N, V]`` logits tensor: see ``_MixtapeCrossEntropy``.

        Under autocast or with mixed dtypes it takes the ``logits`` path instead (products in
        the autocast dtype, softmax and loss in float32).
        """
        device = hidden.device.type
        if (
            torch.is_autocast_enabled(device)
            or hidden.dtype in HALF_DTYPES
            or any(p.dtype != hidden.dtype for p in self.parameters())
        ):
            return super().forward(hidden, target, label_smoothing)
        self.check_inputs(hidden, target)
        check_label_smoothing(label_smoothing)
        contexts, gate_inputs, gate_weights, shared = self._pieces(hidden)
        mixed = None
        if self.num_frequent < self.vocab_size:
            mixed = self._mixed_context(contexts, shared)
        noise = self.gate_noise if self.training else 0.0
        nll, smoothing = _MixtapeCrossEntropy.apply(
            gate_inputs, gate_weights, contexts, mixed, self.weight, self.bias, target, noise
        )
        return self.output(nll, target, smoothing=smoothing, label_smoothing=label_smoothing)


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


def _column_blocks(start: int, stop: int, width: int) -> list[tuple[int, int]]:
    """``[start, stop)`` in blocks of at most ``width`` columns, of (nearly) equal sizes, each
    but the last a multiple of ``ROW_ALIGN`` columns when ``width`` is (MKL's sgemm is markedly
    slower on unaligned output rows: see ``heads.cross_entropy``)."""
    count = -(-(stop - start) // width)
    if count:
        balanced = -(-(stop - start) // count)
        aligned = -(-balanced // ROW_ALIGN) * ROW_ALIGN
        width = min(width, aligned) if width % ROW_ALIGN == 0 else balanced
    return [(a, min(stop, a + width)) for a in range(start, stop, width)]


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


# A block of the vocabulary holds about this many [N, block] (rare) or [N, K, block]
# (frequent) entries: 16 MiB in float32, under glibc's largest mmap threshold (32 MiB), so
# the blocks of one step reuse the memory that the step before freed instead of faulting
# in fresh pages (touching a fresh [2048, 30k] float32 tensor costs ~0.55 ms per MiB here).
_BLOCK_ELEMENTS = 1 << 22
# On a GPU the caching allocator reuses freed memory whatever its size, and each block costs
# some 25 kernel launches: 256 MiB blocks (measured on an H100, V = 10k, N = 16k tokens:
# 23 ms per step against 35 ms with the CPU's blocks; README, "On a GPU").
_ACCELERATOR_BLOCK_ELEMENTS = 1 << 26
_MIN_BLOCK = 128  # columns: keeps each block's products real GEMMs when N is very large


def _block_widths(n: int, k: int, device_type: str = "cpu") -> tuple[int, int]:
    """Columns per frequent block ``[N, K, block]`` and per rare block ``[N, block]``,
    multiples of ``ROW_ALIGN`` so that ``_column_blocks`` keeps the blocks aligned."""
    elements = _BLOCK_ELEMENTS if device_type == "cpu" else _ACCELERATOR_BLOCK_ELEMENTS
    frequent = elements // (n * k) // ROW_ALIGN * ROW_ALIGN
    rare = elements // n // ROW_ALIGN * ROW_ALIGN
    return max(_MIN_BLOCK, frequent), max(_MIN_BLOCK, rare)


class _MixtapeCrossEntropy(torch.autograd.Function):
    """Mixtape's loss (Eq. 2-6) from its factors, forward and backward written by hand.

    Inputs: ``gate_inputs`` ``[N, K-1, e]`` and ``gate_weights`` ``[S, e]`` whose product is
    the frequent tokens' gate pre-activations (``MixtapeHead._pieces``), ``contexts``
    ``[N, K, d]``, ``mixed`` ``[N, d]`` (the contexts under the shared prior; None when
    S = V), ``weight`` ``[V, d]``, ``bias`` ``[V]``, ``target`` ``[N]``. Outputs, per row
    and 0 where ignored: the NLL ``log Z - z_t`` and label smoothing's ``log Z - mean_x z_x``
    (their gradients combine into ``dL/dz = (s1 + s2) p - s1 onehot_t - s2 / V``).

    Beyond the products, the time on a CPU goes to allocating and touching big tensors:

    - the vocabulary is cut into column blocks (the frequent tokens', then the rare ones'),
      each block's tensors small enough to reuse freed memory (``_BLOCK_ELEMENTS``): no
      ``[N, V]`` tensor, no copy into one, no ``cat``;
    - every product is one ``mm`` on contiguous 2-D operands into a contiguous output; the
      gradients of ``W``, ``b`` and the gate weights are written block by block into their
      rows;
    - the sigmoids and the tree run in place on the products' outputs (no priors, no
      ``[N, K, S]`` copies), and the bias is added after the tree, on ``[N, block]``;
    - the softmax is ``E = exp(z - M)`` in place, ``M`` the row's maximum over all blocks,
      so every block shares one normaliser ``Z = sum E``. As in
      ``heads.cross_entropy._LinearCrossEntropy``, the rare blocks' backward goes straight
      to the products (``dL/dmixed = (s / Z) sum_b E_b W_b - s W[t]``, ``dL/dW_b =
      E_b^T (s / Z) mixed - ...``): their gradient is never formed, and the frequent blocks'
      gradient ``s (E / Z - onehot)`` and tree gradients exist for one block at a time.
    """

    @staticmethod
    def forward(
        ctx,
        gate_inputs: torch.Tensor,
        gate_weights: torch.Tensor,
        contexts: torch.Tensor,
        mixed: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor,
        target: torch.Tensor,
        gate_noise: float,
    ) -> torch.Tensor:
        n, k, d = contexts.shape
        s, v = gate_weights.size(0), weight.size(0)
        frequent_width, rare_width = _block_widths(n, k, contexts.device.type)
        flat_inputs = gate_inputs.reshape(n * (k - 1), -1)
        flat_contexts = contexts.reshape(n * k, d)
        keep = target != IGNORE_INDEX
        safe_target = target.clamp_min(0)
        target_logit = contexts.new_zeros(n)
        logit_blocks, tree_blocks, row_max = [], [], []
        logit_sum = contexts.new_zeros(n)  # sum_x z_x, for label smoothing

        def add_logits(logits: torch.Tensor, start: int) -> None:
            nonlocal target_logit, logit_sum
            logit_sum = logit_sum + logits.sum(1)
            inside = (safe_target >= start) & (safe_target < start + logits.size(1))
            column = (safe_target - start).clamp(0, logits.size(1) - 1).unsqueeze(1)
            target_logit = torch.where(inside, logits.gather(1, column).squeeze(1), target_logit)
            row_max.append(logits.amax(1))
            logit_blocks.append(logits)

        for start, stop in _column_blocks(0, s, frequent_width):
            # Eq. 4 then the sigmoids of Eq. 3, in place: [N, K-1, block]
            gammas = torch.mm(flat_inputs, gate_weights[start:stop].t())
            gammas = gammas.view(n, k - 1, stop - start)
            if gate_noise > 0:
                gammas.add_(torch.randn_like(gammas), alpha=gate_noise)
            gammas.sigmoid_()
            # h_{c,k} . w_x: [N, K, block], then the tree (Eq. 2-3) in place
            values = torch.mm(flat_contexts, weight[start:stop].t()).view(n, k, stop - start)
            for left, right, gamma in _tree_levels(values, gammas):
                left.sub_(right)
                if right.size(1) > 1:
                    right.addcmul_(gamma, left)
                else:  # the root: this block's logits, a new [N, block] tensor
                    logits = torch.addcmul(right, gamma, left).squeeze(1)
            add_logits(logits.add_(bias[start:stop]), start)
            tree_blocks += [gammas, values]  # what the backward needs: gammas, left - right
        if mixed is not None:  # the infrequent tokens: one product per block (Eq. 6)
            for start, stop in _column_blocks(s, v, rare_width):
                add_logits(torch.addmm(bias[start:stop], mixed, weight[start:stop].t()), start)

        top = torch.stack(row_max).amax(0)
        normaliser = torch.zeros_like(top)
        for logits in logit_blocks:  # E = exp(z - M) in place
            # floored as in _LinearCrossEntropy: no subnormal exps
            add_exp_sums_(logits, top, normaliser)
        ctx.save_for_backward(
            gate_inputs, gate_weights, contexts, mixed, weight, normaliser, safe_target, keep,
            *logit_blocks, *tree_blocks,
        )  # fmt: skip
        ctx.widths = frequent_width, rare_width
        ctx.set_materialize_grads(False)
        log_normaliser = top + normaliser.log()
        nll = (log_normaliser - target_logit).masked_fill(~keep, 0.0)
        smoothing = (log_normaliser - logit_sum / v).masked_fill(~keep, 0.0)
        return nll, smoothing

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_nll: torch.Tensor | None, grad_smoothing: torch.Tensor | None):
        gate_inputs, gate_weights, contexts, mixed, weight, normaliser, safe_target, keep = (
            ctx.saved_tensors[:8]
        )
        saved = ctx.saved_tensors[8:]
        n, k, d = contexts.shape
        s, v = gate_weights.size(0), weight.size(0)
        frequent_width, rare_width = ctx.widths
        frequent = _column_blocks(0, s, frequent_width)
        rare = _column_blocks(s, v, rare_width) if mixed is not None else []
        logit_blocks = saved[: len(frequent) + len(rare)]
        tree_blocks = saved[len(frequent) + len(rare) :]
        flat_inputs = gate_inputs.reshape(n * (k - 1), -1)
        flat_contexts = contexts.reshape(n * k, d)

        # dL/dz = (s1 + s2) p - s1 onehot_t - s2 / V with s1, s2 the two outputs' gradients
        # (an output the loss did not use has no gradient: set_materialize_grads(False))
        if grad_nll is None:
            grad_nll = torch.zeros_like(normaliser)
        scale = grad_nll.masked_fill(~keep, 0.0)  # s1: the onehot terms' scale
        uniform = None  # s2 / V per row, when label smoothing was used
        total = scale
        if grad_smoothing is not None:
            smooth = grad_smoothing.masked_fill(~keep, 0.0)
            total, uniform = scale + smooth, smooth / v
        prob_scale = (total / normaliser).unsqueeze(1)  # (s1 + s2) / Z: E / Z are the probs
        target_rows = scale.unsqueeze(1)
        grad_weight = weight.new_empty(weight.shape)
        grad_bias = weight.new_empty(v)
        grad_contexts = contexts.new_empty(n * k, d)
        grad_gate_inputs = gate_inputs.new_empty(flat_inputs.shape)
        grad_gate_weights = gate_weights.new_empty(gate_weights.shape)
        # one block's gradients at a time, in buffers allocated once
        grad_buffer = contexts.new_empty(n * min(s, frequent_width))
        grad_values_buffer = contexts.new_empty(n * k * min(s, frequent_width))
        grad_gates_buffer = contexts.new_empty(n * (k - 1) * min(s, frequent_width))
        for index, (start, stop) in enumerate(frequent):
            width = stop - start
            probs = logit_blocks[index]
            gammas, values = tree_blocks[2 * index : 2 * index + 2]
            torch.mv(probs.t(), prob_scale.squeeze(1), out=grad_bias[start:stop])
            # s (E / Z - onehot): [N, block]
            grad = torch.mul(probs, prob_scale, out=grad_buffer[: n * width].view(n, width))
            inside = ((safe_target >= start) & (safe_target < stop)).unsqueeze(1)
            column = (safe_target - start).clamp(0, width - 1).unsqueeze(1)
            grad.scatter_add_(1, column, -target_rows * inside)
            if uniform is not None:
                grad.sub_(uniform.unsqueeze(1))
            grad_values = grad_values_buffer[: n * k * width].view(n, k, width)
            grad_gates = grad_gates_buffer[: n * (k - 1) * width].view(n, k - 1, width)
            # the tree, top down: a node's gradient sits in its own slot, as its value did
            for (diff, _, gamma), (grad_left, grad_right, grad_gate) in zip(
                reversed(list(_tree_levels(values, gammas))),
                reversed(list(_tree_levels(grad_values, grad_gates))),
                strict=True,
            ):
                grad_node = grad.view(n, 1, width) if grad_right.size(1) == 1 else grad_right
                torch.mul(grad_node, gamma, out=grad_left)
                torch.sub(grad_node, grad_left, out=grad_right)
                # d node / d pre-activation = (left - right) gamma (1 - gamma)
                torch.mul(grad_right, gamma, out=grad_gate).mul_(diff)
            flat_values = grad_values.view(n * k, width)
            flat_gates = grad_gates.view(n * (k - 1), width)
            _mm_into(grad_contexts, flat_values, weight[start:stop], index > 0)
            torch.mm(flat_values.t(), flat_contexts, out=grad_weight[start:stop])
            _mm_into(grad_gate_inputs, flat_gates, gate_weights[start:stop], index > 0)
            torch.mm(flat_gates.t(), flat_inputs, out=grad_gate_weights[start:stop])

        grad_mixed = None
        if mixed is not None:
            # dL/dmixed = (s / Z) sum_b E_b W_b - s W[t],  dL/dW_b = E_b^T (s / Z) mixed - ...
            grad_mixed = mixed.new_empty(mixed.shape)
            scaled_mixed = mixed * prob_scale
            for index, (start, stop) in enumerate(rare):
                probs = logit_blocks[len(frequent) + index]
                _mm_into(grad_mixed, probs, weight[start:stop], index > 0)
                torch.mm(probs.t(), scaled_mixed, out=grad_weight[start:stop])
                torch.mv(probs.t(), prob_scale.squeeze(1), out=grad_bias[start:stop])
            rare_rows = target_rows * (safe_target >= s).unsqueeze(1)
            grad_mixed.mul_(prob_scale).sub_(weight.index_select(0, safe_target) * rare_rows)
            grad_weight.index_add_(0, safe_target, mixed * rare_rows, alpha=-1)
            if uniform is not None:  # -s2 / V for every rare column
                grad_mixed.sub_(uniform.unsqueeze(1) * weight[s:].sum(0))
                grad_weight[s:].sub_(uniform @ mixed)
        grad_bias.index_add_(0, safe_target, scale, alpha=-1)  # the onehot, every target
        if uniform is not None:
            grad_bias.sub_(uniform.sum())
        return (
            grad_gate_inputs.view(gate_inputs.shape),
            grad_gate_weights,
            grad_contexts.view(contexts.shape),
            grad_mixed,
            grad_weight,
            grad_bias,
            None,
            None,
        )
