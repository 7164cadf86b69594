import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from app.callbacks.training.throughput import TokenThroughputMonitor
from datamodules.bptt import BPTTBatches
from heads import SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone

pytestmark = pytest.mark.usefixtures("one_thread")

BATCHES, INTERVAL = 20, 5


class Logged(L.Callback):
    """The figures the monitor logged, by the training batch after which Lightning logs."""

    def __init__(self) -> None:
        self.train: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("train/tokens_per_sec")
        if value is not None:
            self.train[batch_idx + 1] = float(value)


def test_tokens_per_second_with_a_device_sync_only_where_lightning_logs(monkeypatch):
    """The device is waited for at the logging steps and an evaluation pass's ends, never
    after every batch (Lightning's ThroughputMonitor synchronises after each); the rate of
    each logged window counts its batches' tokens (4 streams x 5 tokens each)."""
    monitor, logged = TokenThroughputMonitor(), Logged()
    syncs = []
    now = monitor._now

    def counted(trainer):
        syncs.append(trainer.global_step)
        return now(trainer)

    monkeypatch.setattr(monitor, "_now", counted)
    timeline = iter(range(10_000))  # a clock a second a reading: rates are tokens a second
    monkeypatch.setattr("time.perf_counter", lambda: float(next(timeline)))
    torch.manual_seed(0)
    model = LanguageModel(LSTMBackbone(40, embedding_size=8, hidden_size=8), SoftmaxHead(8, 40))
    loader = DataLoader(BPTTBatches(torch.randint(0, 40, (1000,)), batch_size=4, bptt=5),
                        batch_size=None)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=BATCHES,
                        limit_val_batches=3, num_sanity_val_steps=0,
                        log_every_n_steps=INTERVAL, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, enable_progress_bar=False,
                        callbacks=[monitor, logged])  # fmt: skip
    trainer.fit(model, loader, loader)
    # the epoch's start, each logging step; the window's pause, the pass's start and end, the
    # window's resumption
    assert len(syncs) == 1 + BATCHES // INTERVAL + 4
    assert sorted(logged.train) == list(range(INTERVAL, BATCHES + 1))
    # each window: 5 batches of 20 tokens over one clock reading apart (1 s)
    assert {logged.train[b] for b in range(INTERVAL, BATCHES + 1, INTERVAL)} == {100.0}
    assert float(trainer.callback_metrics["val/tokens_per_sec"]) == 60.0  # 3 batches in 1 s


def test_a_fit_resumed_inside_an_epoch_logs_its_rate_from_the_next_logging_step(tmp_path):
    """Lightning calls no ``on_train_epoch_start`` for the epoch a fit resumes inside; the
    monitor's window started only at the next validation's end, so the rest of that epoch
    logged no rate."""

    def fit(callbacks, ckpt_path=None):
        torch.manual_seed(0)
        model = LanguageModel(LSTMBackbone(40, embedding_size=8, hidden_size=8),
                              SoftmaxHead(8, 40))  # fmt: skip
        loader = DataLoader(BPTTBatches(torch.randint(0, 40, (1000,)), batch_size=4, bptt=5),
                            batch_size=None)  # fmt: skip
        trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=BATCHES,
                            limit_val_batches=0, log_every_n_steps=INTERVAL, logger=False,
                            enable_model_summary=False, enable_progress_bar=False,
                            default_root_dir=tmp_path, callbacks=callbacks)  # fmt: skip
        trainer.fit(model, loader, ckpt_path=ckpt_path)

    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=7, save_top_k=-1)
    fit([TokenThroughputMonitor(), every])
    logged = Logged()
    fit([TokenThroughputMonitor(), logged], ckpt_path=tmp_path / "epoch=0-step=7.ckpt")
    # the resumed batches are numbered from the epoch's start: steps 10, 15 and 20 log
    assert sorted(b for b in logged.train if b % INTERVAL == 0) == [10, 15, 20]
    assert all(rate > 0 for rate in logged.train.values())
