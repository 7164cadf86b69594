"""The fused loss without a hand-written backward: each vocabulary chunk's plain maths under
``torch.utils.checkpoint`` (autograd saves a chunk's inputs and recomputes it in the backward).

Same memory bound as the hand-written plans (one chunk's logits at a time); kept as the
``checkpoint`` plan so the benchmark can weigh the hand-written CPU loop against it
(``python -m app.bench --heads softmax softmax@checkpoint ...``).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk(h, w, b, local, dtype: torch.dtype):
    """One chunk's ``(log-sum-exp, target logit)`` per row, plainly: the product in ``dtype``
    (``compute_dtype``: DS-Softmax's float32 rows meet bf16-true's bf16 weights), then the
    bias in the accumulation dtype, as the other plans' chunks (``compiled_lse._logits``)."""
    acc = torch.promote_types(dtype, torch.float32)
    z = torch.nn.functional.linear(h.to(dtype), w.to(dtype)).to(acc)
    z = z if b is None else z + b.to(acc)
    columns = z.size(1)
    inside = (local >= 0) & (local < columns)
    picked = z.gather(1, local.clamp(0, columns - 1)[:, None])[:, 0]
    return torch.logsumexp(z, dim=1), torch.where(inside, picked, 0.0)


def checkpointed_lse(hidden, weight, bias, target, width: int, dtype: torch.dtype):
    """``(lse, target logit)`` per row of ``hidden W^T + b`` by checkpointed chunks, the
    products in ``dtype``."""
    parts, picked = [], hidden.new_zeros(hidden.size(0), dtype=torch.float32)
    if hidden.dtype == torch.float64:
        picked = picked.double()
    for c0 in range(0, weight.size(0), width):
        b = None if bias is None else bias[c0 : c0 + width]
        lse, chunk_picked = checkpoint(
            _chunk, hidden, weight[c0 : c0 + width], b, target - c0, dtype, use_reentrant=False
        )
        parts.append(lse)
        picked = picked + chunk_picked
    return torch.logsumexp(torch.stack(parts), dim=0), picked
