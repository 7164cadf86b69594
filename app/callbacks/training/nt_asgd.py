"""Non-monotonically triggered averaged SGD (NT-ASGD, Merity et al. 2018, Sec. 3) and the
fine-tuning stage of AWD-LSTM / MoS, on top of ``torch.optim.ASGD``.

The optimizer is ``torch.optim.ASGD`` with ``lambd = 0`` (so its step is plain SGD) and a
huge ``t0`` (so it does not average yet). After each validation, once the validation loss is
worse than the best of all but the last ``nonmono`` validations, this callback sets the
groups' ``t0`` to the current step: from then on ASGD keeps the running average of the
iterates in its state (``ax``), exactly as the reference code switches to
``ASGD(t0=0, lambd=0)``.

Validation (and so the checkpoints ModelCheckpoint writes right after it) uses the averaged
weights: they are swapped in when validation starts and the training weights come back
before the next training batch. The training weights travel in this callback's state, so a
resumed fit continues from them.

``finetune=True`` is the second stage (the reference ``finetune.py``): start from the first
stage's best checkpoint (``model.init_args.pretrained_checkpoint``), average from the first
step, and stop when the same non-monotone criterion fires.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_modules.errors import ModelConfigError


class NTASGD(Callback):
    """Args:
    nonmono: the non-monotone interval n (5 in AWD-LSTM and MoS).
    monitor: the validation loss logged by the task.
    finetune: average from the first step; stop training when the criterion fires.
    """

    def __init__(self, nonmono: int = 5, monitor: str = "val/loss", finetune: bool = False):
        if nonmono < 1:
            raise ModelConfigError(f"NTASGD nonmono must be >= 1, got {nonmono}")
        self.nonmono, self.monitor, self.finetune = nonmono, monitor, finetune
        self.history: list[float] = []
        self.triggered_at: int | None = None  # optimizer step where averaging started
        self._training_weights: dict[str, torch.Tensor] | None = None

    # -- the optimizer ---------------------------------------------------------------------
    @staticmethod
    def _optimizer(trainer: L.Trainer) -> torch.optim.ASGD:
        optimizers = trainer.optimizers
        if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.ASGD):
            found = [type(o).__name__ for o in optimizers]
            raise ModelConfigError(
                f"NTASGD needs one torch.optim.ASGD optimizer (lambd: 0, t0: 1.0e12), got "
                f"{found}: set model.init_args.optimizer (configs/optimizers/asgd_awd.yaml)"
            )
        return optimizers[0]

    def _start_averaging(self, trainer: L.Trainer) -> None:
        optimizer = self._optimizer(trainer)
        step = self._optimizer_step(optimizer)
        for group in optimizer.param_groups:
            group["t0"] = float(step)
        self.triggered_at = step

    @staticmethod
    def _optimizer_step(optimizer: torch.optim.ASGD) -> int:
        steps = [float(s["step"]) for s in optimizer.state.values() if "step" in s]
        return int(max(steps, default=0))

    def _averaging(self, trainer: L.Trainer) -> bool:
        if self.triggered_at is None:
            return False
        return self._optimizer_step(self._optimizer(trainer)) > self.triggered_at

    # -- hooks -----------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._optimizer(trainer)  # fail early on another optimizer
        if self.finetune and self.triggered_at is None:
            self._start_averaging(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self._averaging(trainer):
            return
        if self._training_weights is None:
            self._swap_in_average(trainer, pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            return
        value = float(value)
        fired = len(self.history) > self.nonmono and value > min(self.history[: -self.nonmono])
        self.history.append(value)
        if not fired:
            return
        if self.finetune:
            trainer.should_stop = True
        elif self.triggered_at is None:
            self._start_averaging(trainer)
            pl_module.print(f"NTASGD: averaging from step {self.triggered_at}")

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        if self._training_weights is not None:
            self._swap_out_average(pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.triggered_at is not None:
            pl_module.log("train/asgd_averaging", 1.0)

    # -- weights ---------------------------------------------------------------------------
    def _swap_in_average(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = self._optimizer(trainer).state
        saved = {}
        with torch.no_grad():
            for name, param in pl_module.named_parameters():
                average = state.get(param, {}).get("ax")
                if average is None:
                    continue
                saved[name] = param.detach().clone()
                param.copy_(average)
        self._training_weights = saved

    def _swap_out_average(self, pl_module: L.LightningModule) -> None:
        params = dict(pl_module.named_parameters())
        with torch.no_grad():
            for name, value in self._training_weights.items():
                params[name].copy_(value)
        self._training_weights = None

    def state_dict(self) -> dict[str, Any]:
        weights = self._training_weights
        return {
            "history": list(self.history),
            "triggered_at": self.triggered_at,
            "training_weights": None
            if weights is None
            else {k: v.detach().cpu() for k, v in weights.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self.triggered_at = state_dict.get("triggered_at")
        # the checkpoint holds the averaged weights: the training ones come back before the
        # next training batch (on the module's device)
        self._training_weights = state_dict.get("training_weights")
