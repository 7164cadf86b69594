"""The optimizer + scheduler configuration every LightningModule of the app returns."""

from __future__ import annotations

import functools
import math
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


def keep_state_on_device(optimizer: torch.optim.Optimizer) -> None:
    """``torch.optim.ASGD`` (AWD-LSTM's NT-ASGD) keeps its step count, step size and averaging
    weight on the parameters' device, and its default (not ``capturable``) step reads them back
    to Python (``_get_value``, ``mu.item()``): on a GPU three blocking reads per parameter per
    step. Its ``capturable`` step computes the same update on the device; turned on where the
    parameters are on an accelerator (a CPU's step reads nothing back either way, and
    ``capturable`` refuses CPU tensors)."""
    if not isinstance(optimizer, torch.optim.ASGD):
        return
    for group in optimizer.param_groups:
        if any(p.device.type != "cpu" for p in group["params"]):
            group["capturable"] = True


# torch's schedules made to step after every batch ("should be called after a batch has been
# used for training", OneCycleLR's and CyclicLR's docs): stepped per epoch, as Lightning steps
# a scheduler by default, a OneCycle of total_steps = the run's steps stayed in its warm-up
PER_STEP_SCHEDULERS = (torch.optim.lr_scheduler.OneCycleLR, torch.optim.lr_scheduler.CyclicLR)


def scheduler_class(factory: Any) -> type | None:
    """The scheduler class a factory builds: the class itself, or the one a partial holds
    (LightningCLI's ``model.scheduler`` is jsonargparse's partial of it); else None."""
    if isinstance(factory, type):
        return factory
    if isinstance(factory, functools.partial):
        for arg in (factory.func, *factory.args):
            if isinstance(arg, type) and issubclass(arg, torch.optim.lr_scheduler.LRScheduler):
                return arg
    return None


def stepping_batches(trainer: Any) -> int | float:
    """The optimizer steps of the whole fit: the data module's exact count where it has one
    (AWD-LSTM's variable windows: ``LanguageModelingDataModule.stepping_batches``, where
    Lightning's ``estimated_stepping_batches`` takes the first epoch's count for every epoch),
    else Lightning's."""
    count = getattr(getattr(trainer, "datamodule", None), "stepping_batches", None)
    return count(trainer) if callable(count) else trainer.estimated_stepping_batches


def build_scheduler(scheduler: LRSchedulerCallable, optimizer: Any, trainer: Any = None) -> Any:
    """``scheduler(optimizer)``; a ``OneCycleLR`` given neither ``total_steps`` nor ``epochs``
    is sized to the fit's optimizer steps (:func:`stepping_batches`)."""
    cls = scheduler_class(scheduler)
    if cls is None or not issubclass(cls, torch.optim.lr_scheduler.OneCycleLR):
        return scheduler(optimizer)
    given = getattr(scheduler, "keywords", {})
    if given.get("total_steps") is not None or given.get("epochs") is not None:
        return scheduler(optimizer)
    total = stepping_batches(trainer) if trainer is not None else math.inf
    if not math.isfinite(total):
        raise ModelConfigError(
            "model.scheduler OneCycleLR needs the run's length: give its total_steps, or "
            "trainer.max_epochs or trainer.max_steps to size it from"
        )
    return scheduler(optimizer, total_steps=int(total))


def configure_optimizers(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: OptimizerCallable,
    scheduler: LRSchedulerCallable | None,
    precision: str | None = None,
    trainer: Any = None,
) -> Any:
    """The injected optimizer, and the scheduler stepped per epoch on ``val/loss`` (which
    ``ReduceLROnPlateau`` needs and other schedulers ignore), or per optimizer step for a
    scheduler that says so (``interval = "step"``, e.g. :class:`InverseSquareRootLR`) and for
    torch's per-batch ones (:data:`PER_STEP_SCHEDULERS`). A ``OneCycleLR`` without
    ``total_steps`` is sized to the fit (``trainer``'s: :func:`build_scheduler`).

    ``strict: False``: an epoch without ``val/loss`` (``limit_val_batches=0``, validation
    every n epochs) skips the plateau step with a warning instead of stopping the run; a
    stale ``val/loss`` of an earlier validation is skipped by ``HeadTask.lr_scheduler_step``.
    ``HeadTask`` takes the plateau step at the end of the validation that ends the epoch, or at
    the epoch's end where none ends it (:func:`step_plateau_schedulers`), before the epoch's
    checkpoint."""
    built = optimizer(parameters)
    refuse_float16_adaptive_state(built, precision or "")
    keep_state_on_device(built)
    if scheduler is None:
        return built
    schedule = build_scheduler(scheduler, built, trainer)
    per_step = isinstance(schedule, PER_STEP_SCHEDULERS)
    interval = getattr(schedule, "interval", "step" if per_step else "epoch")
    config = {"scheduler": schedule, "monitor": "val/loss", "interval": interval, "strict": False}
    return {"optimizer": built, "lr_scheduler": config}


def epoch_batches_done(trainer: Any) -> bool:
    """Whether the training epoch's last batch was trained on (Lightning's own test before it
    steps the epoch's schedulers, through its public progress counters)."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    return progress.is_last_batch or progress.current.ready == trainer.num_training_batches


def due_plateau_schedulers(trainer: Any) -> list[Any]:
    """The ``ReduceLROnPlateau`` configs Lightning would step at the end of this epoch
    (epoch interval, this epoch a multiple of their ``frequency``)."""
    return [
        config
        for config in trainer.lr_scheduler_configs
        if config.reduce_on_plateau
        and config.interval == "epoch"
        and (trainer.current_epoch + 1) % config.frequency == 0
    ]


def plateau_monitors(trainer: Any) -> list[str]:
    """The values the fit's ``ReduceLROnPlateau`` schedulers step on (``val/loss``)."""
    return [config.monitor for config in trainer.lr_scheduler_configs if config.reduce_on_plateau]


def step_plateau_schedulers(module: Any) -> bool:
    """At the end of a validation or of the training epoch: if the epoch's last batch was
    trained on, take the epoch's ``ReduceLROnPlateau`` steps now (through
    ``module.lr_scheduler_step``, as Lightning does) and return True; else do nothing and
    return False. (At an epoch's end that no validation ended, the value is that of the
    epoch's latest validation, as Lightning's own call reads it from ``callback_metrics``.)

    Lightning (2.6) steps them only after ``on_train_epoch_end``, where ``ModelCheckpoint``
    saves: an epoch-end checkpoint (the usual ``last.ckpt``) held the scheduler before its
    step, and the fit resumed from it counts the epoch finished and never took that step;
    the first epoch of a fit resumed mid-way takes none at all. Stepped here, every
    checkpoint of the epoch's end holds the step and every epoch takes it once; the task's
    ``lr_scheduler_step`` then skips Lightning's own call.
    """
    trainer = module.trainer
    if not (module.automatic_optimization and epoch_batches_done(trainer)):
        return False
    for config in due_plateau_schedulers(trainer):
        value = trainer.callback_metrics.get(config.monitor)
        if value is not None:  # (none: Lightning's own call warns, or raises if strict)
            module.lr_scheduler_step(config.scheduler, value)
    return True
