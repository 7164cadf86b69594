"""Cross-entropy of given logits, and the constants every loss shares.

The heads' training losses do not come through here: they fuse the output product with the
loss by vocabulary chunks (``heads/fused_cross_entropy.py``) and never form ``[N, V]``
logits. :func:`cross_entropy_nll` is for a head that only defines its logits
(``SingleSoftmaxHead.forward``'s generic path).
"""

from __future__ import annotations

import torch

# the ignore label of the head contract (re-exported by heads.base)
IGNORE_INDEX = -100
# dtypes whose normalisations and losses are computed in float32 (docs/design.md, numerics)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def cross_entropy_nll(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``-log_softmax(logits)[n, target[n]]`` per row, 0 where ``target == -100``.

    Half-precision logits are normalised in float32 (``log_softmax(dtype=float32)`` reads
    them as they are, no float32 copy) and the NLL is float32; float64 stays float64.
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy_nll expects logits [N, C] and target [N], got "
            f"{tuple(logits.shape)} and {tuple(target.shape)}"
        )
    dtype = torch.float32 if logits.dtype in HALF_DTYPES else None
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1, dtype=dtype)
    return torch.nn.functional.nll_loss(
        log_probs, target, ignore_index=IGNORE_INDEX, reduction="none"
    )
