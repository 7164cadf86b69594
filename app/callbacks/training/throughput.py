"""Tokens per second, without a device sync per batch.

Lightning's ``ThroughputMonitor`` times every batch, and to time a batch on a GPU it waits for
the device to finish it (``torch.cuda.synchronize`` after each one): the host then never queues
the next step while the device runs this one, which is most of a small (launch-bound) step's
speed. Its rolling window needs those per-batch times, so it is not used here: the device is
synced only where Lightning reads the step metrics back anyway (its logging interval) and at
an evaluation pass's start and end, and the tokens between two such points over the time
between them give the rate.
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from app.callbacks.training.logging_steps import logs_this_batch
from app.callbacks.training.resume import resumed_mid_epoch


def _tokens(batch: Any) -> int:
    """A batch's tokens (shape metadata: nothing read from the device)."""
    return batch["ids"].numel() if isinstance(batch, dict) else batch[0].numel()


class TokenThroughputMonitor(L.Callback):
    """Tokens per second, on the training step axis:

    - ``train/tokens_per_sec``: the tokens of the batches since the last logged step over
      their time, logged at each logging step (the time of validations left out);
    - ``val/tokens_per_sec``, ``test/tokens_per_sec``: one figure per pass, logged with that
      pass's metrics (at the step of the model measured).

    Under DDP the figures are of all devices together (a rank's tokens times the world size).
    """

    def __init__(self) -> None:
        self._tokens = 0  # training tokens since the window's start
        self._seconds = 0.0  # the window's time before its last pause (a validation)
        self._start: float | None = None  # when the window (re)started; None: paused
        self._pass_start = 0.0
        self._pass_tokens = 0

    @staticmethod
    def _now(trainer: L.Trainer) -> float:
        """The time once the device has run everything queued (the one sync of a point)."""
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    # -- training: a window per logging interval ----------------------------------------------
    def _restart(self, start: float) -> None:
        self._tokens, self._seconds, self._start = 0, 0.0, start

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if resumed_mid_epoch(trainer):  # this epoch gets no on_train_epoch_start
            self._restart(self._now(trainer))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restart(self._now(trainer))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:  # fmt: skip
        self._tokens += _tokens(batch)
        if not logs_this_batch(trainer) or self._start is None:
            return
        now = self._now(trainer)
        seconds = self._seconds + now - self._start
        if seconds > 0:
            rate = self._tokens * trainer.world_size / seconds
            pl_module.log("train/tokens_per_sec", rate, on_step=True, rank_zero_only=True)
        self._restart(now)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is not None and not trainer.sanity_checking:  # pause the window
            self._seconds += self._now(trainer) - self._start
            self._start = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._start is None and trainer.state.fn == "fit":  # resume it
            self._start = self._now(trainer)

    # -- one figure per evaluation pass -------------------------------------------------------
    def _start_pass(self, trainer: L.Trainer) -> None:
        self._pass_start, self._pass_tokens = self._now(trainer), 0

    def _count(self, trainer: L.Trainer, batch: Any) -> None:
        if not trainer.sanity_checking:
            self._pass_tokens += _tokens(batch)

    def _log_pass(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.sanity_checking or not self._pass_tokens:
            return
        seconds = self._now(trainer) - self._pass_start
        if seconds > 0:
            rate = self._pass_tokens * trainer.world_size / seconds
            pl_module.log(f"{stage}/tokens_per_sec", rate, on_epoch=True, rank_zero_only=True)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._start_pass(trainer)

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self._start_pass(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, *args, **kwargs) -> None:
        self._count(trainer, batch)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, *args, **kwargs) -> None:
        self._count(trainer, batch)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._log_pass(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._log_pass(trainer, pl_module, "test")
