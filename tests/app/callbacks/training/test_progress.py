import traceback

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from torch.utils.data import DataLoader

from app.callbacks.training.progress import (
    IntervalMetrics,
    IntervalRichProgressBar,
    IntervalTQDMProgressBar,
    interval_progress_bar,
    side_progress,
)
from app.cli.lightning_cli import build
from datamodules.bptt import BPTTBatches
from heads import SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone

pytestmark = pytest.mark.usefixtures("one_thread")

BATCHES, INTERVAL = 20, 5


class LossOnTheBar(L.Callback):
    """What the bar shows after each training batch."""

    def __init__(self) -> None:
        self.shown: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = trainer.progress_bar_callback
        if isinstance(bar, TQDMProgressBar):
            self.shown.append(bar.train_progress_bar.postfix or "")


class LossOnTheBarEachBatch(LanguageModel):
    """The task as it was: its per-batch loss logged with ``prog_bar=True`` too."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss_on_bar", loss, prog_bar=True)
        return loss


def _fit(bar: TQDMProgressBar, monkeypatch, task=LanguageModel) -> tuple[int, list[str]]:
    """``(read-backs, postfix after each batch)`` of a fit of ``BATCHES`` training batches,
    logging every ``INTERVAL``: the read-backs of Lightning's conversion of ``prog_bar`` metrics
    and of the bar's own (``Tensor.item`` or ``float``)."""
    torch.manual_seed(0)
    model = task(LSTMBackbone(40, embedding_size=8, hidden_size=8), SoftmaxHead(8, 40))
    loader = DataLoader(BPTTBatches(torch.randint(0, 40, (1000,)), batch_size=4, bptt=5),
                        batch_size=None)  # fmt: skip
    reads = []

    def recorded(name):
        original = getattr(torch.Tensor, name)

        def read(tensor):
            caller = traceback.extract_stack(limit=2)[0].filename
            reads.append(caller.endswith(("apply_func.py", "progress.py")))
            return original(tensor)

        monkeypatch.setattr(torch.Tensor, name, read)

    recorded("item")
    recorded("__float__")
    shown = LossOnTheBar()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=BATCHES,
                        limit_val_batches=0, log_every_n_steps=INTERVAL, logger=False,
                        enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[bar, shown])  # fmt: skip
    trainer.fit(model, loader)
    monkeypatch.undo()
    if isinstance(bar, TQDMProgressBar):
        assert bar.train_progress_bar.n == BATCHES  # counted to the end all the same
    return sum(reads), shown.shown


@pytest.mark.parametrize("kind", ["tqdm", "rich"])
def test_the_loss_is_read_back_at_the_logging_interval_not_every_batch(kind, monkeypatch):
    """Logged with ``prog_bar``, Lightning reads the train loss back after every batch (on a
    GPU a device sync each), whichever bar shows it; the tasks log it without, and the app's
    bars show it at the logging interval."""
    lightnings, ours = {"tqdm": (TQDMProgressBar, IntervalTQDMProgressBar),
                        "rich": (RichProgressBar, IntervalRichProgressBar)}[kind]  # fmt: skip
    reads, _ = _fit(lightnings(), monkeypatch, task=LossOnTheBarEachBatch)
    assert reads >= BATCHES
    reads, shown = _fit(ours(), monkeypatch)
    assert reads <= BATCHES // INTERVAL + 3  # and at the epoch's end: the bar's, its metrics'
    if kind == "tqdm":  # shown from the first interval on, the same until the next
        assert [("train/loss=" in postfix) for postfix in shown[: INTERVAL + 1]] == [
            False] * (INTERVAL - 1) + [True, True]  # fmt: skip
        assert shown[INTERVAL] == shown[2 * INTERVAL - 2] != shown[2 * INTERVAL - 1]


def test_the_cli_shows_it_unless_given_another_bar_or_none(ptb_path):
    args = ["--data.init_args.path", ptb_path]
    bar = build(["configs/lm/ptb.yaml"], args).trainer.progress_bar_callback
    assert type(bar) is type(interval_progress_bar())  # Rich's where installed, as Lightning's
    assert type(bar) in (IntervalRichProgressBar, IntervalTQDMProgressBar)
    off = build(["configs/lm/ptb.yaml"], [*args, "--trainer.enable_progress_bar", "false"])
    assert off.trainer.progress_bar_callback is None
    lightnings = "lightning.pytorch.callbacks.TQDMProgressBar"
    given = build(["configs/lm/ptb.yaml"], [*args, "--trainer.callbacks+", lightnings])
    assert type(given.trainer.progress_bar_callback) is TQDMProgressBar


