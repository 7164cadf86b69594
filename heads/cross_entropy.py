"""Per-position cross-entropy with a leaner backward than ``F.cross_entropy``.

``F.cross_entropy`` backpropagates through two kernels: ``nll_loss`` scatters the incoming
gradient into a freshly zero-filled ``[N, C]`` tensor, then ``log_softmax``'s backward reads
that tensor and the saved log-probabilities to write a third ``[N, C]`` tensor. The gradient
is simply ``g_n * (softmax(z_n) - onehot(t_n))``, so the forward keeps the softmax itself
(one kernel, as ``log_softmax`` would be) and the backward is one row scale of it and a
scatter: one ``[N, C]`` allocation instead of two, no fill, and no second ``exp`` pass.
Output layers are memory-bound on a CPU, so this shows in every head that ends in a softmax
(README, "Output-layer benchmark").
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

# the ignore label of the head contract (re-exported by heads.base)
IGNORE_INDEX = -100


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        probs = logits.softmax(dim=-1)
        keep = target != IGNORE_INDEX
        safe_target = target.clamp_min(0).unsqueeze(-1)
        target_prob = probs.gather(-1, safe_target).squeeze(-1)
        nll = -target_prob.log()
        # Below the smallest normal float the log loses precision (or is -inf): those rare
        # rows are recomputed in log space, exactly.
        underflow = target_prob < torch.finfo(probs.dtype).tiny
        if underflow.any():
            rows = underflow.nonzero().squeeze(1)
            exact = logits[rows].log_softmax(-1).gather(-1, safe_target[rows]).squeeze(-1)
            nll[rows] = -exact
        nll = nll.masked_fill(~keep, 0.0)
        ctx.save_for_backward(probs, safe_target, keep)
        return nll

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_nll: torch.Tensor) -> tuple[torch.Tensor, None]:
        probs, safe_target, keep = ctx.saved_tensors
        scale = grad_nll.masked_fill(~keep, 0.0).unsqueeze(-1)
        # out of place: the saved probabilities must survive a retained graph
        grad = probs * scale
        grad.scatter_add_(-1, safe_target, -scale)
        return grad, None


def cross_entropy_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``-log_softmax(logits)[n, target[n]]`` per row, 0 where ``target == -100``.

    Same values and gradients as ``F.cross_entropy(logits, target, reduction="none")``
    (tested); the caller upcasts half-precision logits first.
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy_nll expects logits [N, C] and target [N], got "
            f"{tuple(logits.shape)} and {tuple(target.shape)}"
        )
    return _CrossEntropy.apply(logits, target)
