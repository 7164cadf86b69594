"""The GPU plan of Mixtape's frequent block (Eq. 2-4): one compiled function per block of
columns, forward and backward, where ``heads/kernels/mixtape_frequent.py`` (the CPU plan) runs
each step of a block as its own in-place operation.

On a GPU every such operation is a kernel launch and a pass over ``[N, K, w]`` in memory:
the sigmoids, each level of the tree, the bias, the exponentials, and in the backward the
tree top down. Here a block is its products (the gate pre-activations, Eq. 4, and the
component logits ``h_{c,k} . w_x``) and one functional body around them that Inductor fuses:

- forward: the sigmoids, the tree bottom up (a node is ``gamma left + (1 - gamma) right``,
  Eq. 3), the bias and the online log-sum-exp, target logit and logit sum of the rows;
- backward: the block recomputed, ``dL/dz = g p + g_t onehot + g_s``, the tree top down
  (``dL/dleft = gamma dL/dnode``, ``dL/dright = (1 - gamma) dL/dnode``,
  ``dL/dpre = dL/dnode (left - right) gamma (1 - gamma)``), then the four products into the
  gradients of the contexts, ``W``, the gate inputs and the gate weights, in the products'
  dtype (bf16 under autocast) with float32 accumulation.

Every block is recomputed in the backward (the CPU plan keeps a prefix of them within
``saved_bytes``; on a GPU a block of 16k tokens outgrows any such budget). Gate noise is drawn
per block outside the bodies and replayed in the backward as the CPU plan does. Nothing
branches on values: no host sync.
"""

from __future__ import annotations

import math

import torch

from heads.kernels.chunks import accumulation_dtype, spans
from heads.kernels.compiled_lse import (
    chunk_gradient,
    compiled_body,
    fold_chunk,
    own,
    with_ones,
)
from heads.kernels.mixtape_frequent import ReplayNoise, block_noise


def _tree(inputs, contexts, gate_w, w, b, noise, noise_std: float, acc):
    """One block, node by node: ``(gammas, nodes, logits [N, w])``, the gates ``[N, w]``
    each in heap order (node j's children are 2j+1 and 2j+2), the nodes likewise with the K
    leaves after the K-1 internal ones. Kept as separate ``[N, w]`` expressions (no stacked
    levels): Inductor then computes the tree inside the kernels that read it, and stores none
    of it in float32."""
    n, k = inputs.size(0), inputs.size(1) + 1  # contexts: [N K, d]
    width = w.size(0)
    flat = inputs.reshape(n * (k - 1), inputs.size(2))  # sizes named: N = 0 infers no -1
    pre = torch.mm(flat, gate_w.t()).view(n, k - 1, width)  # Eq. 4
    if noise is not None:
        pre = pre.to(acc) + noise_std * noise
    gammas = [torch.sigmoid(pre[:, j].to(acc)) for j in range(k - 1)]
    leaves = torch.mm(contexts, w.t()).view(n, k, width)
    nodes = [None] * (k - 1) + [leaves[:, j].to(acc) for j in range(k)]
    for j in reversed(range(k - 1)):  # bottom up, Eq. 3
        left, right = nodes[2 * j + 1], nodes[2 * j + 2]
        nodes[j] = right + gammas[j] * (left - right)
    return gammas, nodes, nodes[0] + b  # the bias after the tree


def frequent_forward_block(inputs, contexts, gate_w, w, b, noise, noise_std: float, local,
                           top, total, picked, logit_sum):  # fmt: skip
    """One block into the rows' running ``(max, sum exp, target logit, logit sum or None)``;
    ``local`` is the target's column in this block (outside ``[0, w)``: not here)."""
    _, _, z = _tree(inputs, contexts, gate_w, w, b, noise, noise_std, top.dtype)
    top, total, picked = fold_chunk(z, local, top, total, picked)
    if logit_sum is not None:
        logit_sum = logit_sum + z.sum(1)
    return top, total, picked, logit_sum


def frequent_backward_block(inputs, contexts_ext, gate_w, w, b, noise, noise_std: float,
                            local, lse, g, g_t, g_s, grad_inputs, grad_contexts):  # fmt: skip
    """The block's gradient, straight into the products: ``contexts_ext = [h | 1 | 0]``
    ``[N K, *]`` (:func:`with_ones`); returns ``(grad_inputs + dpre Gw, grad_contexts +
    dleaves W, dpre^T inputs, dleaves^T contexts_ext = [dW | db | 0])``. The tree top down,
    node by node: ``dL/dleft = gamma dL/dnode``, ``dL/dright = (1 - gamma) dL/dnode``,
    ``dL/dpre = dL/dnode (left - right) gamma (1 - gamma)``. The leaves' gradients sum to the
    root's (each node passes ``gamma`` and ``1 - gamma`` of its own down), so the bias
    gradient ``sum_rows dz`` is the ones column's share of the ``dW`` product: only the two
    products' inputs are stored, in their dtype."""
    n, k = inputs.size(0), inputs.size(1) + 1
    contexts = contexts_ext[:, : w.size(1)]
    gammas, nodes, z = _tree(inputs, contexts, gate_w, w, b, noise, noise_std, lse.dtype)
    dz = chunk_gradient(z, local, lse, g, g_t)
    if g_s is not None:
        dz = dz + g_s[:, None]
    grads, gate_grads = [dz] + [None] * (2 * k - 2), []
    for j in range(k - 1):  # top down, heap order
        gamma, left, right = gammas[j], nodes[2 * j + 1], nodes[2 * j + 2]
        gate_grads.append(grads[j] * (left - right) * gamma * (1 - gamma))
        grads[2 * j + 1] = grads[j] * gamma
        grads[2 * j + 2] = grads[j] - grads[2 * j + 1]
    dtype, width = contexts.dtype, z.size(1)
    d_leaves = torch.stack([x.to(dtype) for x in grads[k - 1 :]], 1).view(n * k, width)
    d_pre = torch.stack([x.to(dtype) for x in gate_grads], 1).view(n * (k - 1), width)
    flat_inputs = inputs.reshape(n * (k - 1), inputs.size(2))
    return (
        grad_inputs + torch.mm(d_pre, gate_w).to(grad_inputs.dtype),
        grad_contexts + torch.mm(d_leaves, w).to(grad_contexts.dtype),
        torch.mm(d_pre.t(), flat_inputs),
        torch.mm(d_leaves.t(), contexts_ext),
    )


