"""EpochTimer: ``time/train_epoch_s`` counts training batches only, not validation (neither the
validation inside an epoch nor the one at its end) nor the sanity check."""

import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
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


class TimedSteps(SlowValidation):
    """Each training step's seconds, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.step_seconds: list[float] = []

    def training_step(self, batch, batch_idx):
        start = time.perf_counter()
        loss = super().training_step(batch, batch_idx)
        self.step_seconds.append(time.perf_counter() - start)
        return loss


def test_an_epoch_resumed_inside_counts_the_seconds_before_its_checkpoint(tmp_path):
    """Lightning calls no ``on_train_epoch_start`` for the epoch a fit resumes inside: the
    clock once read the process's uptime there (hours). The resumed epoch's figure is its
    training seconds before the checkpoint plus those after."""
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    options = dict(max_epochs=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    first = TimedSteps()
    L.Trainer(callbacks=[EpochTimer(), every], **options).fit(first, loader())
    mid_epoch = tmp_path / "epoch=0-step=2.ckpt"
    resumed, timer = TimedSteps(), EpochTimer()
    trainer = L.Trainer(callbacks=[timer], **options)
    trainer.fit(resumed, loader(), ckpt_path=mid_epoch)
    assert len(resumed.step_seconds) == BATCHES - 2  # it resumed inside the epoch
    expected = sum(first.step_seconds[:2]) + sum(resumed.step_seconds)
    logged = float(trainer.callback_metrics["time/train_epoch_s"])
    assert expected <= logged < expected + 2 * TRAIN_SLEEP
