"""The optimizer + scheduler configuration every LightningModule of the app returns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable


def configure_optimizers(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: OptimizerCallable,
    scheduler: LRSchedulerCallable | None,
) -> Any:
    """The injected optimizer, and the scheduler stepped per epoch on ``val/loss`` (which
    ``ReduceLROnPlateau`` needs and other schedulers ignore)."""
    built = optimizer(parameters)
    if scheduler is None:
        return built
    return {
        "optimizer": built,
        "lr_scheduler": {"scheduler": scheduler(built), "monitor": "val/loss", "interval": "epoch"},
    }
