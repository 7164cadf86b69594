"""A fit preempted before its first validation, resumed in the same run folder: its
``ModelCheckpoint`` goes on writing ``last.ckpt`` (not a ``last-v1.ckpt`` beside the stopped
state), so that ``last.ckpt`` (what the study runner and ``--ckpt_path last`` read) is the newest
state and names the best checkpoint. In-process, a tiny model: a few seconds."""

import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import SIGTERMException

from app.callbacks.training.checkpoint import ModelCheckpoint
from app.callbacks.training.fail_at_step import SignalAtStep
from app.callbacks.training.preemption import PreemptionCheckpoint

EPOCH = 4  # training batches per epoch


class LoggedBoringModel(BoringModel):
    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("val/loss", loss)
        return loss


def _trainer(tmp_path, *callbacks: L.Callback, version: str = "fit", **options) -> L.Trainer:
    checkpoint = ModelCheckpoint(monitor="val/loss", save_last=True, save_top_k=1)
    return L.Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        limit_train_batches=EPOCH,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=L.pytorch.loggers.CSVLogger(tmp_path, name="run", version=version),
        callbacks=[checkpoint, PreemptionCheckpoint(), *callbacks],
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        **options,
    )


def test_a_fit_preempted_in_its_first_epoch_resumes_writing_last_ckpt(tmp_path):
    L.seed_everything(1)
    stopped = _trainer(tmp_path, SignalAtStep(2, "SIGTERM"))
    with pytest.raises(SIGTERMException) as exit_:
        stopped.fit(LoggedBoringModel())
    assert exit_.value.code == 128 + signal.SIGTERM
    folder = tmp_path / "run" / "fit" / "checkpoints"
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"]  # no validation yet

    resumed = _trainer(tmp_path)
    resumed.fit(LoggedBoringModel(), ckpt_path=folder / "last.ckpt")
    names = sorted(p.name for p in folder.iterdir())
    assert "last-v1.ckpt" not in names and "last.ckpt" in names, names
    last = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 2 * EPOCH  # the end of the fit, not the stopped state
    state = next(v for k, v in last["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert state["best_model_path"] and (folder / state["best_model_path"]).is_file()


def _validation_steps(tmp_path, version: str) -> list[int]:
    import csv

    path = tmp_path / "run" / version / "metrics.csv"
    if not path.is_file():
        return []  # nothing logged
    with open(path) as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("val/loss")]


@pytest.mark.parametrize(
    ("signal_at", "options", "validated_at"),
    [(EPOCH - 1, {}, [EPOCH - 1]), (1, {"val_check_interval": 2}, [1])],
    ids=["in an epoch's last batch", "before a mid-epoch validation"],
)
def test_a_signal_before_a_validation_lets_it_run_then_stops(
    tmp_path, signal_at, options, validated_at
):
    """The validation after the signalled batch runs whole (its val/loss logged, its best
    checkpoint kept; in an epoch's last batch the epoch's end too) before the fit stops; from
    an epoch's end the resumed fit ends where an uninterrupted one does. Lightning stopped the
    validation at its first batch: no val/loss, and an epoch resumed without its validation."""
    L.seed_everything(1)
    whole = _trainer(tmp_path, version="whole", **options)
    whole.fit(LoggedBoringModel())
    L.seed_everything(1)
    stopped = _trainer(tmp_path, SignalAtStep(signal_at, "SIGTERM"), **options)
    with pytest.raises(SIGTERMException):
        stopped.fit(LoggedBoringModel())
    assert _validation_steps(tmp_path, "fit") == validated_at
    folder = tmp_path / "run" / "fit" / "checkpoints"
    saved = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=False)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert state["best_model_path"]  # the validation's checkpoint
    assert saved["global_step"] == signal_at + 1  # stopped right after that validation
    if signal_at != EPOCH - 1:
        return  # (BoringModel's plain loader restarts an epoch: no exact mid-epoch resume)
    assert saved["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1
    L.seed_everything(1)  # the same model and data (BoringModel draws them)
    resumed = _trainer(tmp_path, version="fit", **options)
    model = LoggedBoringModel()
    resumed.fit(model, ckpt_path=folder / "last.ckpt")
    for key, value in whole.lightning_module.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_a_signal_inside_an_accumulation_window_stops_after_the_window_steps(tmp_path):
    """``accumulate_grad_batches 2``, the signal in the first batch of the epoch's second
    window: the fit stops after the batch that steps (the checkpoint then holds no gradient
    half accumulated), and resumed, ends where an uninterrupted fit does. Stopped after the
    signalled batch, the checkpoint lost its gradient: the resumed step was of one batch."""
    options = {"accumulate_grad_batches": 2}
    L.seed_everything(1)
    whole = _trainer(tmp_path, version="whole", **options)
    whole.fit(LoggedBoringModel())
    L.seed_everything(1)
    # global_step 1 is reached after batch 1: the signal comes in batch 2, the window's first
    stopped = _trainer(tmp_path, SignalAtStep(1, "SIGTERM"), **options)
    with pytest.raises(SIGTERMException):
        stopped.fit(LoggedBoringModel())
    folder = tmp_path / "run" / "fit" / "checkpoints"
    saved = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=False)
    assert saved["global_step"] == EPOCH // 2  # both windows of the epoch stepped
    L.seed_everything(1)
    resumed = _trainer(tmp_path, version="fit", **options)
    model = LoggedBoringModel()
    resumed.fit(model, ckpt_path=folder / "last.ckpt")
    for key, value in whole.lightning_module.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)
