"""The optimizer + scheduler configuration every LightningModule of the app returns."""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Iterable
from typing import Any, Literal

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from lightning_modules.errors import ModelConfigError, warn_once

# when a scheduler steps: Lightning's lr_scheduler "interval" (None: the scheduler's own default)
SchedulerInterval = Literal["epoch", "step"]
INTERVALS = ("epoch", "step")


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


class WarmupCosineLR(torch.optim.lr_scheduler.LRScheduler):
    """Linear warm-up then cosine decay to a floor, stepped after every optimizer step
    (``interval = "step"``): the transformer language models' schedule (GPT-2/3, Chinchilla;
    the cosine of SGDR, Loshchilov & Hutter 2017, Eq. 5, with one cycle). After ``k`` optimizer
    steps (``k = last_epoch``) the rate is ``lr * f(k)``, with ``s = warmup_start_factor``,
    ``W = warmup_steps``, ``T = total_steps``, ``m = min_lr_ratio``:

    - ``k < W``: ``s + (1 - s) k / W`` (from ``s lr`` at the first step to ``lr`` at step W;
      torch's ``LinearLR(start_factor=s, total_iters=W)``);
    - ``W <= k < T``: ``m + (1 - m) (1 + cos(pi (k - W) / (T - W))) / 2`` (torch's
      ``CosineAnnealingLR(T_max=T - W, eta_min=m lr)`` started at step W);
    - ``k >= T``: ``m`` (constant at the floor).

    ``total_steps`` unset: the task sizes it to the fit's optimizer steps, as it sizes a
    ``OneCycleLR`` (:func:`build_scheduler`). A fit shorter than the warm-up ends in it (with
    a warning line)."""

    interval = "step"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_steps: int = 0,
        total_steps: int | None = None,
        min_lr_ratio: float = 0.0,
        warmup_start_factor: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ModelConfigError(
                f"model.scheduler.warmup_steps must be 0 (no warm-up) or more, got {warmup_steps}"
            )
        if total_steps is None:
            raise ModelConfigError(
                "WarmupCosineLR needs total_steps: give model.scheduler.total_steps, or let the "
                "task size it to the fit (trainer.max_epochs or trainer.max_steps)"
            )
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ModelConfigError(
                f"model.scheduler.total_steps must be a positive integer, got {total_steps}"
            )
        for name, value in (("min_lr_ratio", min_lr_ratio),
                            ("warmup_start_factor", warmup_start_factor)):  # fmt: skip
            if not 0.0 <= value <= 1.0:
                raise ModelConfigError(f"model.scheduler.{name} must be in [0, 1], got {value}")
        if total_steps <= warmup_steps:
            warn_once(
                f"WarmupCosineLR: the warm-up ({warmup_steps} optimizer steps) is not shorter "
                f"than the schedule's {total_steps} steps: the rate never reaches the cosine "
                f"(lower model.scheduler.warmup_steps, or train longer)"
            )
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.min_lr_ratio = min_lr_ratio
        self.warmup_start_factor = warmup_start_factor
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """The rate's factor after ``step`` optimizer steps (the class docstring's ``f``)."""
        warmup, total, floor = self.warmup_steps, self.total_steps, self.min_lr_ratio
        if step < warmup:
            start = self.warmup_start_factor
            return start + (1.0 - start) * step / warmup
        if step >= total:
            return floor
        progress = (step - warmup) / (total - warmup)  # total > step >= warmup: no 0 / 0
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:
        factor = self.factor(max(self.last_epoch, 0))
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


def default_interval(scheduler: Any) -> SchedulerInterval:
    """When a scheduler (a class or one built) steps unless ``model.scheduler_interval`` says:
    its own ``interval`` (:class:`InverseSquareRootLR`, :class:`WarmupCosineLR`), every
    optimizer step for torch's per-batch ones (:data:`PER_STEP_SCHEDULERS`), else once an
    epoch (Lightning's default)."""
    own = getattr(scheduler, "interval", None)
    if own in INTERVALS:
        return own
    cls = scheduler if isinstance(scheduler, type) else type(scheduler)
    return "step" if issubclass(cls, PER_STEP_SCHEDULERS) else "epoch"


