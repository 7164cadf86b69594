"""``model.scheduler_interval`` (a torch schedule stepped every optimizer step instead of once an
epoch) and ``WarmupCosineLR`` (linear warm-up, cosine to a floor, sized to the fit): the rates a
real CLI fit applies, through gradient accumulation and a resume, against their closed forms;
the one warning line for a per-epoch schedule whose length looks like optimizer steps."""

import csv
import functools
import importlib
import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml

from lightning_modules import Classifier
from lightning_modules.errors import ModelConfigError, warn_once
from lightning_modules.optimization import (
    InverseSquareRootLR,
    WarmupCosineLR,
    check_resumed_sizes,
    configure_optimizers,
)
from tests.conftest import REPO
from tests.datamodules.test_variable_bptt import small_corpus
from tests.lightning_modules.test_optimization import cli_scheduler

lr_scheduler = torch.optim.lr_scheduler

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors, shared cores
WARMUP_COSINE = "lightning_modules.optimization.WarmupCosineLR"


def warmup_cosine(k: int, warmup: int, total: int, floor: float, start: float = 0.0) -> float:
    """The factor after ``k`` optimizer steps, written out plainly."""
    if k < warmup:
        return start + (1 - start) * k / warmup
    if k >= total:
        return floor
    return floor + (1 - floor) * (1 + math.cos(math.pi * (k - warmup) / (total - warmup))) / 2


def rates(schedule, optimizer, steps: int) -> list[float]:
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return seen


@pytest.mark.parametrize(
    ("warmup", "total", "floor", "start"),
    [(4, 20, 0.1, 0.0), (0, 9, 0.0, 0.0), (5, 5, 0.2, 0.5), (3, 12, 1.0, 0.1)],
)
def test_warmup_cosine_is_its_closed_form(warmup, total, floor, start):
    param = torch.nn.Parameter(torch.zeros(1))
    sgd = torch.optim.SGD([param], lr=0.5)
    schedule = WarmupCosineLR(sgd, warmup, total, min_lr_ratio=floor, warmup_start_factor=start)
    expected = [0.5 * warmup_cosine(k, warmup, total, floor, start) for k in range(total + 6)]
    assert rates(schedule, sgd, total + 6) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_warmup_cosine_is_torchs_linear_then_cosine_where_they_coincide():
    """torch's SequentialLR(LinearLR(s, W), CosineAnnealingLR(T - W, m lr), [W]) over the
    schedule's T steps (torch needs s > 0)."""
    warmup, total, floor, start, lr = 5, 17, 0.1, 0.2, 3e-3

    def pair(build):
        param = torch.nn.Parameter(torch.zeros(1))
        adam = torch.optim.Adam([param], lr=lr)
        return build(adam), adam

    ours = rates(*pair(lambda o: WarmupCosineLR(o, warmup, total, floor, start)), total)
    theirs = rates(*pair(lambda o: lr_scheduler.SequentialLR(o, [
        lr_scheduler.LinearLR(o, start_factor=start, total_iters=warmup),
        lr_scheduler.CosineAnnealingLR(o, T_max=total - warmup, eta_min=floor * lr),
    ], milestones=[warmup])), total)  # fmt: skip
    assert ours == pytest.approx(theirs, rel=1e-9)


def test_warmup_cosine_is_sized_to_the_fit_and_checks_its_arguments(caplog):
    params = [torch.nn.Parameter(torch.zeros(1))]
    adam = torch.optim.Adam
    trainer = SimpleNamespace(datamodule=None, estimated_stepping_batches=40, max_epochs=4)

    def built(factory, **options):
        config = configure_optimizers(params, adam, factory, trainer=trainer, **options)
        return config["lr_scheduler"]

    sized = built(cli_scheduler(WARMUP_COSINE, "--scheduler.warmup_steps", "4"))
    assert (sized["interval"], sized["scheduler"].total_steps) == ("step", 40)
    given = cli_scheduler(WARMUP_COSINE, "--scheduler.total_steps", "25")
    assert built(given)["scheduler"].total_steps == 25
    # stepped once an epoch on request: sized to the fit's epochs
    per_epoch = built(functools.partial(WarmupCosineLR, warmup_steps=1), interval="epoch")
    assert (per_epoch["interval"], per_epoch["scheduler"].total_steps) == ("epoch", 4)
    with pytest.raises(ModelConfigError, match="WarmupCosineLR needs total_steps"):
        WarmupCosineLR(adam(params))
    for bad in ({"warmup_steps": -1}, {"total_steps": 0}, {"min_lr_ratio": 1.5},
                {"warmup_start_factor": -0.1}):  # fmt: skip
        with pytest.raises(ModelConfigError, match=next(iter(bad))):
            WarmupCosineLR(adam(params), **{"total_steps": 10, **bad})
    warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, "lightning_modules"):
        WarmupCosineLR(adam(params), warmup_steps=50, total_steps=40)
    assert "the warm-up (50 optimizer steps) is not shorter than the schedule's 40" in caplog.text


