"""The synthetic two-level hierarchy of the DS-Softmax paper (appendix A, Eq. 3-5).

Super-class centroids ``c_i ~ N(0, d^3 I)``, sub-class centroids ``c_j ~ N(c_i, d^2 I)``, points
``x ~ N(c_j, d I)``; the label of a point is its sub class, and the super class is never shown
to the model. Sub class ``j`` of super class ``i`` has label ``i * num_sub + j``, so the
ground-truth hierarchy is ``label // num_sub``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import lightning as L
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from datamodules.errors import DataConfigError
from datamodules.resumable import ResumableLoader

SPLITS = ("train", "valid", "test")


def make_hierarchy(
    num_super: int, num_sub: int, dim: int, points_per_sub: dict[str, int], seed: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Points and labels per split, all around the same centroids (Eq. 3-5)."""
    gen = torch.Generator().manual_seed(seed)
    supers = torch.randn(num_super, dim, generator=gen) * dim**1.5  # Eq. 3: variance d^3
    subs = supers.repeat_interleave(num_sub, 0)
    subs = subs + torch.randn(subs.shape, generator=gen) * dim  # Eq. 4: variance d^2
    out = {}
    for split, count in points_per_sub.items():
        labels = torch.arange(num_super * num_sub).repeat_interleave(count)
        points = subs[labels] + torch.randn(labels.numel(), dim, generator=gen) * dim**0.5  # Eq. 5
        out[split] = (points, labels)
    return out


class EpochShuffle(RandomSampler):
    """A random order of the dataset's indices drawn from ``seed + epoch``: Lightning calls
    ``set_epoch`` at every epoch start, so a fit resumed from a checkpoint sees the order its
    epoch had in the uninterrupted run (a generator carried from epoch to epoch would start
    over at epoch 0's order). A ``RandomSampler``, so that under DDP Lightning replaces it by
    its ``DistributedSampler``, shuffled from its seed and the epoch as well."""

    def __init__(self, dataset: Sized, seed: int) -> None:
        super().__init__(dataset)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class SyntheticHierarchyDataModule(L.LightningDataModule):
    """Classification data with a known two-level class hierarchy.

    Args:
        num_super: number of super classes.
        num_sub: sub classes per super class; there are ``num_super * num_sub`` labels.
        dim: input dimension ``d`` (also sets the variances of Eq. 3-5).
        train_per_sub, val_per_sub, test_per_sub: points per sub class in each split.
        batch_size: training batch size (evaluation uses ``eval_batch_size``).
        normalize: divide inputs by their total standard deviation ``sqrt(d^3 + d^2 + d)``,
            so the network sees unit-scale features.
        seed: the data are a function of this seed only.
    """

    def __init__(
        self,
        num_super: int = 10,
        num_sub: int = 10,
        dim: int = 10,
        train_per_sub: int = 100,
        val_per_sub: int = 20,
        test_per_sub: int = 20,
        batch_size: int = 128,
        eval_batch_size: int = 1024,
        normalize: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_super", num_super), ("num_sub", num_sub), ("dim", dim),
            ("train_per_sub", train_per_sub), ("val_per_sub", val_per_sub),
            ("test_per_sub", test_per_sub), ("batch_size", batch_size),
            ("eval_batch_size", eval_batch_size),
        ):  # fmt: skip
            if not isinstance(value, int) or value <= 0:
                raise DataConfigError(f"{name} must be a positive integer, got {value!r}")
        self.num_super, self.num_sub, self.dim = num_super, num_sub, dim
        self.points_per_sub = {"train": train_per_sub, "valid": val_per_sub, "test": test_per_sub}
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.normalize, self.seed = normalize, seed
        self._data: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def vocab_size(self) -> int:
        """Number of classes (the CLI links it into the head as ``vocab_size``)."""
        return self.num_super * self.num_sub

    @property
    def input_size(self) -> int:
        return self.dim

    def super_class(self, labels: torch.Tensor) -> torch.Tensor:
        """Ground-truth super class of each label."""
        return labels // self.num_sub

    @property
    def data(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self._data is None:
            data = make_hierarchy(
                self.num_super, self.num_sub, self.dim, self.points_per_sub, self.seed
            )
            if self.normalize:
                scale = (self.dim**3 + self.dim**2 + self.dim) ** 0.5
                data = {split: (x / scale, y) for split, (x, y) in data.items()}
            self._data = data
        return self._data

    def train_dataloader(self) -> DataLoader:
        """Shuffled anew each epoch from ``seed + epoch``, and resumable mid-epoch
        (``datamodules/resumable.py``): ``fit --ckpt_path`` continues the epoch's order where
        the checkpoint stopped, as the language model's and translation's loaders do."""
        dataset = TensorDataset(*self.data["train"])
        order = EpochShuffle(dataset, self.seed)
        trainer = self.trainer
        if trainer is not None:  # a resumed fit starts in its checkpoint's epoch
            order.set_epoch(trainer.current_epoch)
        # sampler and batch_size, not a batch sampler: under DDP Lightning rebuilds the loader
        # around its distributed sampler, keeping batch_size only where it is the loader's own
        return ResumableLoader(dataset, sampler=order, batch_size=self.batch_size)

    def _eval_loader(self, split: str) -> DataLoader:
        """Under DDP each rank evaluates its own points, every point once: Lightning would give
        the loader its ``DistributedSampler``, which pads a split the ranks do not divide with
        repeated points (counted twice in the loss, the accuracies and DS utilisation). The
        ranks may then run one batch fewer or more: evaluation makes no collective per batch."""
        dataset = TensorDataset(*self.data[split])
        trainer = self.trainer
        if trainer is None or trainer.world_size == 1:
            return DataLoader(dataset, batch_size=self.eval_batch_size)
        # a DistributedSampler already: Lightning keeps it
        sampler = UnrepeatedDistributedSampler(
            dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False
        )
        return DataLoader(dataset, sampler=sampler, batch_size=self.eval_batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("valid")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