def check_scheduler_interval(scheduler: Any, interval: Any) -> None:
    """``model.scheduler_interval``: epoch, step or None (the scheduler's default); a
    ``ReduceLROnPlateau`` (which steps on a validation's ``val/loss``) refused per step."""
    if interval is not None and interval not in INTERVALS:
        raise ModelConfigError(
            f"model.scheduler_interval must be epoch, step or null (the scheduler's own), got "
            f"{interval!r}"
        )
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    cls = scheduler_class(scheduler)
    if interval == "step" and (cls is plateau or isinstance(scheduler, plateau)):
        raise ModelConfigError(
            "model.scheduler_interval step: ReduceLROnPlateau steps on a validation's val/loss, "
            "once an epoch; give scheduler_interval epoch (or leave it unset), or another "
            "scheduler"
        )


# torch's schedules whose arguments count scheduler steps: stepped once an epoch, a length
# meant in optimizer steps (a cosine of T_max 20000) barely moves in a fit of a few epochs
STEP_COUNT_ARGUMENTS = {
    torch.optim.lr_scheduler.CosineAnnealingLR: ("T_max",),
    torch.optim.lr_scheduler.CosineAnnealingWarmRestarts: ("T_0",),
    torch.optim.lr_scheduler.LinearLR: ("total_iters",),
    torch.optim.lr_scheduler.ConstantLR: ("total_iters",),
    torch.optim.lr_scheduler.PolynomialLR: ("total_iters",),
    torch.optim.lr_scheduler.StepLR: ("step_size",),
    torch.optim.lr_scheduler.MultiStepLR: ("milestones",),
}


def fit_epochs(trainer: Any) -> float:
    """The epochs the fit will train at most (``inf`` where unknown): ``max_epochs``, or as many
    as ``max_steps`` optimizer steps take where that ends the fit first."""
    epochs = getattr(trainer, "max_epochs", None)
    epochs = epochs if isinstance(epochs, int) and epochs > 0 else math.inf
    max_steps = getattr(trainer, "max_steps", -1)
    if isinstance(max_steps, int) and max_steps > 0:
        try:
            steps = stepping_batches(trainer)  # (sets num_training_batches up)
            batches = trainer.num_training_batches
            accumulate = max(int(getattr(trainer, "accumulate_grad_batches", 1)), 1)
        except Exception:  # noqa: BLE001 - a warning's estimate: no estimate, no warning
            return epochs
        if math.isfinite(batches) and batches > 0 and math.isfinite(steps):
            epochs = min(epochs, math.ceil(steps / math.ceil(batches / accumulate)))
    return epochs


def warn_step_sized_arguments(scheduler: Any, trainer: Any) -> None:
    """A torch scheduler stepped once an epoch by default whose length (``T_max``,
    ``total_iters``, ...) is more than the fit's epochs: likely meant in optimizer steps. One
    warning line naming ``--model.scheduler_interval step``."""
    cls = scheduler_class(scheduler)
    names = STEP_COUNT_ARGUMENTS.get(cls) if cls is not None else None
    given = getattr(scheduler, "keywords", None)
    if not names or not isinstance(given, dict) or trainer is None:
        return
    lengths = {}
    for name in names:
        value = given.get(name)
        value = max(value, default=None) if isinstance(value, (list, tuple)) else value
        if isinstance(value, int) and not isinstance(value, bool):
            lengths[name] = value
    if not lengths:
        return
    epochs = fit_epochs(trainer)
    name, length = max(lengths.items(), key=lambda item: item[1])
    if not math.isfinite(epochs) or length <= epochs:
        return
    warn_once(
        f"model.scheduler {cls.__name__} steps once an epoch, and its {name} {length} is more "
        f"than the fit's {epochs} epochs: if it counts optimizer steps, give "
        f"--model.scheduler_interval step (--model.scheduler_interval epoch: meant so)"
    )


def scheduler_steps(trainer: Any, interval: SchedulerInterval) -> int | float:
    """How many times the fit steps a schedule of ``interval``: its optimizer steps
    (:func:`stepping_batches`), or its epochs (``inf`` where unknown)."""
    if trainer is None:
        return math.inf
    if interval == "step":
        return stepping_batches(trainer)
    epochs = getattr(trainer, "max_epochs", None)
    return epochs if isinstance(epochs, int) and epochs > 0 else math.inf


