"""Logs wall-clock seconds per training epoch (validation excluded)."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn

from app.callbacks.training.resume import resumed_mid_epoch


class EpochTimer(Callback):
    """Logs ``time/train_epoch_s``: seconds spent in training batches of each epoch. An epoch
    resumed from a checkpoint written inside it counts the seconds before it too (saved in
    the checkpoint), as the uninterrupted epoch would."""

    def __init__(self) -> None:
        self._start: float | None = None  # None: no epoch is being timed in this process
        self._paused_at: float | None = None
        self._paused = 0.0
        self._before = 0.0  # the epoch's seconds before the checkpoint a fit resumed from

    def _restart(self, before: float = 0.0) -> None:
        self._start, self._paused, self._paused_at = time.perf_counter(), 0.0, None
        self._before = before

    def _seconds(self) -> float:
        if self._start is None:
            return self._before
        now = time.perf_counter()
        running_validation = (now - self._paused_at) if self._paused_at is not None else 0.0
        return self._before + now - self._start - self._paused - running_validation

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if resumed_mid_epoch(trainer):  # this epoch gets no on_train_epoch_start
            self._restart(before=self._before)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restart()

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
        pl_module.log("time/train_epoch_s", self._seconds(), on_epoch=True, on_step=False)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch_train_s": self._seconds()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._before = float(state_dict.get("epoch_train_s", 0.0))