def _detached_inputs(gate_inputs, gate_weights, weight, bias, dtype, acc):
    """The products' inputs detached in the compute dtype (the contexts apart: the forward
    casts them, the backward extends them with ones), the bias in the accumulation dtype."""
    products = (gate_inputs, gate_weights, weight)
    return *(t.detach().to(dtype) for t in products), bias.detach().to(acc)


def _blocks(gate_w, w, b, width: int):
    """Each block's ``(start, stop, gate weights, W, b)``, the slices as tensors of their own
    (no storage offset for the bodies to guard on: no recompilation per block)."""
    for a, z in spans(w.size(0), width):
        yield a, z, own(gate_w, a, z), own(w, a, z), own(b, a, z)


class CompiledMixtapeFrequentLSE(torch.autograd.Function):
    """The frequent tokens' ``(lse, target logit, logit sum)`` per row (Eq. 2-4) by blocks of
    ``width`` columns, each block one compiled body forward and one backward: inputs and
    outputs as ``heads.kernels.mixtape_frequent.MixtapeFrequentLSE`` (module docstring)."""

    @staticmethod
    def forward(ctx, gate_inputs, gate_weights, contexts, weight, bias, target,
                want_sum: bool, dtype: torch.dtype, width: int, noise_std: float):  # fmt: skip
        acc = accumulation_dtype(contexts, weight)
        n, k, _ = contexts.shape
        inputs, gate_w, w, b = _detached_inputs(gate_inputs, gate_weights, weight, bias, dtype,
                                                acc)  # fmt: skip
        flat = contexts.detach().to(dtype).reshape(n * k, contexts.size(2))
        top = contexts.new_full((n,), -math.inf, dtype=acc)
        total, picked = contexts.new_zeros(n, dtype=acc), contexts.new_zeros(n, dtype=acc)
        logit_sum = contexts.new_zeros(n, dtype=acc) if want_sum else None
        body = compiled_body(frequent_forward_block)
        noise_state, noise_kept = None, []
        for a, z, gate_block, w_block, b_block in _blocks(gate_w, w, b, width):
            noise = None
            if noise_std > 0:
                noise, noise_state = block_noise((n, k - 1, z - a), False, noise_state,
                                                 noise_kept, contexts.device, acc)  # fmt: skip
            top, total, picked, logit_sum = body(
                inputs, flat, gate_block, w_block, b_block, noise, noise_std, target - a, top,
                total, picked, logit_sum,
            )  # fmt: skip
        lse = top + total.log()
        ctx.save_for_backward(gate_inputs, gate_weights, contexts, weight, bias, target, lse,
                              noise_state, *noise_kept)  # fmt: skip
        ctx.layout = dtype, width, noise_std, want_sum
        return lse, picked, logit_sum if want_sum else torch.zeros_like(lse)

    @staticmethod
    def backward(ctx, grad_lse, grad_target, grad_sum):
        gate_inputs, gate_weights, contexts, weight, bias, target, lse, noise_state, *kept = (
            ctx.saved_tensors
        )
        dtype, width, noise_std, want_sum = ctx.layout
        acc = lse.dtype
        n, k, d = contexts.shape
        inputs, gate_w, w, b = _detached_inputs(gate_inputs, gate_weights, weight, bias, dtype,
                                                acc)  # fmt: skip
        contexts_ext = with_ones(contexts.detach().reshape(n * k, d), dtype)
        g = lse.new_zeros(n) if grad_lse is None else grad_lse.to(acc)
        g_t = lse.new_zeros(n) if grad_target is None else grad_target.to(acc)
        g_s = grad_sum.to(acc) if want_sum and grad_sum is not None else None
        grad_inputs = lse.new_zeros(n * (k - 1), gate_inputs.size(-1))
        grad_contexts = lse.new_zeros(n * k, d)
        grad_gate_w = gate_weights.new_empty(gate_weights.shape, dtype=acc)
        grad_w = weight.new_empty(weight.shape, dtype=acc)
        grad_b = bias.new_empty(bias.shape, dtype=acc)
        body = compiled_body(frequent_backward_block)
        with ReplayNoise(noise_state, list(kept), contexts.device) as noise_source:
            for a, z, gate_block, w_block, b_block in _blocks(gate_w, w, b, width):
                noise = noise_source.next((n, k - 1, z - a), acc) if noise_std > 0 else None
                grad_inputs, grad_contexts, dgw, dwb = body(
                    inputs, contexts_ext, gate_block, w_block, b_block, noise, noise_std,
                    target - a, lse, g, g_t, g_s, grad_inputs, grad_contexts,
                )  # fmt: skip
                grad_gate_w[a:z], grad_w[a:z], grad_b[a:z] = dgw, dwb[:, :d], dwb[:, d]
        return (
            grad_inputs.view(gate_inputs.shape).to(gate_inputs.dtype),
            grad_gate_w.to(gate_weights.dtype),
            grad_contexts.view(contexts.shape).to(contexts.dtype),
            grad_w.to(weight.dtype),
            grad_b.to(bias.dtype),
            *([None] * 5),
        )
