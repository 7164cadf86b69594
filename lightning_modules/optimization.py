"""The optimizer + scheduler configuration every LightningModule of the app returns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable


class InverseSquareRootLR(torch.optim.lr_scheduler.LRScheduler):
    """The Transformer's schedule (Vaswani et al. 2017, Eq. 3, in fairseq's form): the learning
    rate grows linearly to the optimizer's ``lr`` over ``warmup_steps`` optimizer steps, then
    decays as ``lr * sqrt(warmup_steps / step)``. Stepped after every optimizer step
    (``interval = "step"``)."""

    interval = "step"

    def __init__(
        self, optimizer: torch.optim.Optimizer, warmup_steps: int = 4000, last_epoch: int = -1
    ) -> None:
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        step = max(1, self.last_epoch + 1)  # the step about to be taken, 1-based
        factor = min(step / self.warmup_steps, (self.warmup_steps / step) ** 0.5)
        return [base * factor for base in self.base_lrs]


def configure_optimizers(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: OptimizerCallable,
    scheduler: LRSchedulerCallable | None,
) -> Any:
    """The injected optimizer, and the scheduler stepped per epoch on ``val/loss`` (which
    ``ReduceLROnPlateau`` needs and other schedulers ignore), or per optimizer step for a
    scheduler that says so (``interval = "step"``, e.g. :class:`InverseSquareRootLR`).

    ``strict: False``: an epoch without ``val/loss`` (``limit_val_batches=0``, validation
    every n epochs) skips the plateau step with a warning instead of stopping the run; a
    stale ``val/loss`` of an earlier validation is skipped by ``HeadTask.lr_scheduler_step``."""
    built = optimizer(parameters)
    if scheduler is None:
        return built
    schedule = scheduler(built)
    interval = getattr(schedule, "interval", "epoch")
    config = {"scheduler": schedule, "monitor": "val/loss", "interval": interval, "strict": False}
    return {"optimizer": built, "lr_scheduler": config}


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
