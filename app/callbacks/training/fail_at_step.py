"""An injected failure, to test and demonstrate exact resume (``fit --ckpt_path``)."""

from __future__ import annotations

import os
from typing import Any

import lightning as L


class InjectedFailure(RuntimeError):
    """Raised by :class:`FailAtStep`."""


class FailAtStep(L.Callback):
    """Stops training with :class:`InjectedFailure` when ``global_step`` reaches ``step``,
    before that batch is trained: as if the job was killed right after the optimizer step
    ``step`` (and a checkpoint saved then).

    ``python cli.py fit ... --trainer.callbacks+ app.callbacks.training.fail_at_step.FailAtStep
    --trainer.callbacks.step 14``
    """

    def __init__(self, step: int) -> None:
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        self.step = step

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step >= self.step:
            raise InjectedFailure(f"injected failure at global step {trainer.global_step}")


class SignalAtStep(L.Callback):
    """Sends this process ``signal`` (``SIGTERM``, ``SIGINT``...) when ``global_step`` reaches
    ``step``, in the middle of a batch: as a cluster scheduler preempting the job would.

    ``python cli.py fit ... --trainer.callbacks+ app.callbacks.training.fail_at_step.SignalAtStep
    --trainer.callbacks.step 14 --trainer.callbacks.signal SIGTERM``
    """

    def __init__(self, step: int, signal: str = "SIGTERM") -> None:
        import signal as signals

        self.step, self.signum = step, getattr(signals, signal)
        self.sent = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step >= self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), self.signum)
