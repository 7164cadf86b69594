"""The rows plan of the fused cross-entropy: the mean loss and its gradient in one forward, by
row tiles over the whole vocabulary, for one softmax or a mixture of ``K`` softmaxes (MoS).

The gradient of the mean loss with respect to each row's logits is known once the row's
log-sum-exp is: for one softmax ``dL/dz_n = w_n (p_n - q_n)``, with ``w_n = 1 / count`` on kept
rows (0 on ignored ones), ``p_n = softmax(z_n)`` and ``q_n = (1 - eps) onehot(t_n) + eps / V``
(label smoothing ``eps``). For a mixture ``P(t) = sum_k pi_k softmax(z_k)_t``
(mos-hybrid-lightrnn-bpe.txt Eq. 1), ``dL/dz_{n,k} = w_n r_{n,k} (p_{n,k} - onehot(t_n))`` and
``dL/d log pi_{n,k} = -w_n r_{n,k}``, with the responsibilities
``r_{n,k} = pi_k p_{n,k,t} / P(t)``: a tile that holds all ``K`` component rows of its tokens
has everything it needs. So each tile forms its logits once, takes their log-sum-exp, turns
them into ``dz`` in place and runs both gradient products at once:

- three products in all, as an unfused loss runs (the column plans run four: their backward
  recomputes the logits), in the memory of one tile of logits (an unfused loss holds all);
- the backward only scales the stored gradients by the loss's incoming gradient.

The per-token NLL is returned too (for the metrics). When something downstream differentiates it
as well, the backward adds its part, ``g_n r_{n,k} (p_{n,k} - onehot)``, with one more pass
over the tiles (the logits recomputed from the saved log-sum-exp): right in every use, fast in
the common one, where only the loss is differentiated.

Two tile bodies: in place on a flat buffer reused from tile to tile (CPUs, where the tile runs
from cache), and compiled functions (GPUs: one kernel for the log-sum-exp, one for ``dz`` in the
products' dtype). Nothing branches on values: no host sync.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from heads.kernels.chunks import (
    accumulate_mm,
    accumulation_dtype,
    as_dtype,
    chunk_buffer,
    chunk_logits,
    exp_shifted_,
    exp_sum_,
    finite_shift,
    spans,
    target_columns,
)
from heads.kernels.compiled_lse import compiled_body

# devices whose tiles run as compiled bodies (tests add "cpu" to check them in float64)
COMPILED_DEVICES = ("cuda",)


class Terms:
    """The loss's per-token terms from the tile's per-row statistics: the NLL, the row loss
    (with label smoothing) and the coefficients of ``dL/dz = a p - b onehot(t) - c`` per row
    (``c`` None without smoothing), and ``dL/d log pi`` (None for one softmax)."""

    def __init__(self, lse, picked, total_logit, log_prior, weight, eps: float, v: int):
        k = 1 if log_prior is None else log_prior.size(1)
        component_nll = (lse - picked).view(-1, k)  # CE_k = lse_k - z_{k,t}
        self.uniform = None
        if log_prior is None:
            self.nll, coefficient, self.grad_log_prior = component_nll[:, 0], weight, None
            self.loss = self.nll
            if eps:  # mean_x(-log p_x) = lse - mean_x z_x; its dL/dz is the uniform eps w / V
                self.loss = (1 - eps) * self.nll + eps * (lse - total_logit / v)
                self.uniform = eps / v * weight
        else:  # nll = -logsumexp_k(log pi_k - CE_k), r = its softmax over k (Eq. 1)
            log_posterior = log_prior - component_nll
            self.nll = -torch.logsumexp(log_posterior, 1)
            responsibility = torch.exp(log_posterior + self.nll[:, None])
            self.loss = self.nll
            self.grad_log_prior = -weight[:, None] * responsibility
            coefficient = (weight[:, None] * responsibility).reshape(-1)
        self.scale = coefficient
        self.onehot = (1 - eps) * coefficient if log_prior is None else coefficient


def responsibilities(lse, picked, log_prior) -> torch.Tensor | None:
    """``r_{n,k}`` per component row, from the saved statistics (the backward's extra pass)."""
    if log_prior is None:
        return None
    log_posterior = log_prior - (lse - picked).view(log_prior.shape)
    return torch.softmax(log_posterior, 1).reshape(-1)


# -- the tile bodies --------------------------------------------------------------------------
def eager_statistics(h, weight, bias, target, acc, buffer, want_sum):
    """In place on ``buffer``: ``z <- exp(z - m)`` and ``(exps, sum exp, lse, z_target,
    sum_x z)`` per row (``sum_x z`` when ``want_sum``)."""
    z = chunk_logits(h, weight, bias, acc, buffer)
    inside, column = target_columns(target, 0, z.size(1))
    picked = torch.where(inside, z.gather(1, column).squeeze(1), 0.0)
    total_logit = z.sum(1) if want_sum else None
    top, total = exp_sum_(z)
    return z, total, finite_shift(top) + total.log(), picked, total_logit


def eager_gradient_(exps, target, scale, onehot, uniform) -> torch.Tensor:
    """In place: ``dz = scale exps - onehot onehot(t) - uniform`` per row."""
    dz = exps.mul_(scale.unsqueeze(1))
    inside, column = target_columns(target, 0, dz.size(1))
    dz.scatter_add_(1, column, torch.where(inside, -onehot, 0.0).unsqueeze(1))
    if uniform is not None:
        dz.sub_(uniform.unsqueeze(1))
    return dz


def _statistics(h, weight, bias, target):
    z = torch.mm(h, weight.t()).to(bias.dtype) + bias
    v = z.size(1)
    inside = (target >= 0) & (target < v)
    picked = torch.where(inside, z.gather(1, target.clamp(0, v - 1)[:, None])[:, 0], 0.0)
    return z, picked


def _gradient(probs, target, scale, onehot, uniform, dtype):
    hit = torch.arange(probs.size(1), device=probs.device)[None, :] == target[:, None]
    dz = probs * scale[:, None] - torch.where(hit, onehot[:, None], 0.0)
    return (dz if uniform is None else dz - uniform[:, None]).to(dtype)


def compiled_forward_tile(h, weight, bias, target, log_prior, row_weight, eps: float, want_dz):
    """One tile of the forward as one functional body for ``torch.compile`` (GPUs): ``(lse,
    z_target, nll, row loss, dL/d log pi or None, dz)`` with ``dz`` in the products' dtype
    (None unless ``want_dz``). ``bias`` is a tensor (zeros when the head has none); ``target``
    per component row."""
    z, picked = _statistics(h, weight, bias, target)
    shift = finite_shift(z.amax(1))
    exps = torch.exp(z - shift[:, None])
    total = exps.sum(1)
    lse = shift + total.log()
    terms = Terms(lse, picked, z.sum(1), log_prior, row_weight, eps, z.size(1))
    if not want_dz:
        return lse, picked, terms.nll, terms.loss, terms.grad_log_prior, None
    probs = exps * (1 / total)[:, None]
    dz = _gradient(probs, target, terms.scale, terms.onehot, terms.uniform, h.dtype)
    return lse, picked, terms.nll, terms.loss, terms.grad_log_prior, dz


def compiled_recompute_tile(h, weight, bias, target, lse, scale):
    """The backward's extra pass over one tile: ``dz = scale (p - onehot(t))``."""
    z, _ = _statistics(h, weight, bias, target)
    return _gradient(torch.exp(z - lse[:, None]), target, scale, scale, None, h.dtype)


class _Gradients:
    """``(dh, dW, db)`` filled tile by tile in the accumulation dtype: each tile writes its
    rows of ``dh``; the first tile writes ``dW`` and ``db``, later ones add to them."""

    def __init__(self, hidden, weight, bias, acc, need) -> None:
        n, (v, d) = hidden.size(0), weight.shape
        self.any = any(need)
        new = weight.new_empty if n else weight.new_zeros  # no rows, no tile: zeros
        self.h = hidden.new_empty(n, d, dtype=acc) if need[0] else None
        self.w = new(v, d, dtype=acc) if need[1] else None
        self.b = new(v, dtype=acc) if bias is not None and need[2] else None

    def add_tile(self, r0: int, r1: int, h_r, w_c, dz, dtype) -> None:
        """``dh[r0:r1] = dz W``, ``dW (+)= dz^T h``, ``db (+)= sum_rows dz``."""
        dz_c = as_dtype(dz, dtype)
        if self.h is not None:
            accumulate_mm(self.h[r0:r1], dz_c, w_c, False)
        if self.w is not None:
            accumulate_mm(self.w, dz_c.t(), h_r, r0 > 0)
        if self.b is not None:
            if r0 > 0:
                self.b += dz.sum(0, dtype=self.b.dtype)
            else:
                torch.sum(dz, 0, dtype=self.b.dtype, out=self.b)


class _Walk:
    """The row tiles (whole tokens: all ``k`` component rows of each) and their bodies."""

    def __init__(self, hidden, weight, bias, target, dtype, tile, k) -> None:
        self.acc = accumulation_dtype(hidden, weight)
        self.weight, self.bias, self.dtype, self.k = weight, bias, dtype, k
        self.h, self.w = as_dtype(hidden, dtype), as_dtype(weight, dtype)
        self.rows_target = target.repeat_interleave(k) if k > 1 else target
        tokens = hidden.size(0) // k
        self.tiles = spans(tokens, None if tile is None else max(1, tile // k))
        self.compiled = hidden.device.type in COMPILED_DEVICES
        self.buffer = None
        if self.compiled:
            b = bias if bias is not None else weight.new_zeros(weight.size(0))
            self.b = as_dtype(b, self.acc)
        elif self.tiles:
            rows = (self.tiles[0][1] - self.tiles[0][0]) * k
            self.buffer = chunk_buffer(hidden, rows, weight.size(0), self.acc)

    def forward(self, log_prior, row_weight, eps: float, grads: _Gradients):
        """Every tile: ``(lse, z_target)`` per component row, ``(nll, row loss)`` per token
        and ``dL/d log pi``; each tile's ``dz`` products added into ``grads``."""
        k, n = self.k, self.h.size(0)
        lse, picked = self.h.new_empty(n, dtype=self.acc), self.h.new_empty(n, dtype=self.acc)
        parts = []  # per tile: nll, row loss, dL/d log pi
        for t0, t1 in self.tiles:
            r0, r1 = t0 * k, t1 * k
            rows_prior = None if log_prior is None else log_prior[t0:t1]
            if self.compiled:
                body = compiled_body(compiled_forward_tile)
                *stats, dz = body(self.h[r0:r1], self.w, self.b, self.rows_target[r0:r1],
                                  rows_prior, row_weight[t0:t1], eps, grads.any)  # fmt: skip
                lse[r0:r1], picked[r0:r1] = stats[0], stats[1]
                parts.append(stats[2:])
            else:
                exps, total, lse[r0:r1], picked[r0:r1], total_logit = eager_statistics(
                    self.h[r0:r1], self.weight, self.bias, self.rows_target[r0:r1], self.acc,
                    self.buffer, eps > 0,
                )  # fmt: skip
                terms = Terms(lse[r0:r1], picked[r0:r1], total_logit, rows_prior,
                              row_weight[t0:t1], eps, self.weight.size(0))  # fmt: skip
                parts.append((terms.nll, terms.loss, terms.grad_log_prior))
                dz = None
                if grads.any:
                    # p = exps / total
                    dz = eager_gradient_(exps, self.rows_target[r0:r1], terms.scale / total,
                                         terms.onehot, terms.uniform)  # fmt: skip
            if grads.any:
                grads.add_tile(r0, r1, self.h[r0:r1], self.w, dz, self.dtype)
        if not parts:  # no tokens
            empty = self.h.new_zeros(0, dtype=self.acc)
            return lse, picked, [empty, empty, None if log_prior is None else log_prior * 0]
        return lse, picked, [_join(column) for column in zip(*parts, strict=True)]

    def recompute(self, lse, scale, grads: _Gradients) -> None:
        """The backward's extra pass: ``dz = scale (p - onehot(t))`` into ``grads``."""
        k = self.k
        for t0, t1 in self.tiles:
            r0, r1 = t0 * k, t1 * k
            if self.compiled:
                body = compiled_body(compiled_recompute_tile)
                dz = body(self.h[r0:r1], self.w, self.b, self.rows_target[r0:r1], lse[r0:r1],
                          scale[r0:r1])  # fmt: skip
            else:
                z = chunk_logits(self.h[r0:r1], self.weight, self.bias, self.acc, self.buffer)
                probs = exp_shifted_(z, lse[r0:r1])
                dz = eager_gradient_(probs, self.rows_target[r0:r1], scale[r0:r1],
                                     scale[r0:r1], None)  # fmt: skip
            grads.add_tile(r0, r1, self.h[r0:r1], self.w, dz, self.dtype)


def _join(parts):
    """The tiles' per-token tensors as one (None for one softmax's ``dL/d log pi``)."""
    if parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class RowsCrossEntropy(torch.autograd.Function):
    """``(sum_n w_n loss_n, nll [N])`` of one softmax (``log_prior`` None; ``hidden``
    ``[N, d]``) or of a mixture (``log_prior`` ``[N, K]``, ``hidden`` the ``[N K, d]``
    component rows, token-major), against ``target`` ``[N]``, with the gradient computed in
    the forward (module docstring). ``row_weight`` ``[N]``: 0 on ignored tokens (``target``
    outside ``[0, V)``, whose NLL is 0); the mean loss's ``1 / count`` on the others. Label
    smoothing: one softmax only."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, log_prior, row_weight, eps, dtype, tile, grad):
        ctx.set_materialize_grads(False)  # an undifferentiated NLL output gives None, not 0s
        k = 1 if log_prior is None else log_prior.size(1)
        walk = _Walk(hidden, weight, bias, target, dtype, tile, k)
        # `grad`: the caller's grad mode (needs_input_grad ignores no_grad)
        need = ctx.needs_input_grad[:3] if grad else (False,) * 3
        grads = _Gradients(hidden, weight, bias, walk.acc, need)
        with torch.autocast(hidden.device.type, enabled=False):
            lse, picked, (nll, row_loss, grad_log_prior) = walk.forward(
                log_prior, row_weight.to(walk.acc), eps, grads
            )
        keep = (target >= 0) & (target < weight.size(0))
        nll = torch.where(keep, nll, 0.0)
        loss = (row_weight * torch.where(keep, row_loss, 0.0)).sum()
        ctx.save_for_backward(hidden, weight, bias, target, log_prior, lse, picked, grads.h,
                              grads.w, grads.b, grad_log_prior)  # fmt: skip
        ctx.layout = dtype, tile
        return loss, nll

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_nll):
        hidden, weight, bias, target, log_prior, lse, picked, *stored = ctx.saved_tensors
        dtype, tile = ctx.layout
        need = (*ctx.needs_input_grad[:3], ctx.needs_input_grad[4])
        scaled = [None if g is None or grad_loss is None or not wanted
                  else g * as_dtype(grad_loss, g.dtype)
                  for g, wanted in zip(stored, need, strict=True)]  # fmt: skip
        if grad_nll is not None:  # the NLL output is differentiated too: g r (p - onehot)
            keep = (target >= 0) & (target < weight.size(0))
            g = torch.where(keep, as_dtype(grad_nll, lse.dtype), 0.0)
            r = responsibilities(lse, picked, log_prior)
            k = 1 if log_prior is None else log_prior.size(1)
            scale = g.repeat_interleave(k) if r is None else g.repeat_interleave(k) * r
            extra = _Gradients(hidden, weight, bias, lse.dtype, ctx.needs_input_grad[:3])
            with torch.autocast(hidden.device.type, enabled=False):
                _Walk(hidden, weight, bias, target, dtype, tile, k).recompute(lse, scale, extra)
            extra_prior = None if r is None or not need[3] else -g[:, None] * r.view(-1, k)
            scaled = [
                x if y is None else (y if x is None else x + y)
                for x, y in zip(scaled, (extra.h, extra.w, extra.b, extra_prior), strict=True)
            ]
        dh, dw, db, d_prior = scaled
        return (
            None if dh is None else dh.to(hidden.dtype),
            None if dw is None else dw.to(weight.dtype),
            None if db is None or bias is None else db.to(bias.dtype),
            None,
            None if d_prior is None else d_prior.to(log_prior.dtype),
            *([None] * 5),
        )
