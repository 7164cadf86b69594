"""Mixtape's execution (the maths is ``heads/mixtape.py``): the frequent tokens' block of the
training loss by vocabulary blocks, and the evaluation logits written into one ``[N, V]``.

``MixtapeFrequentLSE`` gives, per row, the log-sum-exp, target logit and logit sum of the S
frequent tokens' gated logits (Eq. 2-4) without a ``[N, K, S]`` tensor beyond a byte budget:
each block of columns is Eq. 4's product, the sigmoids, ``h_{c,k} . w_x`` and the sigmoid tree
in place (``frequent_block``), joined by an online log-sum-exp; the backward recomputes the
blocks not kept (replaying their gate noise, ``ReplayNoise``) and is written by hand.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from heads.kernels.chunks import (
    accumulate_mm,
    accumulation_dtype,
    as_dtype,
    chunk_buffer,
    chunk_logits,
    combine_chunk,
    exp_shifted_,
    exp_sum_,
    spans,
    target_columns,
)
from heads.kernels.sigmoid_tree import tree_levels


def frequent_block(
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
    see ``heads.kernels.chunks.chunk_buffer``) when one is given.

    Eq. 4 then the sigmoids of Eq. 3, in place; ``h_{c,k} . w_x``, then the tree (Eq. 2-3) in
    place, which leaves ``left - right`` in each node's left slot for the backward
    (``tree_levels``); the bias after the tree (``sum_k pi = 1``), on ``[N, w]`` only."""
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
    for left, right, gamma in tree_levels(values, gammas):
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


def block_noise(shape, keep: bool, noise_state, noise_kept: list, device, acc):
    """A block's gate noise and the replay state: for a block not kept, the generator state
    before the first such block (eager) or the noise itself (under ``torch.compile``) is
    recorded for the backward (``ReplayNoise``)."""
    # no generator state to record: traced (torch.compile), or under a CUDA graph's capture
    # (which cannot read it; each replay draws anew, so a recorded state would be stale)
    stateless = torch.compiler.is_compiling() or capturing(device)
    if not keep and noise_state is None and not stateless:
        noise_state = rng_state(device)
    noise = torch.randn(*shape, dtype=acc, device=device)
    if not keep and stateless:
        noise_kept.append(noise)
    return noise, noise_state


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream is being captured into a CUDA graph
    (``heads/graphs.py``): the generator's state cannot be read then."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


class ReplayNoise:
    """The gate noise of the blocks not kept, drawn again in the backward exactly as in the
    forward: the generator is set back to its state before the first such block (and restored
    after), and the blocks are drawn in the same order and shapes. Under ``torch.compile``
    (no generator state to trace) and a CUDA graph's capture (none to read) the forward keeps
    those blocks' noise instead."""

    def __init__(self, state: torch.Tensor | None, kept: list[torch.Tensor], device) -> None:
        self.state, self.kept, self.device = state, kept, device
        self.fork = None

    def __enter__(self) -> ReplayNoise:
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