def test_the_interval_option_over_the_schedulers_own():
    params = [torch.nn.Parameter(torch.zeros(1))]
    adam = torch.optim.Adam
    cosine = cli_scheduler("torch.optim.lr_scheduler.CosineAnnealingLR", "--scheduler.T_max", "9")
    plateau = cli_scheduler("torch.optim.lr_scheduler.ReduceLROnPlateau")

    def interval(factory, given):
        return configure_optimizers(params, adam, factory, interval=given)["lr_scheduler"][
            "interval"
        ]

    assert [interval(cosine, given) for given in (None, "step", "epoch")] == [
        "epoch", "step", "epoch",
    ]  # fmt: skip
    inverse_sqrt = functools.partial(InverseSquareRootLR, warmup_steps=3)
    assert [interval(inverse_sqrt, given) for given in (None, "epoch")] == ["step", "epoch"]
    assert interval(plateau, None) == "epoch"
    plain = functools.partial(lr_scheduler.ReduceLROnPlateau)
    for factory in (plateau, plain, lambda o: lr_scheduler.ReduceLROnPlateau(o)):
        with pytest.raises(ModelConfigError, match="scheduler_interval step: ReduceLROnPlateau"):
            interval(factory, "step")
    backbone = torch.nn.Linear(4, 8)
    backbone.output_size = 8
    with pytest.raises(ModelConfigError, match="scheduler_interval must be epoch, step or null"):
        Classifier(backbone, _head(), scheduler_interval="steps")
    # built with a plateau schedule: refused only when the fit builds it (a test of a checkpoint
    # trained per step gets the checkpoint's scheduler_interval over the config's plateau)
    task = Classifier(backbone, _head(), scheduler=plateau, scheduler_interval="step")
    assert task.hparams["scheduler_interval"] == "step"


def _head():
    from heads import SoftmaxHead

    return SoftmaxHead(hidden_size=8, vocab_size=12)


# -- the warning: a per-epoch torch schedule whose length looks like optimizer steps ------------


def fit_trainer(max_epochs: int, max_steps: int = -1, batches: int = 100) -> SimpleNamespace:
    return SimpleNamespace(
        datamodule=None, max_epochs=max_epochs, max_steps=max_steps, num_training_batches=batches,
        accumulate_grad_batches=1,
        estimated_stepping_batches=max_steps if max_steps > 0 else max_epochs * batches,
    )  # fmt: skip


def shipped_schedules() -> dict[str, object]:
    """``configs/optimizers``' scheduler fragments, as the CLI builds them (its factories)."""
    schedules = {}
    for path in sorted((REPO / "configs/optimizers").glob("*.yaml")):
        loaded = yaml.safe_load(path.read_text())
        module, _, name = loaded["class_path"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if issubclass(cls, lr_scheduler.LRScheduler):
            schedules[path.name] = cli_scheduler(json.dumps(loaded))
    return schedules


def test_one_warning_line_for_a_per_epoch_schedule_of_optimizer_steps(caplog):
    params = [torch.nn.Parameter(torch.zeros(1))]
    adam = torch.optim.Adam
    cosine = cli_scheduler(
        "torch.optim.lr_scheduler.CosineAnnealingLR", "--scheduler.T_max", "20000"
    )
    steps = cli_scheduler("torch.optim.lr_scheduler.MultiStepLR", "--scheduler.milestones",
                          "[3, 30]")  # fmt: skip

    def warned(factory, trainer, interval=None) -> list[str]:
        warn_once.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, "lightning_modules"):
            configure_optimizers(params, adam, factory, trainer=trainer, interval=interval)
            configure_optimizers(params, adam, factory, trainer=trainer, interval=interval)
        return [r.getMessage() for r in caplog.records]

    (line,) = warned(cosine, fit_trainer(10))  # once, built twice (a DS mitosis rebuilds it)
    assert line == (
        "warning: model.scheduler CosineAnnealingLR steps once an epoch, and its T_max 20000 is "
        "more than the fit's 10 epochs: if it counts optimizer steps, give "
        "--model.scheduler_interval step (--model.scheduler_interval epoch: meant so)"
    )
    # a fit limited by max_steps: 20000 steps of 1000 batches are 20 epochs
    assert "fit's 20 epochs" in warned(cosine, fit_trainer(-1, 20000, batches=1000))[0]
    assert "milestones 30 is more than the fit's 10 epochs" in warned(steps, fit_trainer(10))[0]
    # no warning: said so, stepped per step, lengths within the epochs, the length unknown
    assert warned(cosine, fit_trainer(10), "epoch") == []
    assert warned(cosine, fit_trainer(10), "step") == []
    assert warned(cosine, fit_trainer(30000)) == []
    assert warned(cosine, fit_trainer(-1, -1)) == []
    assert warned(cosine, None) == []
    # the shipped schedules, in a fit of one PTB epoch (1,328 steps; the settings run 10+)
    schedules = shipped_schedules()
    assert {"plateau.yaml", "inverse_sqrt.yaml", "warmup_cosine.yaml"} <= set(schedules)
    for name, factory in schedules.items():
        assert warned(factory, fit_trainer(1, -1, batches=1328)) == [], name


