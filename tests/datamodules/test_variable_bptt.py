"""AWD-LSTM's variable training windows (``data.variable_bptt``): the reference's law of the
lengths, every target once per epoch, the same count on every DDP rank, lengths fixed by
(seed, epoch), ``len`` true in every epoch of a real fit."""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from app.callbacks import WindowLR
from datamodules import LanguageModelingDataModule
from datamodules.bptt import BPTTBatches, WindowSchedule
from datamodules.errors import DataConfigError

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_lengths(targets: int, bptt: int, seed: int, epoch: int, cap: int | None = None):
    """salesforce/awd-lstm-lm main.py train() (zihangdai/mos main.py with ``cap``), written
    plainly, with the draws from the generator the data module uses instead of numpy's
    global one, and the last window cut to the targets left (the reference's loop stops one
    target short)."""
    rng = np.random.default_rng([seed, epoch])
    lengths, i = [], 0
    while i < targets:
        bptt_ = bptt if rng.random() < 0.95 else bptt / 2.0
        seq_len = max(5, int(rng.normal(bptt_, 5)))
        if cap is not None:
            seq_len = min(seq_len, cap)
        lengths.append(min(seq_len, targets - i))
        i += seq_len
    return lengths


@pytest.mark.parametrize("cap", [None, 110])
@pytest.mark.parametrize("epoch", [0, 1, 7])
def test_lengths_follow_the_reference_law(epoch, cap):
    schedule = WindowSchedule(bptt=70, seed=141, max_len=cap)
    stream_len = 46_479 + 1  # PTB's 929k training tokens over 20 streams
    got = schedule.lengths(stream_len, epoch)
    assert got == reference_lengths(stream_len - 1, 70, 141, epoch, cap)
    assert sum(got) == stream_len - 1
    assert min(got[:-1]) >= 5 and (cap is None or max(got) <= cap)


def test_the_law_in_distribution():
    # many windows: about 5% near bptt / 2, the rest near bptt (int() truncates: mean - 0.5)
    got = np.array(WindowSchedule(bptt=70, seed=0).lengths(2_000_001, 0)[:-1])
    short = got < 52
    assert short.mean() == pytest.approx(0.05, abs=0.005)
    assert got[~short].mean() == pytest.approx(69.5, abs=0.05)
    assert got[~short].std() == pytest.approx(5, abs=0.05)
    assert got[short].mean() == pytest.approx(34.5, abs=0.3)
    capped = np.array(WindowSchedule(bptt=70, seed=0, max_len=75).lengths(200_001, 0)[:-1])
    assert capped.max() == 75 and (capped == 75).mean() > 0.1
    assert min(WindowSchedule(bptt=6, seed=0).lengths(100_001, 0)[:-1]) == 5  # min_len


def test_lengths_are_fixed_by_seed_and_epoch():
    a, b = WindowSchedule(70, seed=1), WindowSchedule(70, seed=1)
    assert a.lengths(10_001, 3) == b.lengths(10_001, 3)  # another object, same draws
    assert a.lengths(10_001, 3) != a.lengths(10_001, 4)  # another epoch
    assert a.lengths(10_001, 3) != WindowSchedule(70, seed=2).lengths(10_001, 3)  # another seed


def test_variable_windows_cover_every_target_once():
    tokens = torch.arange(4 * 1001)
    lengths = WindowSchedule(bptt=20, seed=5, std=8).lengths(1001, 0)
    assert len(set(lengths)) > 5
    batches = list(BPTTBatches(tokens, 4, 20, lengths=lengths))
    assert len(batches) == len(lengths) == len(BPTTBatches(tokens, 4, 20, lengths=lengths))
    assert [x.size(1) for x, _ in batches] == lengths
    for x, y in batches:
        torch.testing.assert_close(y, x + 1)
    streams = tokens.view(4, 1001)
    torch.testing.assert_close(torch.cat([x for x, _ in batches], 1), streams[:, :-1])
    torch.testing.assert_close(torch.cat([y for _, y in batches], 1), streams[:, 1:])
    with pytest.raises(ValueError, match="sum to"):
        BPTTBatches(tokens, 4, 20, lengths=lengths[:-1])


