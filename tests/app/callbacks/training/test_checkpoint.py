"""``last.ckpt`` is the latest state after every check, improved or not; ``fast_dev_run``
writes nothing."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

from app.callbacks import ModelCheckpoint

VAL_LOSS = [3.0, 2.0, 5.0, 4.0]  # epoch 2 does not improve: no top-k checkpoint there


class ScriptedLoss(BoringModel):
    def on_validation_epoch_end(self) -> None:
        self.log("val/loss", VAL_LOSS[self.current_epoch])


class LastAtEpochStart(Callback):
    """The epoch ``last.ckpt`` holds when each training epoch starts (what a crash resumes)."""

    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = trainer.checkpoint_callback.last_model_path
        if path:
            self.epochs.append(torch.load(path, weights_only=False)["epoch"])


def fit(tmp_path, checkpoint, **trainer) -> LastAtEpochStart:
    seen = LastAtEpochStart()
    options = dict(max_epochs=4, limit_train_batches=2, limit_val_batches=1, logger=False,
                   enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    L.Trainer(callbacks=[checkpoint, seen], **{**options, **trainer}).fit(ScriptedLoss())
    return seen


@pytest.mark.parametrize("at_epoch_end", [False, True])
def test_last_is_the_latest_epoch_even_when_validation_did_not_improve(tmp_path, at_epoch_end):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_last=True,
                                 save_on_train_epoch_end=at_epoch_end)  # fmt: skip
    seen = fit(tmp_path, checkpoint)
    assert seen.epochs == [0, 1, 2]  # Lightning's own: [0, 1, 1]
    assert checkpoint.best_model_score == 2.0  # the best is kept as before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1-step=4.ckpt", "last.ckpt"]


def test_lightnings_own_keeps_last_at_the_best_epoch(tmp_path):
    """What the subclass is for: if Lightning's changes, this one says so."""
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="val/loss",
                                                     save_last=True)  # fmt: skip
    assert fit(tmp_path, checkpoint).epochs == [0, 1, 1]


def test_fast_dev_run_writes_no_checkpoint(tmp_path):
    fit(tmp_path, ModelCheckpoint(dirpath=tmp_path, monitor="val/loss", save_last=True),
        fast_dev_run=2)  # fmt: skip
    assert list(tmp_path.iterdir()) == []
