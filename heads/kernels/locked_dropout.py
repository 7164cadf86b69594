"""Dropout with one mask per sequence (locked, or variational, dropout), on a head's rows.

A task's rows are ``B`` sequences of ``T`` steps flattened batch-major, row ``b T + t``
(``lightning_modules/language_model.py``); a task that pads them to a static size appends
rows past ``B T`` (``lightning_modules/static_rows.py``). The MoS code's latent dropout is
locked: ``latent = self.lockdrop(latent, self.dropoutl)`` on ``latent [T, B, K d]`` with
``LockedDropout``'s mask ``[1, B, K d]``, Bernoulli(1 - p) / (1 - p), broadcast over the T
steps (zihangdai/mos, ``model.py`` and ``locked_dropout.py``). Here the same mask, in the
rows' batch-major layout: ``[S, 1, F]`` over ``[S, T, F]``, ``S = ceil(N / T)``. Rows past
``B T`` (padding) fall into sequences of their own, whatever their masks: their targets are
ignored. Its shapes come from ``N`` and ``T`` alone and it reads nothing back, so a captured
(CUDA graph) or compiled step draws it from the generator like any dropout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from heads.cross_entropy import HALF_DTYPES


def locked_mask(
    sequences: int, features: int, p: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[sequences, 1, features]``: Bernoulli(1 - p) scaled by ``1 / (1 - p)`` (zero at
    ``p = 1``), as ``LockedDropout`` draws it (``x.data.new(1, B, F).bernoulli_(1 - p)``)."""
    mask = torch.empty(sequences, 1, features, dtype=dtype, device=device).bernoulli_(1 - p)
    return mask.div_(1 - p) if p < 1 else mask


def locked_dropout(
    x: torch.Tensor, p: float, training: bool, sequence_length: int | None
) -> torch.Tensor:
    """``x [N, ...]`` with dropout ``p`` in training: one mask per sequence of
    ``sequence_length`` consecutive rows, over all of a row's features (:func:`locked_mask`);
    ``sequence_length=None``: ``F.dropout``, a mask per row (what a task without the layout
    gets, unchanged). Half-precision rows are scaled in float32 and rounded once, as PyTorch's
    dropout does."""
    if sequence_length is None:
        return F.dropout(x, p, training)
    if not training or p == 0.0:
        return x
    if sequence_length <= 0:
        raise ValueError(f"sequence_length must be positive, got {sequence_length}")
    n = x.size(0)
    sequences = -(-n // sequence_length)
    features = math.prod(x.shape[1:])  # named, not -1: N = 0 rows have no size to infer
    rows = x.reshape(n, features)
    acc = torch.float32 if x.dtype in HALF_DTYPES else x.dtype
    mask = locked_mask(sequences, rows.size(1), p, acc, x.device)
    if torch.compiler.is_compiling():
        # row r takes its sequence's mask, r // T (a last, partial sequence included): the
        # eager padding below tests whether T divides N, a guard that compiled a head's loss
        # twice for one padded row count (AWD-LSTM's windows hit both). Eagerly the gathered
        # [N, F] mask would be saved for the backward; the broadcast [S, 1, F] one is not
        sequence = torch.arange(n, device=x.device) // sequence_length
        dropped = (rows * mask.view(sequences, features)[sequence]).to(x.dtype)
        return dropped.view(x.shape)
    padded = sequences * sequence_length
    if padded != n:  # a last, partial sequence: padded to whole ones and cut back
        rows = F.pad(rows, (0, 0, 0, padded - n))
    dropped = (rows.view(sequences, sequence_length, features) * mask).to(x.dtype)
    return dropped.view(padded, features)[:n].view(x.shape)
