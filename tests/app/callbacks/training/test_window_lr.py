"""``WindowLR``: each optimizer step takes ``lr * T / bptt`` (T: the window's length), and the
rate every reader outside the step sees is the unscaled one."""

import csv
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from app.callbacks import NTASGD, WindowLR
from lightning_modules.errors import ModelConfigError

pytestmark = pytest.mark.usefixtures("one_thread")
BPTT = 5
LENGTHS = [3, 7, 5, 10, 2, 6]  # the windows of an epoch
CLIP = 8.0  # clips some of the windows' gradients (norms 2.7 to 15)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Windows of ``LENGTHS`` steps; their inputs make the gradients differ."""
    out = []
    for i, t in enumerate(LENGTHS):
        inputs = torch.arange(2 * t).view(2, t) % 4 + i
        out.append((inputs, inputs + 1))
    return out


class Stub(L.LightningModule):
    """A parameter vector whose loss's gradient is known: ``c * mean(inputs)``."""

    def __init__(self, optimizer: str = "sgd", step_gamma: float | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))
        self.c = torch.tensor([1.0, -2.0, 0.5])
        self.optimizer_name, self.step_gamma = optimizer, step_gamma

    def training_step(self, batch, batch_idx):
        inputs, _ = batch
        return (self.w * self.c).sum() * inputs.float().mean()

    def configure_optimizers(self):
        if self.optimizer_name == "asgd":  # AWD-LSTM's: plain SGD steps until averaging
            optimizer = torch.optim.ASGD(self.parameters(), lr=0.1, lambd=0.0, t0=1e12)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.step_gamma is None:
            return optimizer
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=self.step_gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Steps(L.Callback):
    """Each optimizer step: the parameter and its gradient before it, the windows since the
    last step, the rate before the batch; and the parameter and rate after the batch."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.windows: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.windows.append(batch[0].size(1))
        self.lr_before = trainer.optimizers[0].param_groups[0]["lr"]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps.append({
            "w": pl_module.w.detach().clone(), "grad": pl_module.w.grad.detach().clone(),
            "windows": self.windows, "lr": self.lr_before, "optimizer": optimizer,
        })  # fmt: skip
        self.windows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.steps and "after" not in self.steps[-1]:
            self.steps[-1]["after"] = pl_module.w.detach().clone()
            self.steps[-1]["lr_after"] = trainer.optimizers[0].param_groups[0]["lr"]


def fit(model: Stub, tmp_path: Path, *callbacks: L.Callback, epochs: int = 1, **trainer) -> Steps:
    steps = Steps()
    options = {
        "max_epochs": epochs, "enable_progress_bar": False, "enable_model_summary": False,
        "enable_checkpointing": False, "logger": False, "gradient_clip_val": CLIP,
        "default_root_dir": str(tmp_path), **trainer,
    }  # fmt: skip
    L.Trainer(callbacks=[*callbacks, steps], **options).fit(
        model, DataLoader(batches(), batch_size=None)
    )
    return steps


def clipped(grad: torch.Tensor) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ by hand (Lightning's gradient_clip_val)."""
    return grad * min(1.0, CLIP / (float(grad.norm()) + 1e-6))


@pytest.mark.parametrize("optimizer", ["sgd", "asgd"])
def test_each_step_takes_lr_times_its_window_over_bptt(tmp_path, optimizer):
    steps = fit(Stub(optimizer), tmp_path, WindowLR(bptt=BPTT)).steps
    assert [s["windows"] for s in steps] == [[t] for t in LENGTHS]
    clips = 0
    for s in steps:
        (t,) = s["windows"]
        expected = s["w"] - s["lr"] * t / BPTT * clipped(s["grad"])  # the unscaled gradient clipped
        torch.testing.assert_close(s["after"], expected, rtol=1e-6, atol=1e-7)
        assert s["lr"] == s["lr_after"] == 0.1  # the rate outside the step: unscaled
        clips += float(s["grad"].norm()) > CLIP
    assert 0 < clips < len(steps)
    if optimizer == "asgd":  # ASGD's step size for the next step: from the unscaled rate
        state = steps[-1]["optimizer"].state[next(iter(steps[-1]["optimizer"].state))]
        assert float(state["eta"]) == pytest.approx(0.1)


def test_without_the_callback_every_step_takes_lr(tmp_path):
    # (the reference for the test above: the stub's updates are lr * grad)
    for s in fit(Stub(), tmp_path).steps:
        torch.testing.assert_close(s["after"], s["w"] - 0.1 * clipped(s["grad"]))


