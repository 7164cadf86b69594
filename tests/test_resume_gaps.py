"""Exact resume where validations do not fall once at each epoch's end, and after a stop by
``max_steps`` inside an epoch: the resumed fit ends with the uninterrupted fit's weights and
schedule, and the two parts' logged values make up the uninterrupted fit's.

- ``val_check_interval`` < 1, or ``check_val_every_n_epoch`` > 1: ``last.ckpt`` of the
  validation that ends an epoch was written before the task's plateau step (callbacks'
  ``on_validation_end`` come before the module's); the resumed fit skipped that validation and
  the epoch's end took no plateau step (``app/callbacks/training/checkpoint.py``).
- ``max_steps`` inside an epoch: Lightning ended the epoch before ``last.ckpt`` was saved, and
  the resumed fit's epoch figures covered the batches after the stop only.
"""

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from app.callbacks import ModelCheckpoint
from tests.lightning_modules import test_epoch_resume

markov = test_epoch_resume.markov  # the fixture: a small corpus (a Markov chain over 30 words)

pytestmark = pytest.mark.usefixtures("one_thread")
EPOCH = 6  # training batches per epoch


def fit(data_path: str, folder: Path, ckpt_path: str | None = None, *, batches: int = EPOCH,
        every: int | None = None, last: dict | None = None, **options) -> L.Trainer:  # fmt: skip
    """A recurrent language model with dropout and a plateau schedule (``plateau``: every
    step after the first halves the rate), ``batches`` training batches an epoch, logging
    every step to ``folder/csv``; ``last.ckpt`` in ``folder`` (the app's ModelCheckpoint with
    ``last``'s options) and, with ``every``, ``step=N.ckpt`` every ``every`` steps."""
    data, model = test_epoch_resume.plateau_language_model(data_path)
    callbacks = [ModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0, **(last or {}))]
    if every:
        callbacks.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=every,
                                         save_top_k=-1, filename="{step}"))  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, log_every_n_steps=1, limit_train_batches=batches,
        limit_val_batches=2, logger=CSVLogger(folder, name="csv", version=0),
        callbacks=callbacks, **options,
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def logged(folder: Path) -> dict[tuple[str, int], float]:
    """``(name, step) -> value`` of everything the fit in ``folder`` logged, read plainly."""
    values = {}
    with (folder / "csv" / "version_0" / "metrics.csv").open() as file:
        for row in csv.DictReader(file):
            for name, value in row.items():
                if value and name not in ("epoch", "step"):
                    values[name, int(row["step"])] = float(value)
    return values


def assert_continues(whole: L.Trainer, resumed: L.Trainer, curves: dict, expected: dict) -> None:
    """The resumed fit ends as the uninterrupted one (weights bit for bit, schedule, step),
    and ``curves`` (the parts' logged values) are ``expected`` (the uninterrupted fit's)."""
    assert resumed.global_step == whole.global_step
    (mine,), (theirs,) = resumed.lr_scheduler_configs, whole.lr_scheduler_configs
    assert mine.scheduler.state_dict() == theirs.scheduler.state_dict()
    lr = [t.optimizers[0].param_groups[0]["lr"] for t in (resumed, whole)]
    assert lr[0] == lr[1]
    weights = whole.lightning_module.state_dict()
    for name, value in resumed.lightning_module.state_dict().items():
        torch.testing.assert_close(value, weights[name], rtol=0, atol=0, msg=name)
    assert sorted(curves) == sorted(expected)
    for key, value in expected.items():
        assert curves[key] == pytest.approx(value, rel=1e-6), key


@pytest.mark.parametrize(
    "validation",
    [{"val_check_interval": 0.5}, {"check_val_every_n_epoch": 2}],
    ids=["twice-an-epoch", "every-2nd-epoch"],
)
def test_last_ckpt_of_an_epoch_ending_validation_holds_the_epochs_plateau_step(
    markov, tmp_path, validation
):
    whole = fit(markov, tmp_path / "whole", max_epochs=4, **validation)
    first = fit(markov, tmp_path / "first", max_epochs=2, **validation)
    saved = torch.load(tmp_path / "first" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2 * EPOCH
    # the second epoch's plateau step (validations at epochs 0 and 1: 2; 1 every 2nd epoch)
    steps = 2 if "val_check_interval" in validation else 1
    assert saved["lr_schedulers"][0]["last_epoch"] == steps  # (before: one fewer)
    resumed = fit(markov, tmp_path / "resumed", str(tmp_path / "first" / "last.ckpt"),
                  max_epochs=4, **validation)  # fmt: skip
    assert whole.lr_scheduler_configs[0].scheduler.last_epoch == 2 * steps
    since = first.global_step
    curves = {k: v for k, v in logged(tmp_path / "first").items() if k[1] < since}
    curves |= logged(tmp_path / "resumed")
    assert_continues(whole, resumed, curves, logged(tmp_path / "whole"))


@pytest.mark.parametrize(
    ("stop", "validation"),
    [(15, {}), (16, {"val_check_interval": 0.5}), (15, {"val_check_interval": 0.5})],
    ids=["epoch-end-validation", "mid-epoch-validations", "validation-at-the-stop"],
)  # 15, 16: the third epoch's 3rd, 4th batch
def test_a_fit_stopped_by_max_steps_mid_epoch_continues_that_epoch(
    markov, tmp_path, stop, validation
):
    """Resumed with a larger ``max_steps``: the epoch the stop cut continues where it stopped,
    and its figures (train/loss_epoch, train/ppl) cover all of it. The stopped fit's own
    record of the epoch so far (logged at step ``stop - 1``, where Lightning ended the epoch)
    is the only row the uninterrupted fit does not have. (A validation at the stop's step
    saved last.ckpt after it, mid-epoch, before too.)"""
    options = dict(max_epochs=-1, **validation)
    whole = fit(markov, tmp_path / "whole", max_steps=4 * EPOCH, **options)
    fit(markov, tmp_path / "first", max_steps=stop, **options)
    saved = torch.load(tmp_path / "first" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == stop
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"batches_served": stop % EPOCH}
    ]
    resumed = fit(markov, tmp_path / "resumed", str(tmp_path / "first" / "last.ckpt"),
                  max_steps=4 * EPOCH, **options)  # fmt: skip
    first = logged(tmp_path / "first")
    # the stopped fit's record of the epoch so far, where Lightning ended it
    partial = [("train/loss_epoch", stop - 1), ("train/ppl", stop - 1)]
    assert all(key in first for key in partial)
    curves = {k: v for k, v in first.items() if k[1] < stop and k not in partial}
    curves |= logged(tmp_path / "resumed")
    expected = logged(tmp_path / "whole")
    assert ("train/ppl", 3 * EPOCH - 1) in expected  # the cut epoch's, over all of it
    assert_continues(whole, resumed, curves, expected)
