"""A data loader whose position survives a mid-epoch checkpoint.

Lightning saves ``state_dict()`` of a training loader that has one in every checkpoint and
hands it back through ``load_state_dict`` when ``fit --ckpt_path`` resumes, before the
epoch's iterator is created. So a run killed at step N resumes at batch N of the same epoch
instead of replaying the epoch from its start.

Lightning's data fetcher reads one batch ahead (to know which batch is the last), so the
number of batches this loader has *yielded* is one more than the number trained on when a
checkpoint is written. The training module therefore tells the loader which batch it is
training (:meth:`ResumableLoader.mark_consumed`, called from ``on_train_batch_start``); the
position saved is that count, not the read-ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset


class ResumableLoader(DataLoader):
    """A ``DataLoader`` that remembers how many batches of the current epoch were trained on:
    ``ResumableLoader(dataset)`` for a dataset that yields whole batches (``batch_size=None``),
    or with a ``batch_sampler`` and ``collate_fn`` (translation's token buckets).

    The batches must come in the same order when iterated again within an epoch (BPTT windows
    do; a shuffled order must be seeded by the epoch, as the token buckets' is). Batches
    before the resumed position are skipped after they are made (a collate each: cheap beside
    a training step).

    Args:
        before_pass: called when an epoch's iterator starts, before any batch is made (and
            before worker processes copy the dataset): the data module installs state scheduled
            for the next pass there (a re-learnt Hybrid-LightRNN table).

    Attributes:
        batches_served: batches yielded in the current epoch (including a read-ahead).
        resumed_from: batches skipped at the start of the current epoch (0 unless this epoch
            was resumed from a mid-epoch checkpoint).
    """

    def __init__(
        self, dataset: Dataset, before_pass: Callable[[], None] | None = None, **loader: Any
    ) -> None:
        if loader.get("batch_sampler") is None:
            # (Lightning rebuilds a loader with batch_sampler=None, e.g. for overfit_batches)
            loader.setdefault("batch_size", None)
        super().__init__(dataset, **loader)
        self.before_pass = before_pass
        self.batches_served = 0
        self.resumed_from = 0
        self._consumed: int | None = None
        self._resume_at = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self._resume_at = self._resume_at, 0
        self.batches_served = 0
        self.resumed_from = skip
        self._consumed = None
        if self.before_pass is not None:
            self.before_pass()
        for index, batch in enumerate(super().__iter__()):
            if index < skip:
                continue  # already trained on before the checkpoint (a window is a small copy)
            self.batches_served = index + 1
            yield batch

    def mark_consumed(self, batches: int) -> None:
        """``batches`` of this epoch have been (or are being) trained on."""
        self._consumed = batches

    @property
    def position(self) -> int:
        """Batches of the current epoch trained on: the marked count, or without a mark (no
        trainer) the batches yielded."""
        return self.batches_served if self._consumed is None else self._consumed

    def state_dict(self) -> dict[str, int]:
        return {"batches_served": self.position}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._resume_at = int(state_dict["batches_served"])