# -- the data module -------------------------------------------------------------------------
def small_corpus(folder: Path, ptb_text: dict[str, str], lines: int) -> str:
    """The first ``lines`` lines of each PTB split, as a corpus folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, text in ptb_text.items():
        (folder / f"ptb.{split}.txt").write_text("".join(text.splitlines(True)[:lines]))
    return str(folder)


def trainer_stub(rank: int = 0, world: int = 1, epoch: int = 0, callbacks=()) -> SimpleNamespace:
    return SimpleNamespace(
        global_rank=rank, world_size=world, current_epoch=epoch, overfit_batches=0,
        reload_dataloaders_every_n_epochs=0, callbacks=list(callbacks),
    )  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, ptb_text) -> str:
    return small_corpus(tmp_path_factory.mktemp("corpus"), ptb_text, 300)


def module(corpus: str, **options) -> LanguageModelingDataModule:
    options = {"batch_size": 12, "bptt": 10, "variable_bptt": True, "bptt_std": 4.0, **options}
    return LanguageModelingDataModule(path=corpus, **options)


def windows(data: LanguageModelingDataModule, trainer: SimpleNamespace) -> list:
    data.trainer = trainer
    loader = data.train_dataloader()
    batches = list(loader)
    assert len(loader) == len(batches)
    return batches


def test_ranks_walk_their_streams_in_the_same_windows(corpus, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")
    data = module(corpus)
    single = windows(data, trainer_stub(epoch=2))
    lengths = [x.size(1) for x, _ in single]
    assert len(set(lengths)) > 3
    stream_len = data.num_tokens("train") // 12
    assert lengths == WindowSchedule(10, seed=3, std=4.0).lengths(stream_len, 2)
    for world in (2, 3, 4):
        ranks = [windows(data, trainer_stub(rank, world, epoch=2)) for rank in range(world)]
        for batches in ranks:
            assert [x.size(1) for x, _ in batches] == lengths  # same count, same lengths
        for step, (x, y) in enumerate(single):  # the ranks' rows are the single process's
            torch.testing.assert_close(torch.cat([r[step][0] for r in ranks]), x)
            torch.testing.assert_close(torch.cat([r[step][1] for r in ranks]), y)


def test_epochs_draw_new_windows_and_evaluation_keeps_bptt(corpus, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")
    data = module(corpus)
    epochs = [[x.size(1) for x, _ in windows(data, trainer_stub(epoch=e))] for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    assert len({len(e) for e in epochs}) > 1 or epochs[0] != epochs[2]
    assert len({sum(e) for e in epochs}) == 1  # every target, each epoch
    assert epochs[1] == [x.size(1) for x, _ in windows(data, trainer_stub(epoch=1))]
    data.trainer = trainer_stub(epoch=1)
    valid = [x.size(1) for x, _ in data.val_dataloader()]
    assert set(valid[:-1]) == {10}


def test_global_generators_are_drawn_from_as_with_fixed_windows(corpus):
    # (a DataLoader's iterator draws its base seed from torch's generator, whatever windows)
    def after_a_pass(**options) -> tuple[torch.Tensor, np.ndarray]:
        torch.manual_seed(0)
        np.random.seed(0)
        windows(module(corpus, **options), trainer_stub(epoch=4))
        return torch.get_rng_state(), np.random.get_state()[1]

    (torch_fixed, numpy_fixed), (torch_varied, numpy_varied) = (
        after_a_pass(variable_bptt=False),
        after_a_pass(variable_bptt=True),
    )
    assert torch.equal(torch_varied, torch_fixed)
    assert np.array_equal(numpy_varied, numpy_fixed)


def test_the_seed_is_the_runs_and_the_checkpoint_keeps_it(corpus, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "11")
    data = module(corpus)
    lengths = [x.size(1) for x, _ in windows(data, trainer_stub(epoch=1))]
    state = data.state_dict()
    assert state["window_seed"] == 11
    # a resumed run whose seed_everything drew another seed walks the checkpoint's windows
    monkeypatch.setenv("PL_GLOBAL_SEED", "12")
    again = module(corpus)
    assert [x.size(1) for x, _ in windows(again, trainer_stub(epoch=1))] != lengths
    again.load_state_dict(state)
    assert [x.size(1) for x, _ in windows(again, trainer_stub(epoch=1))] == lengths
    assert "window_seed" not in module(corpus, variable_bptt=False).state_dict()


def test_the_trainer_reloads_the_loader_and_the_run_is_told_about_the_rate(corpus, caplog):
    data = module(corpus)
    trainer = trainer_stub()
    with caplog.at_level(logging.WARNING, logger="datamodules.language_modeling"):
        windows(data, trainer)
        windows(data, trainer)
    assert trainer.reload_dataloaders_every_n_epochs == 1
    warned = [r for r in caplog.records if "app.callbacks.WindowLR" in r.getMessage()]
    assert len(warned) == 1  # once
    caplog.clear()
    scaled = trainer_stub(callbacks=[SimpleNamespace(scales_lr_by_window=True)])
    with caplog.at_level(logging.WARNING, logger="datamodules.language_modeling"):
        windows(module(corpus), scaled)
    assert not [r for r in caplog.records if "WindowLR" in r.getMessage()]
    fixed = trainer_stub()
    windows(module(corpus, variable_bptt=False), fixed)
    assert fixed.reload_dataloaders_every_n_epochs == 0


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("bptt_std", -1.0, "bptt_std"), ("bptt_half_prob", 1.5, "bptt_half_prob"),
     ("min_bptt", 0, "min_bptt"), ("max_bptt", 4, "max_bptt")],
)  # fmt: skip
def test_bad_window_laws_are_refused(corpus, option, value, message):
    with pytest.raises(DataConfigError, match=message):
        module(corpus, **{option: value})


@pytest.mark.parametrize(
    ("epochs", "accumulate", "limit", "max_steps"),
    [(6, 1, 1.0, -1), (6, 3, 1.0, -1), (7, 2, 0.5, -1), (5, 1, 9, -1), (6, 1, 1.0, 50)],
)
def test_the_fits_optimizer_steps_are_counted_exactly(
    corpus, monkeypatch, epochs, accumulate, limit, max_steps
):
    """``stepping_batches`` (what a OneCycle is sized by) against every epoch's windows drawn
    by the reference's loop and Lightning's per-epoch arithmetic, written plainly; Lightning's
    ``estimated_stepping_batches`` takes the first epoch's count for all."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")
    data = module(corpus, bptt_std=5.0)
    stream_len = data.num_tokens("train") // 12
    expected, first = 0, None
    for epoch in range(epochs):
        batches = len(reference_lengths(stream_len - 1, 10, 3, epoch))
        batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
        first = batches if first is None else first
        expected += math.ceil(batches / accumulate)
    expected = expected if max_steps == -1 else min(expected, max_steps)
    lightnings = math.ceil(first / accumulate) * epochs
    lightnings = lightnings if max_steps == -1 else min(lightnings, max_steps)
    trainer = SimpleNamespace(
        overfit_batches=0, max_epochs=epochs, max_steps=max_steps, limit_train_batches=limit,
        accumulate_grad_batches=accumulate, world_size=1, estimated_stepping_batches=lightnings,
    )  # fmt: skip
    assert data.stepping_batches(trainer) == expected
    if limit != 9 and max_steps == -1:  # (a cap of 9 or max_steps make the epochs alike)
        assert lightnings != expected  # the case the count is for
    # fixed windows, overfit_batches (epoch 0's windows every epoch), no end: Lightning's
    fixed = module(corpus, variable_bptt=False)
    assert fixed.stepping_batches(trainer) == lightnings
    assert data.stepping_batches(SimpleNamespace(**{**vars(trainer), "overfit_batches": 2})) == (
        lightnings
    )
    endless = SimpleNamespace(**{**vars(trainer), "max_epochs": -1})
    assert data.stepping_batches(endless) == (float("inf") if max_steps == -1 else max_steps)


