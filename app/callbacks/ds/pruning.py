"""Group-lasso pruning of DS-Softmax experts (Algorithm 1, lines 6-11)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch

from app.callbacks.ds.optim import DSCallback, change_structure, find_ds_head
from app.callbacks.training.resume import resumed_mid_epoch
from heads.errors import HeadConfigError


class DSPruning(DSCallback):
    """Zero and drop expert rows whose norm is below ``gamma`` once the task loss is low.

    Every ``every_n_steps`` optimizer steps, if the mean task loss (``loss_key`` as logged by
    the module, averaged over those batches and over DDP ranks) is below ``loss_threshold``,
    the head drops rows with ``||W^(k)_c||_2 < gamma``. The row norms are parameters, identical
    on every rank after DDP's all-reduce, so all ranks take the same decision.

    Departures from the paper: a pruned row is deleted, not kept at zero (Algorithm 1 line 9
    zeroes it, and a zero row could grow again); the only gate is the loss threshold (the
    paper's schedule, Sec. 4.5, also waits 10 epochs after each split: use
    ``every_n_steps``/``loss_threshold`` or a Mitosis schedule for that).

    Args:
        loss_threshold: prune only while the task loss is below this (Algorithm 1's ``t``).
        gamma: row-norm threshold (paper: 0.01).
        keep_every_class: every class keeps at least one expert (paper default); ``False`` is
            the paper's ``*`` variant.
        every_n_steps: how often to check (each structural change rebuilds the optimizer).
        loss_key: the logged task loss (without the regularisers). ``None``: ``train/nll``
            where the module logs it (translation: its ``train/loss`` adds the head's
            regularisers and label smoothing), else ``train/loss`` (language model,
            classifier: the task's loss alone).
        stop_epoch: from this epoch on, no more pruning and the head's group-lasso weights are
            0: the structure is fixed and its surviving rows are fine-tuned for the task alone
            (a last stage after mitosis). ``None``: prune until the end.
        max_peak_softmaxes: memory budget in softmax layers (``V`` rows): a prune copies the
            surviving rows while the old ones still exist, so it waits until rows before plus
            rows after fit (right after a mitosis split, until enough rows fell below gamma).
    """

    def __init__(
        self,
        loss_threshold: float = float("inf"),
        gamma: float = 0.01,
        keep_every_class: bool = True,
        every_n_steps: int = 50,
        loss_key: str | None = None,
        stop_epoch: int | None = None,
        max_peak_softmaxes: float | None = None,
    ) -> None:
        if gamma < 0:
            raise HeadConfigError(f"gamma must be non-negative, got {gamma}")
        if every_n_steps <= 0:
            raise HeadConfigError(f"every_n_steps must be positive, got {every_n_steps}")
        if max_peak_softmaxes is not None and max_peak_softmaxes <= 0:
            raise HeadConfigError(f"max_peak_softmaxes must be positive, got {max_peak_softmaxes}")
        self.loss_threshold = loss_threshold
        self.gamma = gamma
        self.keep_every_class = keep_every_class
        self.every_n_steps = every_n_steps
        self.loss_key = loss_key
        self.stop_epoch = stop_epoch
        self.max_peak_softmaxes = max_peak_softmaxes
        self.pruned_rows = 0
        self.peak_rows = 0
        self._loss_sum: torch.Tensor | float = 0.0  # on the loss's device: summed, not read
        self._loss_count = 0

    def task_loss_key(self, metrics: Mapping[str, Any]) -> str:
        """The logged loss that Algorithm 1's threshold is held against (``loss_key``)."""
        return self.loss_key or ("train/nll" if "train/nll" in metrics else "train/loss")

    def _stopped(self, trainer: L.Trainer) -> bool:
        return self.stop_epoch is not None and trainer.current_epoch >= self.stop_epoch

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if resumed_mid_epoch(trainer):  # this epoch gets no on_train_epoch_start
            self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stopped(trainer):  # re-applied on every (resumed) epoch: no state to save
            _, head = find_ds_head(pl_module)
            head.lambda_lasso = head.lambda_expert = 0.0

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        loss = trainer.callback_metrics.get(self.task_loss_key(trainer.callback_metrics))
        if loss is not None:  # summed on the device: read back only when a check is due
            self._loss_sum = loss.detach().float() + self._loss_sum
            self._loss_count += 1
        stepped = self.optimizer_stepped(trainer)  # not inside an accumulation window
        if self._stopped(trainer) or not stepped or (trainer.global_step % self.every_n_steps):
            return
        if not self._loss_count:
            return
        mean = torch.as_tensor(self._loss_sum / self._loss_count).to(pl_module.device)
        mean = trainer.strategy.reduce(mean, reduce_op="mean")
        self._loss_sum, self._loss_count = 0.0, 0
        if float(mean) < self.loss_threshold:
            self.prune(trainer, pl_module)

    def prune(self, trainer: L.Trainer, pl_module: L.LightningModule) -> int:
        """Prune now; returns the number of rows dropped."""
        _, head = find_ds_head(pl_module)
        before = head.weight.size(0)
        budget = None
        if self.max_peak_softmaxes is not None:
            budget = int(self.max_peak_softmaxes * head.vocab_size) - before
        kept = change_structure(
            trainer, pl_module, lambda head: head.prune(self.gamma, self.keep_every_class, budget)
        )
        if kept is None:
            return 0
        dropped = before - head.weight.size(0)
        self.pruned_rows += dropped
        # the surviving rows are copied out while the old tensor still exists: R + R' at once
        self.peak_rows = max(self.peak_rows, before + head.weight.size(0))
        pl_module.log("ds/rows", float(head.weight.size(0)), on_step=True, on_epoch=False)
        pl_module.log(
            "ds/prune_peak_softmaxes",
            self.peak_rows / head.vocab_size,
            on_step=True,
            on_epoch=False,
        )
        return dropped

    def state_dict(self) -> dict[str, Any]:
        # the loss window in progress too: a fit stopped inside it decides its next prune on
        # the whole window, not on the batches since the resume (read back only here, when
        # a checkpoint is written)
        return {
            "pruned_rows": self.pruned_rows,
            "peak_rows": self.peak_rows,
            "loss_sum": float(self._loss_sum),
            "loss_count": self._loss_count,
        }

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Under DDP each rank sums its own losses (the same count on every rank) and the
        # decision takes their mean: the checkpoint keeps the ranks' mean sum, which every
        # rank continues from (every rank writes a checkpoint, so all take part)
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is not None and trainer.world_size > 1:
            window = torch.as_tensor(self._loss_sum, dtype=torch.float32, device=pl_module.device)
            state["loss_sum"] = float(trainer.strategy.reduce(window, reduce_op="mean"))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruned_rows = state_dict["pruned_rows"]
        self.peak_rows = state_dict.get("peak_rows", 0)
        # (a checkpoint written before the window was saved: it starts afresh)
        self._loss_sum = state_dict.get("loss_sum", 0.0)
        self._loss_count = state_dict.get("loss_count", 0)
