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
        gammas = torch.sigmoid(self._noisy(gate_logits))
        # h_{c,k} . w_x + b_x per component: the bias can go inside since sum_k pi = 1.
        values = F.linear(contexts, w_freq, b_freq)  # [N, K, S]
        # Eq. 2-3 without forming the priors: sum_k pi_k z_k over the sigmoid tree is a
        # nested interpolation, node value = gamma * left + (1 - gamma) * right, bottom up.
        width = k // 2
        while width >= 1:
            level = gammas[:, width - 1 : 2 * width - 1]  # heap nodes of this depth
            # unbind, not strided slices: its backward stacks, slices' would zero-fill [N, K, S]
            left, right = values.view(n, width, 2, s).unbind(2)
            values = torch.lerp(right, left, level.to(values.dtype))
            width //= 2
        frequent_logits = values.squeeze(1)
        if s == self.vocab_size:
            return frequent_logits

        # Infrequent tokens: one shared prior; mix the contexts first, then one matmul.
        shared_priors = sigmoid_tree_priors(self._noisy(shared_gate_logits))  # [N, K]
        mixed_context = torch.bmm(shared_priors.unsqueeze(1), contexts).squeeze(1)
        rare_logits = F.linear(mixed_context, w_rare, b_rare)
        return torch.cat((frequent_logits, rare_logits), dim=-1)
