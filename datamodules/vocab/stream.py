"""What a data module asks of a vocabulary beyond encoding text: the token stream of a split
from its cached ids, the training count of each class, and the state a checkpoint carries.

A data module caches ids in a *base* vocabulary (words or BPE pieces) and serves the stream the
model reads. For word and BPE vocabularies the two are the same (:class:`CachedIdsVocab`); a
vocabulary over the base (Hybrid-LightRNN codes) derives its stream from the base ids and may
carry training state (a learnt table), which bumps ``version`` when the stream changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class CachedIdsVocab:
    """A vocabulary whose ids are the cached ids: its stream is the ids themselves, and it has
    no state beyond its identity (a checkpoint's vocabulary must equal it). Mixed into
    ``WordVocab`` and ``BPEVocab``, which define ``counts``."""

    counts: list[int]
    # bumped whenever the stream of the same base ids changes; these never do
    version = 0

    @property
    def base(self) -> CachedIdsVocab:
        """The vocabulary the cached ids are in."""
        return self

    def count_stream(self, base_ids: torch.Tensor) -> int:
        """Length of the stream of ``base_ids``, without encoding it."""
        return len(base_ids)

    def encode_stream(self, base_ids: torch.Tensor) -> torch.Tensor:
        """The stream of ``base_ids`` (here: the ids, no copy)."""
        return base_ids

    def encode_stream_range(self, base_ids: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``encode_stream(base_ids)[start:stop]``, encoding only that share."""
        return base_ids[start:stop]

    def class_counts(self) -> np.ndarray:
        """Training count of every id the model predicts (``[len(self)]``, int64)."""
        return np.asarray(self.counts, dtype=np.int64)

    def begin_training_pass(self) -> None:
        """A training pass starts (nothing is scheduled for it here)."""

    def accepts(self, saved: object) -> bool:
        """Whether a checkpoint's vocabulary can be loaded into this one: only itself."""
        return saved == self

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: an accepted vocabulary is this one."""
