"""What every task module shares: a backbone and a pluggable head, set up, checked and saved
the same way. Everything head-specific is asked of the head (``heads/base.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable

from heads import Head, HeadSetup
from lightning_modules.checks import HEAD_KEY, check_checkpoint_head, head_class_name
from lightning_modules.optimization import configure_optimizers


class HeadTask(L.LightningModule):
    """Base of the task modules: ``self.backbone``, ``self.head`` and the optimizer factories.

    - ``setup("fit")`` sets the head up for the training device (``Head.setup``): what it
      decides from local facts (timings) is decided on rank 0 and broadcast, so every DDP rank
      builds the same head.
    - Loading a checkpoint restores the data module's state (its vocabulary) first and checks
      the head's state, so a mismatch is named before Lightning loads any weight.
    """

    backbone: torch.nn.Module
    head: Head
    optimizer_factory: OptimizerCallable
    scheduler_factory: LRSchedulerCallable | None

    def setup(self, stage: str) -> None:
        if stage != "fit" or self._trainer is None:
            return
        trainer = self.trainer
        datamodule = getattr(trainer, "datamodule", None)
        self.head.setup(
            HeadSetup(
                device=trainer.strategy.root_device,
                decide_once=self._decide_once,
                token_counts=getattr(datamodule, "token_counts", None),
            )
        )

    def _decide_once(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` on global rank 0 only, its result broadcast to every rank."""
        trainer = self.trainer
        if trainer.world_size == 1:
            return decide()
        return trainer.strategy.broadcast(decide() if trainer.is_global_zero else None, src=0)

    def configure_optimizers(self) -> Any:
        return configure_optimizers(
            self.parameters(), self.optimizer_factory, self.scheduler_factory
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[HEAD_KEY] = head_class_name(self.head)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning restores the data module after the weights; its vocabulary must be checked
        # first, so that a mismatch is reported as such rather than as a shape error. Taking the
        # entry out of the checkpoint keeps Lightning from restoring it a second time.
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        key = type(datamodule).__qualname__
        if datamodule is not None and key in checkpoint:
            datamodule.load_state_dict(checkpoint.pop(key))
        check_checkpoint_head(checkpoint, self.head)
