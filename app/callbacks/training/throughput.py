"""Tokens per second, through Lightning's ``ThroughputMonitor``."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage


def _streams(batch: Any) -> int:
    return 1 if isinstance(batch, dict) else batch[0].size(0)  # predict: one prompt


def _tokens(batch: Any) -> int:
    return batch["ids"].numel() if isinstance(batch, dict) else batch[0].numel()


class TokenThroughputMonitor(ThroughputMonitor):
    """Tokens per second, on the training step axis:

    - ``train/tokens_per_sec``: a rolling mean over ``window_size`` steps (Lightning's
      ``Throughput``; the time of validations left out), every ``log_every_n_steps``;
    - ``val/tokens_per_sec``, ``test/tokens_per_sec``: one figure per pass, logged with that
      pass's metrics (at the step of the model measured).

    Under DDP the figures are of all devices together. Lightning's monitor would also log its
    counters (``train/time``, ``train/batches``, ``train/samples``, ``train/lengths``) and the
    evaluation rates at evaluation-batch steps, which restart each epoch (curves that run
    backwards): neither is logged.
    """

    def __init__(self, window_size: int = 20) -> None:
        super().__init__(batch_size_fn=_streams, length_fn=_tokens, window_size=window_size)
        self._pass_start = 0.0
        self._pass_seconds = 0.0
        self._pass_tokens = 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        # No FLOP count for these models: tell the monitor so instead of warning each run.
        if not hasattr(pl_module, "flops_per_batch"):
            pl_module.flops_per_batch = None
        super().setup(trainer, pl_module, stage)

    def _compute(self, trainer: L.Trainer, iter_num: int | None = None) -> None:
        """Nothing: the figures worth a curve are logged by the hooks below."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        throughput = self._throughputs.get(RunningStage.TRAINING)
        if not trainer.is_global_zero or throughput is None:
            return
        rates = throughput.compute()  # per-step rates once the window is full
        rate = rates.get("items_per_sec", rates.get("device/items_per_sec"))
        if rate is not None:  # Lightning sends it to the loggers every log_every_n_steps
            pl_module.log("train/tokens_per_sec", rate, on_step=True, rank_zero_only=True)

    # -- one figure per evaluation pass -----------------------------------------------------
    def _start_pass(self, trainer: L.Trainer, *_: Any) -> None:
        self._pass_start, self._pass_seconds, self._pass_tokens = time.perf_counter(), 0.0, 0

    def _count(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any) -> None:
        if trainer.sanity_checking:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # the batch's kernels are part of its time
        self._pass_tokens += _tokens(batch)
        self._pass_seconds = time.perf_counter() - self._pass_start

    def _log_pass(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.sanity_checking or self._pass_seconds <= 0 or not trainer.is_global_zero:
            return
        rate = self._pass_tokens * trainer.world_size / self._pass_seconds
        pl_module.log(f"{stage}/tokens_per_sec", rate, on_epoch=True, rank_zero_only=True)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._start_pass(trainer)

    def on_test_epoch_start(self, trainer, pl_module) -> None:
        self._start_pass(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, *args, **kwargs) -> None:
        super().on_validation_batch_end(trainer, pl_module, outputs, batch, *args, **kwargs)
        self._count(trainer, pl_module, batch)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, *args, **kwargs) -> None:
        super().on_test_batch_end(trainer, pl_module, outputs, batch, *args, **kwargs)
        self._count(trainer, pl_module, batch)

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        self._log_pass(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer, pl_module) -> None:
        self._log_pass(trainer, pl_module, "test")
