"""Logs wall-clock seconds per training epoch (validation excluded)."""

from __future__ import annotations

import time

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn


class EpochTimer(Callback):
    """Logs ``time/train_epoch_s``: seconds spent in training batches of each epoch."""

    def __init__(self) -> None:
        self._start = 0.0
        self._paused_at: float | None = None
        self._paused = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start, self._paused, self._paused_at = time.perf_counter(), 0.0, None

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning sets ``trainer.validating`` (so ``training`` is False) before this hook,
        # also inside fit: the fit stage is what says the epoch clock is running
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self._paused_at = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._paused_at is not None:
            self._paused += time.perf_counter() - self._paused_at
            self._paused_at = None

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = time.perf_counter()
        running_validation = (now - self._paused_at) if self._paused_at is not None else 0.0
        seconds = now - self._start - self._paused - running_validation
        pl_module.log("time/train_epoch_s", seconds, on_epoch=True, on_step=False)