def test_the_run_folder_s_version_shows_as_a_number_not_a_float():
    """Rich formats every non-string metric with ``.3f``: the run's ``version_0`` showed as
    ``v_num: 0.000``."""

    class Standard:  # what Lightning's get_metrics builds on: the logger's version
        def get_metrics(self, trainer, pl_module):
            return {"v_num": 3}

    class Bar(IntervalMetrics, Standard):
        pass

    trainer = type("Trainer", (), {"callback_metrics": {}})()
    assert Bar().get_metrics(trainer, None) == {"v_num": "3"}


def test_counts_show_as_whole_numbers():
    """``ds/num_experts: 4.000`` read as a measurement; the other figures keep Rich's format."""

    class Standard:  # Lightning's progress-bar metrics: Python floats
        def get_metrics(self, trainer, pl_module):
            return {"ds/num_experts": 4.0, "ds/speedup": 3.0, "val/ppl": 120.5}

    class Bar(IntervalMetrics, Standard):
        pass

    trainer = type("Trainer", (), {"callback_metrics": {}})()
    shown = Bar().get_metrics(trainer, None)
    assert shown == {"ds/num_experts": "4", "ds/speedup": 3.0, "val/ppl": 120.5}


class SideWork(L.Callback):
    """A pass of ``STEPS`` steps at an epoch's end under :func:`side_progress`; records what
    the trainer's bar shows after each step."""

    STEPS = 7

    def __init__(self) -> None:
        self.shown: list[tuple[str, float, float]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        bar = trainer.progress_bar_callback
        with side_progress(trainer, "scoring", self.STEPS) as advance:
            for _ in range(self.STEPS):
                advance()
                if isinstance(bar, RichProgressBar):
                    (task,) = [t for t in bar.progress.tasks if t.description == "scoring"]
                    self.shown.append((task.description, task.completed, task.total))
        if isinstance(bar, RichProgressBar):  # the task is gone, the training bar stays
            assert all(t.description != "scoring" for t in bar.progress.tasks)
            assert bar.progress.tasks[bar.train_progress_bar_id].completed == 3


@pytest.mark.parametrize("kind", [IntervalRichProgressBar, IntervalTQDMProgressBar, None])
def test_side_work_shows_on_the_trainer_s_bar(kind, capsys):
    """A callback's pass over the data (the Hybrid-LightRNN table's scoring) is a task of the
    Rich display or a TQDM bar of its own; without a bar, nothing."""
    model = LanguageModel(LSTMBackbone(40, embedding_size=8, hidden_size=8), SoftmaxHead(8, 40))
    loader = DataLoader(BPTTBatches(torch.randint(0, 40, (300,)), batch_size=4, bptt=5),
                        batch_size=None)  # fmt: skip
    work = SideWork()
    bars = [kind()] if kind else []
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=3,
                        limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, enable_progress_bar=kind is not None,
                        callbacks=[*bars, work])  # fmt: skip
    trainer.fit(model, loader)
    captured = capsys.readouterr()
    out = captured.out + captured.err  # the app's bars draw on stderr (stdout: predictions)
    if kind is IntervalRichProgressBar:
        assert work.shown == [("scoring", step, SideWork.STEPS) for step in range(1, 8)]
    elif kind is IntervalTQDMProgressBar:
        assert "scoring" not in captured.out
        assert f"scoring:   0%|          | 0/{SideWork.STEPS}" in out  # a bar, total and all
    else:
        assert "scoring" not in out


@pytest.mark.parametrize(("version", "shown"), [("version_0", "0"), ("version_12", "12"),
                                                 ("eval-last", "last")])  # fmt: skip
def test_a_run_folder_given_by_name_shows_its_number(version, shown):
    """A resumed fit logs into its run's folder by name (``version="version_0"``): Lightning
    shows a string version's last 4 characters, ``v_num: on_0``. Others keep Lightning's."""
    from lightning.pytorch.callbacks.progress.progress_bar import get_standard_metrics

    class Standard:  # Lightning's own
        def get_metrics(self, trainer, pl_module):
            return get_standard_metrics(trainer)

    class Bar(IntervalMetrics, Standard):
        pass

    logger = type("Logger", (), {"version": version})()
    trainer = type("Trainer", (), {"callback_metrics": {}, "loggers": [logger, logger]})()
    assert Bar().get_metrics(trainer, None) == {"v_num": shown}
