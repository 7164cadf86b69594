"""A data loader whose position survives a mid-epoch checkpoint.

Lightning saves ``state_dict()`` of a training loader that has one in every checkpoint and
hands it back through ``load_state_dict`` when ``fit --ckpt_path`` resumes, before the
epoch's iterator is created. So a run killed at step N resumes at batch N of the same epoch
instead of replaying the epoch from its start.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset


class ResumableLoader(DataLoader):
    """``DataLoader(dataset, batch_size=None)`` (the dataset yields whole batches) that
    remembers how many batches of the current epoch it has served.

    The dataset must give the same batches in the same order when iterated again within an
    epoch (BPTT windows do; shuffled datasets must seed their order by epoch).
    """

    def __init__(self, dataset: Dataset) -> None:
        super().__init__(dataset, batch_size=None)
        self.batches_served = 0
        self._resume_at = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self._resume_at = self._resume_at, 0
        self.batches_served = 0
        for index, batch in enumerate(super().__iter__()):
            if index < skip:
                continue  # already trained on before the checkpoint (BPTT windows are views)
            self.batches_served = index + 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_served": self.batches_served}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._resume_at = int(state_dict["batches_served"])
