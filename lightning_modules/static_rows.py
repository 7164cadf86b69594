"""A handful of row counts for the head's loss where its shapes are compiled or captured.

``torch.compile`` specialises a head's loss on its row count (the fused loss loops over row
and column tiles of known sizes) and a CUDA graph holds one shape. A translation batch has a
new ``B x T`` almost every step (length buckets capped at ``max_tokens``; an LM's windows
vary only at a split's end, or with a varying BPTT): compiled, each new count was a new
compilation until
Dynamo's limit (8) sent the rest to eager, and graphed, each ran eagerly. The tasks pad the
rows (zero hidden, ignored targets: no loss, no gradient, no metric) up to one of 8 sizes per
octave, at most 1/8 more rows: a run then sees a few sizes (a translation run's training
batches, in ``(max_tokens - T, max_tokens]``: Multi30k's at ``max_tokens`` 2048 fall on 2048,
1920 and 1792 rows, 96% on the first two, and the epoch's last, smaller batch on one more; its
validation batches on two), each compiled once for training and once for evaluation.
"""

from __future__ import annotations

import torch

from heads import IGNORE_INDEX

# sizes per octave: 2^STEPS_BITS (8: at most 1/8 of the rows padding)
STEPS_BITS = 3


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``2^(bits(rows) - 1 - STEPS_BITS)``: one of 8 sizes
    in each octave ``[2^k, 2^(k+1))``, at most ``rows / 8`` more (a count up to 16 kept)."""
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    step = 1 << max(rows.bit_length() - 1 - STEPS_BITS, 0)
    return -(-rows // step) * step


def pad_rows(
    hidden: torch.Tensor, target: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [N, d]`` and ``target [N]`` with ``rows - N`` more rows: zeros and
    ``IGNORE_INDEX`` (shapes only: nothing read from the device). New tensors even where
    ``rows == N``: Dynamo guards on whether an input is a view (a batch's reshaped ``[B, T]``
    is), so a view one step and a padded copy the next were two compilations of one size."""
    hidden = torch.nn.functional.pad(hidden, (0, 0, 0, rows - hidden.size(0)))
    return hidden, pad_target(target, rows)


def pad_target(target: torch.Tensor, rows: int) -> torch.Tensor:
    """``target`` flattened, with ``IGNORE_INDEX`` up to ``rows`` (a new tensor)."""
    flat = target.reshape(-1)
    return torch.nn.functional.pad(flat, (0, rows - flat.numel()), value=IGNORE_INDEX)