# -- real CLI fits: the rates applied at every optimizer step ----------------------------------


class AppliedLR(L.Callback):
    """``global_step -> lr`` of the first param group when each optimizer step is taken."""

    def __init__(self) -> None:
        self.rates: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.rates[trainer.global_step] = optimizer.param_groups[0]["lr"]


RECORDER = "tests.lightning_modules.test_scheduler_interval.AppliedLR"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, ptb_text) -> str:
    return small_corpus(tmp_path_factory.mktemp("corpus"), ptb_text, 120)


def tiny_fit(corpus: str, tmp: Path, batches: int, epochs: int) -> list[str]:
    """A tiny LSTM on ``corpus`` (configs/lm/ptb.yaml's callbacks: its LearningRateMonitor),
    logging every step to a CSV logger under ``tmp``; options after ``fit``."""
    return [
        "--data.init_args.path", corpus, "--data.init_args.batch_size", "4",
        "--data.init_args.bptt", "10", "--data.init_args.eval_batch_size", "4",
        "--model.init_args.backbone.init_args.embedding_size", "8",
        "--model.init_args.backbone.init_args.hidden_size", "8",
        "--trainer.max_epochs", str(epochs), "--trainer.limit_train_batches", str(batches),
        "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(tmp), "--trainer.logger.name", "csv",
        "--trainer.callbacks+", RECORDER,
    ]  # fmt: skip


def applied(cli) -> dict[int, float]:
    (recorder,) = [c for c in cli.trainer.callbacks if isinstance(c, AppliedLR)]
    return recorder.rates


def monitored(folder: Path) -> dict[int, float]:
    """``step -> lr-Adam`` as LearningRateMonitor logged it (the CSV logger's rows)."""
    values: dict[int, float] = {}
    for path in folder.rglob("metrics.csv"):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get("lr-Adam"):
                    values[int(row["step"])] = float(row["lr-Adam"])
    return values


def test_a_cosine_stepped_every_optimizer_step_through_the_cli(cli_run, corpus, tmp_path):
    """CosineAnnealingLR with ``--model.scheduler_interval step``: every applied rate is the
    closed form at that step (once an epoch, a T_max of 12 steps barely moved), and the
    learning-rate monitor logs the applied rate."""
    cli = cli_run(
        "fit", *tiny_fit(corpus, tmp_path, batches=6, epochs=2),
        "--model.scheduler", "torch.optim.lr_scheduler.CosineAnnealingLR",
        "--model.scheduler.T_max", "12", "--model.scheduler.eta_min", "0.0002",
        "--model.scheduler_interval", "step", experiment="ptb_softmax",
    )  # fmt: skip
    lr = cli.trainer.lr_scheduler_configs[0].scheduler.base_lrs[0]
    expected = {k: 2e-4 + (lr - 2e-4) * (1 + math.cos(math.pi * k / 12)) / 2 for k in range(12)}
    assert applied(cli) == pytest.approx(expected, rel=1e-12)
    assert monitored(tmp_path) == pytest.approx(expected, rel=1e-6)  # (CSV: 6+ digits)
    assert cli.model.hparams["scheduler_interval"] == "step"  # a resume or a test reloads it
    saved = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())
    assert saved["model"]["init_args"]["scheduler_interval"] == "step"


