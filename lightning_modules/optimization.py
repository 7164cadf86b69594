"""The optimizer + scheduler configuration every LightningModule of the app returns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable


def configure_optimizers(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: OptimizerCallable,
    scheduler: LRSchedulerCallable | None,
) -> Any:
    """The injected optimizer, and the scheduler stepped per epoch on ``val/loss`` (which
    ``ReduceLROnPlateau`` needs and other schedulers ignore)."""
    built = optimizer(parameters)
    if scheduler is None:
        return built
    return {
        "optimizer": built,
        "lr_scheduler": {"scheduler": scheduler(built), "monitor": "val/loss", "interval": "epoch"},
    }


def step_schedulers_skipped_by_resume(trainer: Any) -> None:
    """Step the epoch-interval schedulers at the end of an epoch that was resumed mid-way.

    Lightning (2.6) keeps its fit loop ``restarting`` through the whole first epoch after
    ``fit --ckpt_path`` and skips that epoch's scheduler step (meant for checkpoints written
    after the step). A run resumed from a mid-epoch checkpoint (its loader skipped batches)
    has not stepped yet, so an uninterrupted run would step here: do it through Lightning's
    own scheduler update. Call from ``on_train_epoch_end`` (it runs before Lightning's check).
    """
    fit_loop = trainer.fit_loop
    loader = trainer.train_dataloader
    if not (fit_loop.restarting and getattr(loader, "resumed_from", 0) > 0):
        return
    if fit_loop.epoch_loop._num_ready_batches_reached():
        fit_loop.epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=True)
