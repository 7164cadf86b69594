"""The optimizer + scheduler configuration every LightningModule of the app returns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_modules.errors import ModelConfigError


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
            raise ModelConfigError(f"model.scheduler.warmup_steps must be >= 1, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        step = max(1, self.last_epoch + 1)  # the step about to be taken, 1-based
        factor = min(step / self.warmup_steps, (self.warmup_steps / step) ** 0.5)
        return [base * factor for base in self.base_lrs]


def refuse_float16_adaptive_state(optimizer: torch.optim.Optimizer, precision: str) -> None:
    """Under ``16-true`` an Adam-style optimizer keeps its state in float16, where its ``eps``
    (1e-8) is 0 and small squared gradients underflow to 0: the first step divides by zero
    and makes the weights inf. One line naming the precisions that work, before any step."""
    if not precision.startswith("16-true"):
        return
    tiny = torch.finfo(torch.float16).tiny
    for group in optimizer.param_groups:
        if "betas" in group and isinstance(group.get("eps"), float) and group["eps"] < tiny:
            raise ModelConfigError(
                f"trainer.precision {precision} keeps the weights and "
                f"{type(optimizer).__name__}'s moments in float16, where its eps "
                f"({group['eps']:g}) and small squared gradients are 0 (the first step makes "
                f"the weights inf): use 16-mixed or bf16-mixed (float32 weights and state), or "
                f"bf16-true"
            )


def configure_optimizers(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: OptimizerCallable,
    scheduler: LRSchedulerCallable | None,
    precision: str | None = None,
) -> Any:
    """The injected optimizer, and the scheduler stepped per epoch on ``val/loss`` (which
    ``ReduceLROnPlateau`` needs and other schedulers ignore), or per optimizer step for a
    scheduler that says so (``interval = "step"``, e.g. :class:`InverseSquareRootLR`).

    ``strict: False``: an epoch without ``val/loss`` (``limit_val_batches=0``, validation
    every n epochs) skips the plateau step with a warning instead of stopping the run; a
    stale ``val/loss`` of an earlier validation is skipped by ``HeadTask.lr_scheduler_step``."""
    built = optimizer(parameters)
    refuse_float16_adaptive_state(built, precision or "")
    if scheduler is None:
        return built
    schedule = scheduler(built)
    interval = getattr(schedule, "interval", "epoch")
    config = {"scheduler": schedule, "monitor": "val/loss", "interval": interval, "strict": False}
    return {"optimizer": built, "lr_scheduler": config}


def step_schedulers_skipped_by_resume(module: Any) -> None:
    """Step the epoch-interval plateau schedulers at the end of an epoch resumed mid-way.

    Lightning (2.6) skips the end-of-epoch step of ``ReduceLROnPlateau``-style schedulers in
    the first epoch after ``fit --ckpt_path`` (meant for checkpoints written after the step).
    A run resumed from a mid-epoch checkpoint (its loader skipped the batches trained before
    it) has not stepped yet, so an uninterrupted run would step here: through the public
    ``lr_scheduler_configs``, ``callback_metrics`` and the module's ``lr_scheduler_step`` hook,
    as Lightning does, once the epoch's last batch was trained on. Call from
    ``on_train_epoch_end`` (it runs before Lightning's own check).
    """
    trainer = module.trainer
    loader = trainer.train_dataloader
    resumed = getattr(loader, "resumed_from", 0) > 0
    # the loader's position goes back to 0 once the epoch's last batch is trained on
    finished = resumed and loader.position == 0 and loader.batches_served > 0
    if not (finished and module.automatic_optimization):
        return
    for config in trainer.lr_scheduler_configs:
        due = (trainer.current_epoch + 1) % config.frequency == 0
        if not (config.reduce_on_plateau and config.interval == "epoch" and due):
            continue
        value = trainer.callback_metrics.get(config.monitor)
        if value is None:
            if config.strict:
                raise KeyError(f"ReduceLROnPlateau monitors {config.monitor!r}: not logged")
            continue
        module.lr_scheduler_step(config.scheduler, value)