def one_cycle_lr(step: int, total: int, max_lr: float) -> float:
    """torch's OneCycleLR (two phases, cosine; pct_start 0.3, div 25, final_div 1e4) at the
    0-based optimizer step ``step``, written plainly."""
    initial = max_lr / 25
    peak_step, last_step = 0.3 * total - 1, total - 1
    if step <= peak_step:
        start, stop, done = initial, max_lr, step / peak_step
    else:
        start, stop, done = max_lr, initial / 1e4, (step - peak_step) / (last_step - peak_step)
    return stop + (start - stop) / 2 * (1 + math.cos(math.pi * done))


class OneCycleStub(L.LightningModule):
    """A parameter vector trained on the data module's windows, under the app's optimizer
    configuration with a OneCycle given no total_steps; each step's applied rate recorded
    (a step pre-hook registered after WindowLR's) with the windows since the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))
        self.applied: list[tuple[float, list[int]]] = []
        self.windows: list[int] = []

    def training_step(self, batch, batch_idx):
        return (self.w * batch[0].float().mean()).sum()

    def on_train_start(self) -> None:
        self.hooked = False

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if not self.hooked:  # (after the callbacks' hook: WindowLR's pre-hook runs first)
            self.trainer.optimizers[0].register_step_pre_hook(self._record)
            self.hooked = True
        # (here, not in training_step: Lightning runs that in the step's closure, after the
        # step's pre-hooks)
        self.windows.append(batch[0].size(1))

    def _record(self, optimizer, args, kwargs) -> None:
        self.applied.append((optimizer.param_groups[0]["lr"], self.windows))
        self.windows = []

    def configure_optimizers(self):
        from lightning_modules.optimization import configure_optimizers

        sgd = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.9)
        one_cycle = functools.partial(torch.optim.lr_scheduler.OneCycleLR, max_lr=0.5)
        return configure_optimizers(self.parameters(), sgd, one_cycle, trainer=self.trainer)


def test_a_one_cycle_over_variable_windows_ends_on_the_fits_last_step(corpus, tmp_path):
    """Sized by Lightning's estimate (the first epoch's windows times the epochs), this fit's
    OneCycle would stop short or raise past its end; sized by the exact count it ends on the
    last step, every step at the schedule's rate times its windows' mean over bptt."""
    data, model = module(corpus, bptt_std=5.0), OneCycleStub()
    trainer = L.Trainer(
        max_epochs=4, accumulate_grad_batches=2, callbacks=[WindowLR()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    L.seed_everything(7)
    trainer.fit(model, datamodule=data)
    schedule = trainer.lr_scheduler_configs[0].scheduler
    assert trainer.global_step == schedule.total_steps == len(model.applied)
    assert trainer.estimated_stepping_batches != trainer.global_step  # Lightning's is off
    expected = [
        one_cycle_lr(step, trainer.global_step, 0.5) * sum(windows) / len(windows) / 10
        for step, (_, windows) in enumerate(model.applied)
    ]
    assert [lr for lr, _ in model.applied] == pytest.approx(expected, rel=1e-9)


# -- a real fit --------------------------------------------------------------------------------
class WindowRecorder(L.Callback):
    """Each training batch's window length, per epoch, and the loader's length Lightning
    holds then."""

    def __init__(self) -> None:
        self.lengths: dict[int, list[int]] = {}
        self.counts: dict[int, int] = {}
        self.validations: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lengths.setdefault(trainer.current_epoch, []).append(batch[0].size(1))
        self.counts[trainer.current_epoch] = trainer.num_training_batches

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.validations.append(trainer.current_epoch)


def tiny_variable_fit(corpus: str) -> list[str]:
    """A 3-epoch CLI fit of a tiny LSTM over ``corpus`` with variable windows (bptt 10, std 6,
    4 streams, seed 5) and WindowLR: options after ``fit``."""
    return [
        "--data.init_args.path", corpus, "--data.init_args.batch_size", "4",
        "--data.init_args.bptt", "10", "--data.init_args.variable_bptt", "true",
        "--data.init_args.bptt_std", "6", "--data.init_args.eval_batch_size", "4",
        "--model.init_args.backbone.init_args.embedding_size", "8",
        "--model.init_args.backbone.init_args.hidden_size", "8",
        "--trainer.max_epochs", "3", "--trainer.limit_val_batches", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false", "--seed_everything", "5",
        "--trainer.callbacks+", "app.callbacks.WindowLR",
    ]  # fmt: skip


def test_a_fit_runs_each_epochs_windows_and_no_more(cli_run, tmp_path, ptb_text, monkeypatch):
    corpus = small_corpus(tmp_path / "corpus", ptb_text, 120)
    recorder = "tests.datamodules.test_variable_bptt.WindowRecorder"
    cli = cli_run("fit", *tiny_variable_fit(corpus), "--trainer.callbacks+", recorder,
                  experiment="ptb_softmax")  # fmt: skip
    (rec,) = [c for c in cli.trainer.callbacks if isinstance(c, WindowRecorder)]
    stream_len = cli.datamodule.num_tokens("train") // 4
    expected = [WindowSchedule(10, seed=5, std=6.0).lengths(stream_len, e) for e in range(3)]
    assert len({len(e) for e in expected}) > 1  # the epochs' counts differ: len must follow
    assert [rec.lengths[e] for e in range(3)] == expected
    assert [rec.counts[e] for e in range(3)] == [len(e) for e in expected]
    assert rec.validations == [0, 1, 2]  # each epoch ended on its last window and validated
    assert cli.trainer.global_step == sum(len(e) for e in expected)


def test_the_cli_sizes_a_one_cycle_to_the_fits_variable_windows(cli_run, tmp_path, ptb_text):
    """``--model.scheduler OneCycleLR`` without ``total_steps`` through the CLI: the task hands
    its trainer to ``configure_optimizers``, which sizes the cycle to the fit's steps (the
    epochs' window counts differ); it ends on the run's last optimizer step."""
    corpus = small_corpus(tmp_path / "corpus", ptb_text, 120)
    cli = cli_run(
        "fit", *tiny_variable_fit(corpus), "--trainer.accumulate_grad_batches", "2",
        "--model.init_args.scheduler", "torch.optim.lr_scheduler.OneCycleLR",
        "--model.init_args.scheduler.max_lr", "0.01", experiment="ptb_softmax",
    )  # fmt: skip
    schedule = cli.trainer.lr_scheduler_configs[0].scheduler
    assert cli.trainer.lr_scheduler_configs[0].interval == "step"
    assert cli.trainer.global_step == schedule.total_steps == schedule.last_epoch
