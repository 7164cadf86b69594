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

from heads.native import SoftmaxRowsKernels, softmax_rows_kernels

# the ignore label of the head contract (re-exported by heads.base)
IGNORE_INDEX = -100
# dtypes whose normalisations and losses are computed in float32 (DESIGN.md, numerics)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _softmax_nll(
    logits: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``softmax(logits)``, the per-row NLL (0 where ignored), the clamped targets ``[N, 1]``
    and the kept-row mask."""
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
    return probs, nll.masked_fill(~keep, 0.0), safe_target, keep


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        probs, nll, safe_target, keep = _softmax_nll(logits, target)
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
    (tested). Half-precision logits are normalised in float32 and the NLL is float32.
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy_nll expects logits [N, C] and target [N], got "
            f"{tuple(logits.shape)} and {tuple(target.shape)}"
        )
    if logits.device.type != "cpu":
        # On a GPU the caching allocator makes the extra [N, C] tensors cheap, kernel launches
        # and memory passes are what cost, and _softmax_nll's underflow check would stop the
        # host for the device every step: torch's log_softmax + nll_loss, exact in log space.
        # dtype=float32 reads half logits as they are (no float32 copy of [N, C]) and its
        # backward writes the gradient in their dtype (no cast pass); float64 stays float64.
        dtype = torch.float32 if logits.dtype in HALF_DTYPES else None
        log_probs = torch.nn.functional.log_softmax(logits, dim=-1, dtype=dtype)
        return torch.nn.functional.nll_loss(
            log_probs, target, ignore_index=IGNORE_INDEX, reduction="none"
        )
    if logits.dtype in HALF_DTYPES:
        logits = logits.float()
    return _CrossEntropy.apply(logits, target)


# MKL's CPU sgemm runs about 25-35% slower when the output rows' length is not a multiple of
# 16 floats (measured: [2048, 397] 12.1 ms vs [2048, 400] 9.1 ms, d = 512, one core), and
# vocabularies and adaptive cut-offs rarely are
ROW_ALIGN = 16
# the padded copy of W costs C d against the product's N C d: worth it from this many rows
_MIN_ROWS_TO_PAD = 64


def _linear_aligned(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``hidden W^T + b`` as ``[N, C']`` with ``C'`` a multiple of ``ROW_ALIGN``: the extra
    columns hold ``-inf``, so a softmax over all ``C'`` gives them probability 0 (at most
    ``exp(EXP_FLOOR)`` each under the floor of ``_LinearCrossEntropy``) and leaves the first
    ``C`` as they were. Without padding to do, plain ``F.linear``."""
    classes = weight.size(0)
    pad = -classes % ROW_ALIGN
    if pad == 0 or hidden.size(0) < _MIN_ROWS_TO_PAD:
        return torch.nn.functional.linear(hidden, weight, bias)
    padded = torch.nn.functional.pad(weight, (0, 0, 0, pad))  # zero rows: C x d, cheap
    logits = torch.nn.functional.linear(
        hidden, padded, None if bias is None else torch.nn.functional.pad(bias, (0, pad))
    )
    logits[:, classes:] = -torch.inf
    return logits


EXP_FLOOR = -60.0


def _native_rows(tensor: torch.Tensor) -> SoftmaxRowsKernels | None:
    """The C softmax passes where they apply: float32 on the CPU, unit column stride."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or tensor.dim() != 2:
        return None
    if tensor.stride(1) != 1 and tensor.size(1) > 1:
        return None
    return softmax_rows_kernels()


def _exps_by_torch_(logits: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """The PyTorch path of the two functions below: ``exp(max(z - top, EXP_FLOOR))`` in place."""
    return logits.sub_(top.unsqueeze(-1)).clamp_(min=EXP_FLOOR).exp_()


def exp_shifted_rows_(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In place, ``E = exp(max(z - M, EXP_FLOOR))`` with ``M`` the row maximum; returns
    ``(E, M, Z = sum E)``. One C pass per row where it applies (``heads/native``), else torch.
    """
    kernels = _native_rows(logits)
    if kernels is None or logits.size(0) == 0:
        top = logits.amax(-1)
        exps = _exps_by_torch_(logits, top)
        return exps, top, exps.sum(-1)
    n, c = logits.shape
    top, normaliser = logits.new_empty(n), logits.new_empty(n)
    kernels.softmax_rows(
        logits.data_ptr(),
        n,
        c,
        logits.stride(0),
        EXP_FLOOR,
        top.data_ptr(),
        normaliser.data_ptr(),
        torch.get_num_threads(),
    )
    return logits, top, normaliser


