"""Mixtape output layer (Yang, Luong, Salakhutdinov, Le, NeurIPS 2019; mixtape.txt).

One softmax over vector-gated logits (Eq. 2)::

    logit_{c,x} = sum_k pi_{c,x,k} (h_{c,k} . w_x) + b_x

with priors from a sigmoid tree (Eq. 3) over gate pre-activations (Eq. 4)
``l_{c,x,k} = v_x . tanh(U_k g_c) + u_k . g_c + b_{x,k}`` for the S most frequent tokens,
and the shared ``l_{c,k} = u_k . g_c`` (Eq. 6) for all others. Context embeddings
``h_{c,k} = tanh(H_k g_c)`` (Eq. 5). For the shared-gate tokens the K contexts are mixed
first and multiplied with ``W`` once, so no ``[N, K, V]`` tensor is built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from heads.base import HeadConfigError, SingleSoftmaxHead, check_positive_int


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

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vector-gated logits ``[N, V]`` (Eq. 2 before the softmax)."""
        n, s = hidden.size(0), self.num_frequent
        k, d2 = self.num_components, self.gate_embedding_size
        contexts = self.context_dropout(torch.tanh(self.context(hidden)).view(n, k, -1))  # Eq. 5
        if s < self.vocab_size:
            w_freq, w_rare = self.weight.split([s, self.vocab_size - s])
            b_freq, b_rare = self.bias.split([s, self.vocab_size - s])
        else:
            w_freq, b_freq = self.weight, self.bias

        # Gate pre-activations shared by every token: u_k . g_c  (Eq. 6)
        shared_gate_logits = self.gate_context(hidden)  # [N, K-1]

        # Frequent tokens, Eq. 4: v_x . tanh(U_k g_c) + u_k . g_c + b_{x,k}   -> [N, K-1, S]
        gate_hidden = torch.tanh(
            F.linear(hidden, self._gate_projection_weight(), self.gate_projection.bias)
        )
        gate_hidden = self.gate_dropout(gate_hidden).view(n, self.num_gates, d2)
        gate_logits = (  # one [N (K-1), d2] x [d2, S] product, then broadcast adds
            torch.matmul(gate_hidden, self.gate_embedding.t())
            + self.gate_bias.t()
            + shared_gate_logits.unsqueeze(-1)
        )
        values = F.linear(contexts, w_freq, b_freq)  # [N, K, S]; bias inside as sum_k pi = 1
        frequent_logits = _SigmoidTreeMix.apply(self._noisy(gate_logits), values)  # Eq. 2-3
        if s == self.vocab_size:
            return frequent_logits

        # Infrequent tokens: one shared prior; mix the contexts first, then one matmul.
        shared_priors = sigmoid_tree_priors(self._noisy(shared_gate_logits))  # [N, K]
        mixed_context = torch.bmm(shared_priors.unsqueeze(1), contexts).squeeze(1)
        return _FrequentThenRareLogits.apply(frequent_logits, mixed_context, w_rare, b_rare)


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