def test_a_warmup_cosine_sized_to_the_fit_with_accumulation_and_a_resume(cli_run, corpus, tmp_path):
    """WarmupCosineLR without total_steps, 7 batches an epoch accumulated by 2 (4 optimizer
    steps, the last of one batch) over 3 epochs: sized to the 12 steps, every applied rate the
    closed form; a fit resumed from the checkpoint of step 5 (inside the second epoch) applies
    the uninterrupted fit's rates from there."""
    schedule = [
        "--model.scheduler", WARMUP_COSINE, "--model.scheduler.warmup_steps", "3",
        "--model.scheduler.min_lr_ratio", "0.1", "--trainer.accumulate_grad_batches", "2",
    ]  # fmt: skip
    checkpoints = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                   "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 5,
                                 "save_top_k": -1, "filename": "{step}"}}  # fmt: skip
    whole = cli_run(
        "fit", *tiny_fit(corpus, tmp_path / "whole", batches=7, epochs=3), *schedule,
        "--trainer.callbacks+", json.dumps(checkpoints), experiment="ptb_softmax",
    )  # fmt: skip
    built = whole.trainer.lr_scheduler_configs[0]
    assert (built.interval, built.scheduler.total_steps, whole.trainer.global_step) == (
        "step", 12, 12,
    )  # fmt: skip
    lr = built.scheduler.base_lrs[0]
    expected = {k: lr * warmup_cosine(k, 3, 12, 0.1) for k in range(12)}
    assert applied(whole) == pytest.approx(expected, rel=1e-12)
    assert monitored(tmp_path / "whole") == pytest.approx(expected, rel=1e-6)
    resumed = cli_run(
        "fit", *tiny_fit(corpus, tmp_path / "resumed", batches=7, epochs=3), *schedule,
        "--ckpt_path", str(tmp_path / "ckpt" / "step=5.ckpt"), experiment="ptb_softmax",
    )  # fmt: skip
    assert applied(resumed) == {k: expected[k] for k in range(5, 12)}


def test_a_schedule_sized_to_the_fit_keeps_the_checkpoints_length_when_resumed(caplog):
    """torch restores a schedule's ``total_steps`` with its state: a fit resumed with more
    steps took a OneCycleLR past its end, which raised at that step (``Tried to step 4
    times``), hours into the resumed fit; refused before any step, a WarmupCosineLR warned."""
    params = [torch.nn.Parameter(torch.zeros(1))]
    adam = torch.optim.Adam

    def resumed(factory, saved_steps: int, fit_steps: int):
        def sized(steps: int):
            trainer = SimpleNamespace(datamodule=None, estimated_stepping_batches=steps)
            config = configure_optimizers(params, adam, factory, trainer=trainer)
            return config["lr_scheduler"]["scheduler"]

        schedule = sized(fit_steps)
        schedule.load_state_dict(sized(saved_steps).state_dict())  # as Lightning restores it
        warn_once.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, "lightning_modules"):
            check_resumed_sizes([schedule])
        return [r.getMessage() for r in caplog.records]

    one_cycle = cli_scheduler("torch.optim.lr_scheduler.OneCycleLR", "--scheduler.max_lr", "0.1")
    refused = r"OneCycleLR was sized to the checkpoint's fit \(6 optimizer steps\).*this fit has 9"
    with pytest.raises(ModelConfigError, match=refused + ": OneCycleLR cannot step past"):
        resumed(one_cycle, 6, 9)
    assert resumed(one_cycle, 6, 6) == []
    # (a shorter fit ends inside the cycle: a warning line)
    assert "this fit has 4: it ends first" in resumed(one_cycle, 6, 4)[0]
    cosine = cli_scheduler(WARMUP_COSINE, "--scheduler.warmup_steps", "2")
    assert "this fit has 9: its rate stays at its floor past them" in resumed(cosine, 6, 9)[0]
    given = cli_scheduler(WARMUP_COSINE, "--scheduler.total_steps", "6")  # not sized: as given
    assert resumed(given, 6, 9) == []


def test_a_one_cycle_resumed_into_a_longer_fit_is_refused_before_a_step(cli_run, corpus, tmp_path):
    options = [
        *tiny_fit(corpus, tmp_path, batches=3, epochs=1),
        "--model.scheduler", "torch.optim.lr_scheduler.OneCycleLR",
        "--model.scheduler.max_lr", "0.01",
    ]  # fmt: skip
    first = cli_run("fit", *options, experiment="ptb_softmax")
    (ckpt,) = tmp_path.rglob("last.ckpt")
    with pytest.raises(ModelConfigError, match="this fit has 6: OneCycleLR cannot step past"):
        cli_run("fit", *options, "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt),
                experiment="ptb_softmax")  # fmt: skip
    assert first.trainer.global_step == 3
    # no step of the resumed fit was taken, nor any checkpoint past the first fit's written
    steps = {torch.load(p, weights_only=False)["global_step"] for p in tmp_path.rglob("*.ckpt")}
    assert steps == {3}
