"""A training epoch resumed where a mid-epoch checkpoint stopped it, for every task.

The data position is the training loader's (``datamodules/resumable.py``: Lightning saves its
``state_dict`` and hands it back). What else the epoch had built up is the task's: the running
sums of its training metrics (the epoch's train perplexity) and, for a recurrent language model,
the state carried from window to window. A checkpoint written mid-epoch keeps both under
:data:`TRAIN_STATE_KEY` (every rank's, under DDP: each has its own streams and sums), and the
resumed run gives them back before its first batch, so its epoch ends as the uninterrupted one
would have.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torchmetrics import Metric

from datamodules.resumable import ResumableLoader

TRAIN_STATE_KEY = "train_epoch_state"
# the same entry as the language model wrote it before translation resumed mid-epoch too
_EARLIER_KEYS = ("language_model_train_state",)


def resumable_loader(trainer: L.Trainer | None) -> ResumableLoader | None:
    """The fit's training loader where it keeps its position, else None."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return None
    loader = trainer.train_dataloader
    return loader if isinstance(loader, ResumableLoader) else None


def save_epoch_state(module: L.LightningModule, checkpoint: dict[str, Any],
                     metrics: dict[str, Metric], state: Any) -> None:  # fmt: skip
    """Write the epoch's ``metrics`` sums and ``state`` into ``checkpoint`` (called on every
    rank: under DDP they are gathered)."""
    sums = {
        name: {key: value.detach().clone() for key, value in metric.metric_state.items()}
        for name, metric in metrics.items()
    }
    world_size = module.trainer.world_size
    if world_size > 1:  # each rank carries its own streams and sums: keep every rank's
        state, sums = module.all_gather((state, sums))
    checkpoint[TRAIN_STATE_KEY] = {
        "world_size": world_size,
        "state": apply_to_collection(state, torch.Tensor, lambda t: t.detach().cpu()),
        "metrics": {name: {k: v.cpu() for k, v in values.items()} for name, values in sums.items()},
    }


def read_epoch_state(checkpoint: dict[str, Any], trainer: L.Trainer | None) -> dict | None:
    """This rank's ``{"state", "metrics"}`` from a checkpoint written by as many processes as
    this run has, else None (another world size starts the epoch's sums afresh)."""
    saved = next((checkpoint[k] for k in (TRAIN_STATE_KEY, *_EARLIER_KEYS) if k in checkpoint),
                 None)  # fmt: skip
    if saved is None or trainer is None or saved["world_size"] != trainer.world_size:
        return None
    if saved["world_size"] == 1:
        return saved
    rank = trainer.global_rank
    return {
        "state": apply_to_collection(saved["state"], torch.Tensor, lambda t: t[rank]),
        "metrics": {
            name: {key: value[rank] for key, value in values.items()}
            for name, values in saved["metrics"].items()
        },
    }


def restore_metrics(metrics: dict[str, Metric], saved: dict[str, dict],
                    device: torch.device) -> None:  # fmt: skip
    """Give ``metrics`` back the sums a checkpoint saved."""
    for name, metric in metrics.items():
        for key, value in saved.get(name, {}).items():
            setattr(metric, key, value.to(device))
        metric._update_count = max(metric._update_count, 1)  # holds values: no warning


def mark_position(trainer: L.Trainer, loader: ResumableLoader, batch_idx: int) -> None:
    """The data position a checkpoint saves: batch ``batch_idx`` is being trained on; after the
    epoch's last batch the next pass starts from the beginning."""
    done = batch_idx + 1
    loader.mark_consumed(0 if done >= trainer.num_training_batches else done)
