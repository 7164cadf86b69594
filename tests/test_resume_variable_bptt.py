"""Exact resume with AWD-LSTM's variable windows (``data.variable_bptt`` with
``app.callbacks.WindowLR``): a run killed mid-epoch, or stopped at an epoch's end and resumed
with more epochs, walks the windows the uninterrupted run walked (each epoch's count differs,
so the position inside the epoch and the epoch's length must both be right) and ends in its
state. Whole epochs (no ``limit_train_batches``) of a small corpus, with dropout."""

from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from app.callbacks.training.fail_at_step import InjectedFailure
from datamodules.bptt import WindowSchedule
from tests.test_resume import logged

EPOCHS = 3
pytestmark = pytest.mark.slow  # five short fits: about a minute on 2 cores


class LogWindow(L.Callback):
    """Logs each training batch's window length (``train/window``)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.log("train/window", float(batch[0].size(1)), on_step=True, on_epoch=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, ptb_text) -> str:
    folder = tmp_path_factory.mktemp("corpus")
    for split, text in ptb_text.items():
        (folder / f"ptb.{split}.txt").write_text("".join(text.splitlines(True)[:60]))
    return str(folder)


def options(tmp: Path, corpus: str, *extra: dict, seed: int = 5, every: int = 0) -> list[str]:
    callbacks = [
        {"class_path": "app.callbacks.WindowLR"},
        {"class_path": "tests.test_resume_variable_bptt.LogWindow"},
        {"class_path": "app.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp / "last"), "save_last": True, "save_top_k": 0}},
        *extra,
    ]  # fmt: skip
    every_n = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
               "init_args": {"dirpath": str(tmp / "ckpt"), "every_n_train_steps": every,
                             "save_top_k": -1, "filename": "{step}"}}  # fmt: skip
    callbacks += [every_n] if every else []
    return [
        "--data.init_args.path", corpus, "--data.init_args.batch_size", "4",
        "--data.init_args.eval_batch_size", "4", "--data.init_args.bptt", "10",
        "--data.init_args.variable_bptt", "true", "--data.init_args.bptt_std", "6",
        "--model.init_args.backbone.init_args.embedding_size", "8",
        "--model.init_args.backbone.init_args.hidden_size", "8",
        "--model.init_args.backbone.init_args.input_dropout", "0.3",
        "--model.init_args.backbone.init_args.output_dropout", "0.3",
        "--seed_everything", str(seed),
        "--trainer.max_epochs", str(EPOCHS), "--trainer.limit_val_batches", "2",
        "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(tmp), "--trainer.logger.name", "csv",
        "--trainer.callbacks", yaml.safe_dump(callbacks),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def whole(cli_run, tmp_path_factory, corpus):
    folder = tmp_path_factory.mktemp("whole")
    cli = cli_run("fit", *options(folder, corpus), experiment="ptb_softmax")
    stream_len = cli.datamodule.num_tokens("train") // 4
    epochs = [WindowSchedule(10, seed=5, std=6.0).lengths(stream_len, e) for e in range(EPOCHS)]
    assert len({len(e) for e in epochs}) > 1  # the epochs' counts differ
    windows = logged(folder, "train/window")
    # (logged at step s - 1: the step's counter has moved on by the batch's end)
    assert [int(windows[s]) for s in sorted(windows)] == [t for e in epochs for t in e]
    assert cli.trainer.global_step == sum(len(e) for e in epochs)
    return cli, folder, epochs


def assert_same_run(whole, resumed, parts: list[Path], since: int) -> None:
    cli, folder, _ = whole
    assert resumed.trainer.global_step == cli.trainer.global_step
    assert resumed.trainer.current_epoch == cli.trainer.current_epoch
    for name, value in cli.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, msg=name)
    for key in ("train/window", "train/loss", "train/loss_epoch", "val/loss"):
        before, again = logged(parts[0], key), logged(parts[1], key)
        assert max(before) < since <= min(again), key
        expected = logged(folder, key)
        assert sorted({**before, **again}) == sorted(expected), key
        for step, value in {**before, **again}.items():
            assert value == pytest.approx(expected[step], rel=1e-6), (key, step)


def test_killed_mid_epoch_and_resumed_walks_the_same_windows(cli_run, whole, tmp_path, corpus):
    _, _, epochs = whole
    fail_at = len(epochs[0]) + 7  # inside the second epoch
    fail = {"class_path": "app.callbacks.training.fail_at_step.FailAtStep",
            "init_args": {"step": fail_at}}  # fmt: skip
    killed = tmp_path / "killed"
    with pytest.raises(InjectedFailure):
        cli_run("fit", *options(killed, corpus, fail, every=fail_at), experiment="ptb_softmax")
    ckpt = killed / "ckpt" / f"step={fail_at}.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["LanguageModelingDataModule"]["window_seed"] == 5
    # another seed_everything (a run with seed_everything: true draws one at every start): the
    # windows are the checkpoint's seed's
    resumed = cli_run("fit", *options(tmp_path / "resumed", corpus, seed=6),
                      "--ckpt_path", str(ckpt), experiment="ptb_softmax")  # fmt: skip
    assert_same_run(whole, resumed, [killed, tmp_path / "resumed"], fail_at)


def test_stopped_at_an_epoch_end_and_resumed_walks_the_same_windows(
    cli_run, whole, tmp_path, corpus
):
    _, _, epochs = whole
    first = cli_run("fit", *options(tmp_path / "first", corpus), "--trainer.max_epochs", "2",
                    experiment="ptb_softmax")  # fmt: skip
    assert first.trainer.global_step == len(epochs[0]) + len(epochs[1])
    ckpt = tmp_path / "first" / "last" / "last.ckpt"
    resumed = cli_run("fit", *options(tmp_path / "resumed", corpus), "--ckpt_path", str(ckpt),
                      experiment="ptb_softmax")  # fmt: skip
    assert_same_run(whole, resumed, [tmp_path / "first", tmp_path / "resumed"],
                    first.trainer.global_step)  # fmt: skip
