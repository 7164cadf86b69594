"""EpochTimer: ``time/train_epoch_s`` counts training batches only, not validation (neither the
validation inside an epoch nor the one at its end) nor the sanity check.

The timer reads a virtual clock that only the batches' "work" advances (``Clock.sleep``): the
figures are exact, whatever the machine's load. (Real sleeps and ``perf_counter`` bounds failed
2 runs in 5 with the 2 cores busy: Lightning's own time per batch, 0.03 to 0.07 s there,
exceeded the slack the bounds allowed.)"""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from app.callbacks import EpochTimer
from app.callbacks.training import epoch_timer

pytestmark = pytest.mark.usefixtures("one_thread")
TRAIN_SLEEP, VAL_SLEEP, BATCHES = 0.05, 0.25, 4
# far from 0: a timer that forgot its epoch's start would read the clock's whole age (the
# process's uptime, with the real clock)
CLOCK_START = 1000.0


class Clock:
    """``time`` for the timer: seconds pass only when a batch "works" for them."""

    def __init__(self) -> None:
        self.now = CLOCK_START

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(epoch_timer, "time", clock)
    return clock


class SlowValidation(L.LightningModule):
    """Training batches take ``TRAIN_SLEEP`` s, validation batches ``VAL_SLEEP`` s (much longer)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.clock = clock
        self.train_seconds = 0.0

    def training_step(self, batch, batch_idx):
        self.clock.sleep(TRAIN_SLEEP)
        self.train_seconds += TRAIN_SLEEP
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.clock.sleep(VAL_SLEEP)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    return DataLoader(TensorDataset(torch.randn(BATCHES, 2)), batch_size=1)


def test_train_epoch_seconds_exclude_validation_and_sanity_check(tmp_path, clock):
    model = SlowValidation(clock)
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
    trainer.fit(model, loader(), loader())
    logged = float(trainer.callback_metrics["time/train_epoch_s"])
    validation = 3 * 2 * VAL_SLEEP  # sanity check + two validations, two batches each
    assert clock.now - CLOCK_START == pytest.approx(validation + BATCHES * TRAIN_SLEEP)
    assert model.train_seconds == pytest.approx(BATCHES * TRAIN_SLEEP)
    # float32 as logged
    assert logged == pytest.approx(model.train_seconds, rel=1e-6)


def test_an_epoch_resumed_inside_counts_the_seconds_before_its_checkpoint(tmp_path, clock):
    """Lightning calls no ``on_train_epoch_start`` for the epoch a fit resumes inside: the
    clock once read the process's uptime there (hours). The resumed epoch's figure is its
    training seconds before the checkpoint plus those after."""
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    options = dict(max_epochs=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    first = SlowValidation(clock)
    L.Trainer(callbacks=[EpochTimer(), every], **options).fit(first, loader())
    mid_epoch = tmp_path / "epoch=0-step=2.ckpt"
    clock.sleep(3600.0)  # the job waits in the queue before it resumes
    resumed, timer = SlowValidation(clock), EpochTimer()
    trainer = L.Trainer(callbacks=[timer], **options)
    trainer.fit(resumed, loader(), ckpt_path=mid_epoch)
    assert resumed.train_seconds == pytest.approx((BATCHES - 2) * TRAIN_SLEEP)  # resumed inside
    logged = float(trainer.callback_metrics["time/train_epoch_s"])
    assert logged == pytest.approx(BATCHES * TRAIN_SLEEP, rel=1e-6)  # 2 batches before, 2 after
