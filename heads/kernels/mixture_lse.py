"""The eager (CPU-tuned) plan of MoS's label-smoothing term ``sum_x log P(x|c)``: vocabulary
chunks of the ``K N`` component logits, recomputed in a hand-written backward, so no
``[N, K, V]`` tensor exists (the GPU plan is ``compiled_lse.CompiledMixtureLogProbSum``)."""

from __future__ import annotations

import torch

from heads.kernels.chunks import accumulate_mm, accumulation_dtype, as_dtype, chunk_logits, spans


class MixtureLogProbSum(torch.autograd.Function):
    """``sum_x log P(x|c)`` per row (``heads.mos.mixture_log_prob_sum``). With
    ``r_{k,x} = softmax_k(a_k + z_{k,x})`` (each component's responsibility for class x):
    ``dS/dz_{k,x} = r_{k,x}``, ``dS/da_k = sum_x r_{k,x}``; the backward
    recomputes a chunk's ``z`` and ``r`` and feeds them to the products of ``h_{c,k}`` and
    ``W``."""

    @staticmethod
    def forward(ctx, contexts, weight, bias, shift, dtype, width):
        acc = accumulation_dtype(contexts, weight, shift)
        n, k, d = contexts.shape
        flat = contexts.reshape(n * k, d).to(dtype)
        a = shift.to(acc).unsqueeze(-1)
        total = contexts.new_zeros(n, dtype=acc)
        for c0, c1 in spans(weight.size(0), width):
            z = column_chunk(flat, weight, bias, c0, c1, acc).view(n, k, c1 - c0)
            # in place: the chunk's logits are its own (the backward does the same), and a
            # z + a beside them would be one more [N, K, C] at the peak
            total += torch.logsumexp(z.add_(a), dim=1).sum(1)
        ctx.save_for_backward(contexts, weight, bias, shift)
        ctx.layout = dtype, width
        return total

    @staticmethod
    def backward(ctx, grad_total):
        contexts, weight, bias, shift = ctx.saved_tensors
        dtype, width = ctx.layout
        acc = accumulation_dtype(contexts, weight, shift)
        n, k, d = contexts.shape
        flat = contexts.reshape(n * k, d).to(dtype)
        a = shift.to(acc).unsqueeze(-1)
        g = grad_total.to(acc).view(n, 1, 1)
        # the first chunk writes the contexts' gradient, the others add to it
        grad_flat = (torch.empty if weight.size(0) else torch.zeros)(
            n * k, d, dtype=acc, device=contexts.device
        )
        grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device)
        grad_bias = None
        if bias is not None:
            grad_bias = torch.empty(bias.shape, dtype=acc, device=weight.device)
        grad_shift = torch.zeros(n, k, dtype=acc, device=contexts.device)
        for c0, c1 in spans(weight.size(0), width):
            z = column_chunk(flat, weight, bias, c0, c1, acc).view(n, k, c1 - c0)
            r = torch.softmax(z.add_(a), dim=1).mul_(g)  # g r, [N, K, C]
            grad_shift += r.sum(-1)
            r_flat = r.view(n * k, c1 - c0)
            r_c = r_flat.to(dtype)
            accumulate_mm(grad_flat, r_c, as_dtype(weight[c0:c1], dtype), c0 > 0)
            accumulate_mm(grad_weight[c0:c1], r_c.t(), flat, False)
            if grad_bias is not None:
                torch.sum(r_flat, 0, out=grad_bias[c0:c1])
            # freed before the next chunk's logits are allocated: one chunk's [N, K, C] alive
            z = r = r_flat = r_c = None
        return (
            grad_flat.view(contexts.shape).to(contexts.dtype),
            grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            grad_shift.to(shift.dtype),
            None,
            None,
        )


def column_chunk(flat, weight, bias, c0, c1, acc) -> torch.Tensor:
    """``h W_c^T + b_c`` for columns ``[c0, c1)``: the primitive's own chunk product."""
    return chunk_logits(flat, weight[c0:c1], None if bias is None else bias[c0:c1], acc)