class MixtapeFrequentLSE(torch.autograd.Function):
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
        flat_inputs = gate_inputs.reshape(n * (k - 1), gate_inputs.size(2)).to(dtype)
        flat_contexts = contexts.reshape(n * k, d).to(dtype)
        top = contexts.new_full((n,), -math.inf, dtype=acc)
        total, target_logit, logit_sum = (contexts.new_zeros(n, dtype=acc) for _ in range(3))
        noise_state, noise_kept, blocks = None, [], []
        budget, buffer = saved_bytes, None
        for a, b in spans(s, width):
            keep = False  # a prefix of the blocks is kept: the backward counts them
            if budget > 0:
                budget -= n * (2 * k) * (b - a) * torch.finfo(acc).bits // 8
                keep = budget >= 0
            noise = None
            if noise_std > 0:
                noise, noise_state = block_noise((n, k - 1, b - a), keep, noise_state,
                                                  noise_kept, contexts.device, acc)  # fmt: skip
            if not keep and buffer is None:
                buffer = chunk_buffer(contexts, n * 2 * k, width, acc)
            gammas, values, logits = frequent_block(
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
        flat_inputs = gate_inputs.reshape(n * (k - 1), gate_inputs.size(2)).to(dtype)
        flat_contexts = contexts.reshape(n * k, d).to(dtype)
        g = grad_lse.to(acc).unsqueeze(1)
        inside_any = (target >= 0) & (target < s)
        g_t = torch.where(inside_any, grad_target.to(acc), 0.0).unsqueeze(1)
        g_s = grad_sum.to(acc).unsqueeze(1) if ctx.want_sum and grad_sum is not None else None
        grads = _Gradients(flat_inputs, gate_weights, contexts, weight, width, acc)
        buffer = (
            None
            if num_kept == len(spans(s, width))
            else chunk_buffer(contexts, n * 2 * k, width, acc)
        )
        with ReplayNoise(noise_state, list(noise_kept), contexts.device) as noise_source:
            for index, (a, b) in enumerate(spans(s, width)):
                if index < num_kept:
                    gammas, values, probs = kept[3 * index : 3 * index + 3]
                    grad = probs * g
                else:
                    noise = None
                    if noise_std > 0:
                        noise = noise_source.next((n, k - 1, b - a), acc)
                    gammas, values, logits = frequent_block(
                        flat_inputs, flat_contexts, gate_weights[a:b], weight[a:b], bias[a:b],
                        noise, noise_std, (n, k), acc, buffer,
                    )  # fmt: skip
                    grad = exp_shifted_(logits, lse).mul_(g)
                inside, column = target_columns(target, a, b)
                grad.scatter_add_(1, column, g_t * inside.unsqueeze(1))
                if g_s is not None:
                    grad.add_(g_s)
                grads.add_block(index, (a, b), grad, gammas, values, flat_inputs, flat_contexts,
                                gate_weights, weight, dtype)  # fmt: skip
        return (
            grads.inputs.view(gate_inputs.shape).to(gate_inputs.dtype),
            grads.gate_weights.to(gate_weights.dtype),
            grads.contexts.view(contexts.shape).to(contexts.dtype),
            grads.weight.to(weight.dtype),
            grads.bias.to(bias.dtype),
            *([None] * 6),
        )


class _Gradients:
    """The backward's gradients, filled block by block, and its tree buffers (one block's
    tree gradients at a time, allocated once)."""

    def __init__(self, flat_inputs, gate_weights, contexts, weight, width, acc) -> None:
        n, k, d = contexts.shape
        s = weight.size(0)
        # the first block writes the input gradients, the others add to them
        new = torch.empty if s else torch.zeros
        self.contexts = new(n * k, d, dtype=acc, device=contexts.device)
        self.inputs = new(flat_inputs.shape, dtype=acc, device=contexts.device)
        self.weight = torch.empty(weight.shape, dtype=acc, device=weight.device)
        self.gate_weights = torch.empty(gate_weights.shape, dtype=acc, device=weight.device)
        self.bias = torch.empty(s, dtype=acc, device=weight.device)
        most = min(s, width)
        self.values_buffer = contexts.new_empty(n * k * most, dtype=acc)
        self.gates_buffer = contexts.new_empty(n * (k - 1) * most, dtype=acc)

    def add_block(self, index, columns, grad, gammas, values, flat_inputs, flat_contexts,
                  gate_weights, weight, dtype) -> None:  # fmt: skip
        """Block ``columns = (a, b)`` with ``dL/dz = grad [N, w]``: the tree top down (a
        node's gradient in its own slot, as its value was), then four products into the
        gradients of the contexts, ``W``, the gate inputs and the gate weights."""
        a, b = columns
        n, k, w = values.shape
        self.bias[a:b] = grad.sum(0)
        grad_values = self.values_buffer[: n * k * w].view(n, k, w)
        grad_gates = self.gates_buffer[: n * (k - 1) * w].view(n, k - 1, w)
        for (diff, _, gamma), (grad_left, grad_right, grad_gate) in zip(
            reversed(list(tree_levels(values, gammas))),
            reversed(list(tree_levels(grad_values, grad_gates))),
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
        accumulate_mm(self.contexts, flat_values, as_dtype(weight[a:b], dtype), later)
        accumulate_mm(self.weight[a:b], flat_values.t(), flat_contexts, False)
        gates_w = as_dtype(gate_weights[a:b], dtype)
        accumulate_mm(self.inputs, flat_gates, gates_w, later)
        accumulate_mm(self.gate_weights[a:b], flat_gates.t(), flat_inputs, False)


class FrequentThenRareLogits(torch.autograd.Function):
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