def test_the_scale_multiplies_the_current_rate_and_schedules_see_the_unscaled(tmp_path):
    logger = CSVLogger(tmp_path, name="csv")
    steps = fit(Stub(step_gamma=0.5), tmp_path, WindowLR(bptt=BPTT),
                LearningRateMonitor(logging_interval="step"), logger=logger,
                log_every_n_steps=1).steps  # fmt: skip
    rates = [0.1 * 0.5**k for k in range(len(LENGTHS))]  # StepLR's, never the scaled rate's
    assert [s["lr"] for s in steps] == pytest.approx(rates)
    for s, lr in zip(steps, rates, strict=True):
        (t,) = s["windows"]
        torch.testing.assert_close(s["after"], s["w"] - lr * t / BPTT * clipped(s["grad"]))
    with open(next(Path(logger.log_dir).glob("metrics.csv"))) as f:
        logged = [float(row["lr-SGD"]) for row in csv.DictReader(f) if row.get("lr-SGD")]
    assert logged == pytest.approx(rates)


def test_accumulated_windows_step_with_their_mean_length(tmp_path):
    steps = fit(Stub(), tmp_path, WindowLR(bptt=BPTT), accumulate_grad_batches=4).steps
    assert [s["windows"] for s in steps] == [LENGTHS[:4], LENGTHS[4:]]  # the epoch's end steps
    for s in steps:
        scale = sum(s["windows"]) / len(s["windows"]) / BPTT
        torch.testing.assert_close(s["after"], s["w"] - 0.1 * scale * clipped(s["grad"]))


class Rebuild(L.Callback):
    """Builds the optimizers anew at every epoch's start (as DS-Softmax's mitosis does)."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        trainer.strategy.setup_optimizers(trainer)


def test_an_optimizer_built_anew_is_scaled_too(tmp_path):
    steps = fit(Stub(), tmp_path, Rebuild(), WindowLR(bptt=BPTT), epochs=2).steps
    assert len({id(s["optimizer"]) for s in steps}) == 2
    for s in steps:
        (t,) = s["windows"]
        torch.testing.assert_close(s["after"], s["w"] - 0.1 * t / BPTT * clipped(s["grad"]))


def test_with_nt_asgd_averaging(tmp_path):
    # averaging from the first step (NT-ASGD's fine-tuning): steps scaled, eta unscaled after
    class Validated(Stub):
        def validation_step(self, batch, batch_idx):
            self.log("val/loss", 1.0)

    model = Validated("asgd")
    steps = Steps()
    trainer = L.Trainer(
        max_epochs=2, enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=False, gradient_clip_val=CLIP, default_root_dir=str(tmp_path),
        num_sanity_val_steps=0, callbacks=[NTASGD(finetune=True), WindowLR(bptt=BPTT), steps],
    )  # fmt: skip
    loader = DataLoader(batches(), batch_size=None)
    trainer.fit(model, loader, loader)
    assert len(steps.steps) == 2 * len(LENGTHS)
    for s in steps.steps[len(LENGTHS) + 1 :]:  # (validation swaps the average in and out)
        (t,) = s["windows"]
        torch.testing.assert_close(s["after"], s["w"] - 0.1 * t / BPTT * clipped(s["grad"]))
    optimizer = trainer.optimizers[0]
    assert all(float(state["eta"]) == pytest.approx(0.1) for state in optimizer.state.values())


def test_bptt_comes_from_the_data_module_or_is_asked_for(tmp_path):
    class Data(L.LightningDataModule):
        def __init__(self, bptt=None):
            super().__init__()
            self.save_hyperparameters()

        def train_dataloader(self):
            return DataLoader(batches(), batch_size=None)

    steps = Steps()
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=CLIP, callbacks=[WindowLR(), steps])  # fmt: skip
    trainer.fit(Stub(), datamodule=Data(bptt=BPTT))
    for s in steps.steps:
        (t,) = s["windows"]
        torch.testing.assert_close(s["after"], s["w"] - 0.1 * t / BPTT * clipped(s["grad"]))
    with pytest.raises(ModelConfigError, match="init_args.bptt"):
        L.Trainer(max_epochs=1, logger=False, callbacks=[WindowLR()]).fit(Stub(), datamodule=Data())
    with pytest.raises(ModelConfigError, match="positive integer"):
        WindowLR(bptt=0)


class NoReadBack(L.Callback):
    """The sync sentinel of the step tests (tests/lightning_modules/test_host_sync.py) active
    from each batch's start to its end: the optimizer step and WindowLR's hooks inside."""

    def __init__(self, sentinel) -> None:
        self.sentinel = sentinel

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.sentinel.active = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.sentinel.active = False


@pytest.mark.parametrize("optimizer", ["sgd", "asgd"])
def test_the_scaled_step_reads_nothing_back(tmp_path, optimizer, monkeypatch):
    # ASGD keeps step and eta on the parameters' device: the step size is reset there. (torch's
    # own ASGD reads its step back on its default path: the same with the callback or without)
    from tests.lightning_modules.test_host_sync import SyncSentinel

    def read_backs(*callbacks) -> list:
        sentinel = SyncSentinel()
        with sentinel.installed(monkeypatch):
            fit(Stub(optimizer), tmp_path, NoReadBack(sentinel), *callbacks,
                gradient_clip_val=None)  # fmt: skip
        sentinel.active = False
        return sorted(sentinel.calls)

    assert read_backs(WindowLR(bptt=BPTT)) == read_backs()
