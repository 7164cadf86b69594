"""The sigmoid tree of Mixtape's priors (Eq. 3), in one place: its layout and its three uses.

K leaves (a power of two) under K - 1 internal nodes kept in heap order (node j has children
2j+1 and 2j+2), so the level with ``nodes`` nodes is the slice ``heap_level(nodes)`` of the
gates and the levels run ``level_widths(K) = 1, 2, ..., K/2`` from the root. A node's value
is ``gamma * left + (1 - gamma) * right``; a leaf's prior is the product of ``gamma`` or
``1 - gamma`` along its path. Three evaluations of that one tree, each in the form its caller
needs (their float results are not bitwise equal, so none replaces another):

- ``sigmoid_tree_priors``: the priors ``[..., K]`` themselves (the shared gates, Eq. 6);
- ``SigmoidTreeMix``: ``sum_k pi_k v_k`` over ``[N, K, S]`` without the priors (evaluation
  logits), a lerp per level and a hand-written backward;
- ``tree_levels``: the same mix in place in one buffer (the training loss's blocks,
  ``heads/kernels/mixtape_frequent.py``).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def level_widths(num_leaves: int) -> list[int]:
    """Nodes per internal level, root first: ``1, 2, 4, ..., num_leaves / 2``."""
    widths, nodes = [], 1
    while nodes < num_leaves:
        widths.append(nodes)
        nodes *= 2
    return widths


def heap_level(nodes: int) -> slice:
    """The gates of the level with ``nodes`` nodes: ``[nodes - 1, 2 nodes - 1)`` in heap order."""
    return slice(nodes - 1, 2 * nodes - 1)


def sigmoid_tree_priors(gate_logits: torch.Tensor) -> torch.Tensor:
    """Eq. 3 for any power-of-two K: ``[..., K-1]`` pre-activations -> ``[..., K]`` priors.

    Internal nodes are in heap order (node j has children 2j+1, 2j+2); leaf k's prior is the
    product of ``gamma`` (left branch) or ``1 - gamma`` (right branch) along its path. For
    K = 4: pi_1 = g1 g2, pi_2 = g1 (1-g2), pi_3 = (1-g1) g3, pi_4 = (1-g1)(1-g3).
    """
    gammas = torch.sigmoid(gate_logits)
    priors = torch.ones_like(gammas[..., :1])
    for nodes in level_widths(gammas.size(-1) + 1):  # top down
        left = priors * gammas[..., heap_level(nodes)]
        priors = torch.stack((left, priors - left), dim=-1).flatten(-2)
    return priors


class SigmoidTreeMix(torch.autograd.Function):
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
        for nodes in reversed(level_widths(k)):  # bottom up
            left, right = levels[-1].view(n, nodes, 2, s).unbind(2)
            levels.append(torch.lerp(right, left, gammas[:, heap_level(nodes)]))
        ctx.save_for_backward(gammas, *levels[:-1])
        ctx.gate_dtype = gate_logits.dtype
        return levels[-1].view(n, s)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gammas, *levels = ctx.saved_tensors
        n, k, s = levels[0].shape
        grad_gates = torch.empty_like(gammas)
        grad = grad_out.reshape(n, 1, s)
        for width, children in zip(level_widths(k), reversed(levels), strict=True):  # top down
            gamma = gammas[:, heap_level(width)]
            left, right = children.view(n, width, 2, s).unbind(2)
            # d node / d pre-activation = (left - right) * sigmoid' = (left - right) g (1 - g)
            grad_gate = grad_gates[:, heap_level(width)]
            torch.sub(left, right, out=grad_gate)
            grad_gate.mul_(grad).mul_(gamma).mul_(1 - gamma)
            grad_children = grad.new_empty(n, width, 2, s)
            torch.mul(grad, gamma, out=grad_children[:, :, 0])
            torch.sub(grad, grad_children[:, :, 0], out=grad_children[:, :, 1])
            grad = grad_children.view(n, 2 * width, s)
        return grad_gates.to(ctx.gate_dtype), grad


def tree_levels(values: torch.Tensor, gammas: torch.Tensor):
    """The sigmoid tree's levels, bottom up, as views of the ``[N, K, S]`` leaves.

    Yields ``(left, right, gamma)``, each ``[N, nodes, S]``. A node lives in the slot of
    the rightmost leaf under it, so each level's left and right children are two strided
    views of the same buffer and the tree runs in place: the left slot keeps
    ``left - right`` (what the backward needs) and the right slot the node's value.
    """
    n, k, s = values.shape
    for nodes in reversed(level_widths(k)):  # bottom up
        span = k // (2 * nodes)  # leaves under each child
        pairs = values.view(n, nodes, 2, span, s)
        yield pairs[:, :, 0, -1], pairs[:, :, 1, -1], gammas[:, heap_level(nodes)]
