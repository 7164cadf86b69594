"""EpochTimer: ``time/train_epoch_s`` counts training batches only, not validation (neither the
validation inside an epoch nor the one at its end) nor the sanity check."""

import time

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from app.callbacks import EpochTimer

pytestmark = pytest.mark.usefixtures("one_thread")
TRAIN_SLEEP, VAL_SLEEP, BATCHES = 0.05, 0.25, 4


class SlowValidation(L.LightningModule):
    """Training batches take ``TRAIN_SLEEP`` s, validation batches ``VAL_SLEEP`` s (much longer)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.train_seconds = 0.0

    def training_step(self, batch, batch_idx):
        start = time.perf_counter()
        time.sleep(TRAIN_SLEEP)
        loss = self.layer(batch[0]).pow(2).mean()
        self.train_seconds += time.perf_counter() - start
        return loss

    def validation_step(self, batch, batch_idx):
        time.sleep(VAL_SLEEP)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    return DataLoader(TensorDataset(torch.randn(BATCHES, 2)), batch_size=1)


def test_train_epoch_seconds_exclude_validation_and_sanity_check(tmp_path):
    model = SlowValidation()
    trainer = L.Trainer(
        max_epochs=1,
        val_check_interval=2,  # a validation in the middle of the epoch and one at its end
        limit_val_batches=2,
        num_sanity_val_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[EpochTimer()],
    )
    start = time.perf_counter()
    trainer.fit(model, loader(), loader())
    total = time.perf_counter() - start
    logged = float(trainer.callback_metrics["time/train_epoch_s"])
    validation = 3 * 2 * VAL_SLEEP  # sanity check + two validations, two batches each
    assert total > validation
    assert model.train_seconds <= logged < model.train_seconds + 0.5 * VAL_SLEEP
    assert logged < validation / 2