def add_exp_sums_(logits: torch.Tensor, top: torch.Tensor, normaliser: torch.Tensor) -> None:
    """In place, ``E = exp(max(z - top, EXP_FLOOR))`` for a block of columns whose rows'
    maximum over all blocks is ``top``; adds each row's ``sum E`` to ``normaliser``."""
    kernels = _native_rows(logits)
    if kernels is None or logits.size(0) == 0 or not top.is_contiguous():
        normaliser += _exps_by_torch_(logits, top).sum(-1)
        return
    n, c = logits.shape
    kernels.exp_shifted_rows(
        logits.data_ptr(),
        n,
        c,
        logits.stride(0),
        top.data_ptr(),
        EXP_FLOOR,
        normaliser.data_ptr(),
        torch.get_num_threads(),
    )


class _LinearCrossEntropy(torch.autograd.Function):
    """``cross_entropy(hidden W^T + b)`` whose backward never forms the ``[N, C]`` gradient.

    The forward owns its product, so the softmax is done in place on it: ``E = exp(z - M)``
    (``M`` the row maximum) and ``Z = sum E``, with no second ``[N, C]`` allocation (a fresh
    one costs a page fault per 4 KiB on a CPU), and the loss ``log Z + M - z_t`` is exact in
    log space however small the target's probability. With ``s`` the incoming gradient per
    row and ``E' = E - Z onehot_t`` (N entries changed in place, then restored):
    ``dL/dh = (s / Z) E' W``, ``dL/dW = E'^T ((s / Z) h)``, ``dL/db = E'^T (s / Z)``: the
    products read ``E'`` as it is, with no scaled ``[N, C]`` copy and no separate onehot
    terms. The product may be padded to aligned rows (``_linear_aligned``); the
    backward reads the first ``C`` columns of ``E`` as a view.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
    ) -> torch.Tensor:
        logits = _linear_aligned(hidden, weight, bias)
        keep = target != IGNORE_INDEX
        safe_target = target.clamp_min(0)
        target_logit = logits.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
        # exp of an argument below about -87 costs 20-40x a normal one on this CPU (subnormal
        # results), and a peaked softmax has many; the backward's products would meet
        # subnormals too. Below EXP_FLOOR a class counts as exp(-60) = 9e-27 in Z >= 1:
        # 1e-21 relative at 100k classes, far below float32 rounding. The loss itself
        # uses z_t, so a target's NLL stays exact.
        exps, top, normaliser = exp_shifted_rows_(logits)
        ctx.save_for_backward(hidden, weight, exps, normaliser, safe_target, keep)
        ctx.has_bias = bias is not None
        return (normaliser.log() + top - target_logit).masked_fill(~keep, 0.0)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_nll: torch.Tensor):
        hidden, weight, exps, normaliser, target, keep = ctx.saved_tensors
        # .data: the target entries are edited and restored below, which must not count as a
        # modification of the saved tensor (a retained graph's second backward checks)
        exps = exps.data[:, : weight.size(0)]  # without the padding columns
        scale = grad_nll.masked_fill(~keep, 0.0).unsqueeze(-1)  # s, [N, 1]
        prob_scale = scale / normaliser.unsqueeze(-1)  # s / Z
        # E - Z onehot_t, so that (s / Z) (E - Z onehot_t) = s (P - onehot_t) is the logits'
        # gradient: the products below then carry the onehot terms too (no W[t] gather, no
        # scatter of s h), for the cost of writing N entries and restoring them
        column = target.unsqueeze(-1)
        target_exps = exps.gather(1, column)
        exps.scatter_(1, column, target_exps - normaliser.unsqueeze(-1))
        try:
            grad_hidden = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_hidden = torch.mm(exps, weight).mul_(prob_scale)
            if ctx.needs_input_grad[1]:
                grad_weight = torch.mm(exps.t(), hidden * prob_scale)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_bias = torch.mv(exps.t(), prob_scale.squeeze(-1))
        finally:  # exactly as the forward left it, for a retained graph
            exps.scatter_(1, column, target_exps)
        return grad_hidden, grad_weight, grad_bias, None


def linear_cross_entropy_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
) -> torch.Tensor:
    """``cross_entropy_nll(F.linear(hidden, weight, bias), target)`` in one function, with a
    backward that goes straight to the products (see ``_LinearCrossEntropy``).

    Under autocast, with half-precision inputs or off the CPU it takes the two-step path
    instead: the product (in the autocast dtype), then the softmax and loss in float32.
    """
    if hidden.dim() != 2 or target.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_cross_entropy_nll expects hidden [N, d] and target [N], got "
            f"{tuple(hidden.shape)} and {tuple(target.shape)}"
        )
    device = hidden.device.type
    half = hidden.dtype in HALF_DTYPES or weight.dtype != hidden.dtype
    # The in-place softmax and the aligned rows are for a CPU, where a fresh [N, C] tensor
    # faults in its pages and MKL wants aligned rows; on a GPU the two-step path launches
    # fewer kernels, which is what costs there (README, "On a GPU").
    if half or torch.is_autocast_enabled(device) or device != "cpu":
        logits = torch.nn.functional.linear(hidden, weight, bias)
        with torch.autocast(device, enabled=False):
            return cross_entropy_nll(logits, target)
    return _LinearCrossEntropy.apply(hidden, weight, bias, target)


def linear_label_smoothing(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    nll: torch.Tensor,
    target: torch.Tensor,
) -> torch.Tensor:
    """Per row, ``mean_x(-log p_x)`` of ``p = softmax(hidden W^T + b)`` from its NLL, without
    the ``[N, C]`` logits: ``log Z = nll + z_t`` and ``mean_x z_x = h . mean(W) + mean(b)``.
    Float32 (float64 stays float64), differentiable; any value at ignored rows."""
    with torch.autocast(hidden.device.type, enabled=False):
        dtype = torch.promote_types(upcast_dtype(hidden.dtype), nll.dtype)
        h, w = hidden.to(dtype), weight.to(dtype)
        rows = w.index_select(0, target.clamp_min(0))
        target_logit = (h * rows).sum(-1)
        mean_logit = h @ w.mean(0)
        if bias is not None:
            b = bias.to(dtype)
            target_logit = target_logit + b.index_select(0, target.clamp_min(0))
            mean_logit = mean_logit + b.mean()
        return nll.to(dtype) + target_logit - mean_logit


def linear_log_normaliser(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``logsumexp(hidden W^T + b)`` per row through :func:`linear_cross_entropy_nll` (whose
    backward never forms the ``[N, C]`` gradient): the NLL of class 0 plus its logit."""
    zeros = torch.zeros(hidden.size(0), dtype=torch.long, device=hidden.device)
    nll = linear_cross_entropy_nll(hidden, weight, bias, zeros)
    with torch.autocast(hidden.device.type, enabled=False):
        first = hidden.to(nll.dtype) @ weight[0].to(nll.dtype)
        if bias is not None:
            first = first + bias[0].to(nll.dtype)
    return nll + first


def upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precisions, the dtype itself otherwise."""
    return torch.float32 if dtype in HALF_DTYPES else dtype