# the schedules build_scheduler sized to the fit -> the fit's count (what a resumed fit's
# checkpoint state replaces: check_resumed_sizes)
_SIZED_TO_FIT: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def build_scheduler(
    scheduler: LRSchedulerCallable,
    optimizer: Any,
    trainer: Any = None,
    interval: SchedulerInterval | None = None,
) -> Any:
    """``scheduler(optimizer)``; a ``OneCycleLR`` given neither ``total_steps`` nor ``epochs``,
    or a :class:`WarmupCosineLR` given no ``total_steps``, is sized to the fit: its optimizer
    steps (:func:`stepping_batches`), or its epochs where it steps once an epoch
    (``interval``, else the class's :func:`default_interval`)."""
    cls = scheduler_class(scheduler)
    sized = (torch.optim.lr_scheduler.OneCycleLR, WarmupCosineLR)
    if cls is None or not issubclass(cls, sized):
        return scheduler(optimizer)
    given = getattr(scheduler, "keywords", {})
    if given.get("total_steps") is not None or given.get("epochs") is not None:
        return scheduler(optimizer)
    total = scheduler_steps(trainer, interval or default_interval(cls))
    if not math.isfinite(total):
        raise ModelConfigError(
            f"model.scheduler {cls.__name__} needs the run's length: give its total_steps, or "
            f"trainer.max_epochs or trainer.max_steps to size it from"
        )
    # (a fit of no training batch steps none: 1, not torch's refusal of 0)
    built = scheduler(optimizer, total_steps=max(int(total), 1))
    _SIZED_TO_FIT[built] = built.total_steps
    return built


def check_resumed_sizes(schedules: Iterable[Any]) -> None:
    """At the start of a resumed fit (the schedules' states restored): a schedule sized to the
    fit keeps the checkpoint's length (torch restores ``total_steps``), not this fit's. A
    longer fit (more epochs or steps than the checkpoint's) would take a ``OneCycleLR`` past
    its end, which raises at that step: refused in one line now. A ``WarmupCosineLR`` stays at
    its floor past its end (or a shorter fit ends above it): said in a warning line."""
    for schedule in schedules:
        sized = _SIZED_TO_FIT.get(schedule)
        kept = getattr(schedule, "total_steps", None)
        if sized is None or kept is None or kept == sized:
            continue
        name = type(schedule).__name__
        where = (
            f"model.scheduler {name} was sized to the checkpoint's fit ({kept} optimizer "
            f"steps), and a schedule resumes with its length; this fit has {sized}"
        )
        if isinstance(schedule, torch.optim.lr_scheduler.OneCycleLR) and sized > kept:
            raise ModelConfigError(
                f"{where}: OneCycleLR cannot step past its end. Resume with the checkpoint's "
                f"trainer.max_epochs / max_steps, or train anew from its weights"
            )
        past = "its rate stays at its floor past them" if sized > kept else "it ends first"
        warn_once(f"{where}: {past}")


def configure_optimizers(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: OptimizerCallable,
    scheduler: LRSchedulerCallable | None,
    precision: str | None = None,
    trainer: Any = None,
    interval: SchedulerInterval | None = None,
) -> Any:
    """The injected optimizer, and the scheduler stepped per epoch on ``val/loss`` (which
    ``ReduceLROnPlateau`` needs and other schedulers ignore), or per optimizer step: where
    ``interval`` (``model.scheduler_interval``) says ``step``, and by default for a scheduler
    that says so (``interval = "step"``, e.g. :class:`InverseSquareRootLR`,
    :class:`WarmupCosineLR`) and for torch's per-batch ones (:data:`PER_STEP_SCHEDULERS`):
    :func:`default_interval`. A ``OneCycleLR`` without ``total_steps`` (a ``WarmupCosineLR``
    too) is sized to the fit (``trainer``'s: :func:`build_scheduler`). A torch schedule left
    per epoch whose length looks like optimizer steps is warned of
    (:func:`warn_step_sized_arguments`).

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
    check_scheduler_interval(scheduler, interval)
    schedule = build_scheduler(scheduler, built, trainer, interval)
    check_scheduler_interval(schedule, interval)  # (a factory whose class was not known)
    if interval is None:
        interval = default_interval(schedule)
        if interval == "epoch":
            warn_step_sized_arguments(scheduler, trainer)
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
