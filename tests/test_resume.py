"""Exact resume: a run killed mid-epoch, or stopped at an epoch's end and resumed with more
epochs, with ``fit --ckpt_path`` ends in the state of an uninterrupted run, and its loss curve
continues the uninterrupted one.

Everything that training changes structurally is in play at once, with dropout: a Hybrid-LightRNN
vocabulary whose table is re-assigned after every epoch, a DS-Softmax head split by mitosis
at every epoch start and pruned every 2 steps, a ``ReduceLROnPlateau`` scheduler, and the
data position inside the epoch (with the recurrent state carried across BPTT windows).
A fit resumed from a checkpoint in its run folder continues that folder: its best checkpoint
and its TensorBoard curves.
"""

import csv
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from jsonargparse import Namespace
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app.callbacks.training.fail_at_step import InjectedFailure
from app.cli.run_folder import run_checkpoint

EPOCH = 6  # training batches per epoch
FAIL_AT = 15  # mid-epoch: the 4th batch of the third epoch
EVERY = 5  # checkpoint interval (steps)
FAIL_AT_STEP = "app.callbacks.training.fail_at_step.FailAtStep"

CALLBACKS = [
    {"class_path": "tests.test_resume.PruningWindows"},  # before DSPruning: sees its window
    {"class_path": "app.callbacks.Mitosis",
     "init_args": {"max_experts": 8, "every_n_epochs": 1, "noise_std": 0.01}},
    {"class_path": "app.callbacks.DSPruning",
     "init_args": {"gamma": 0.9, "every_n_steps": 2}},
    {"class_path": "app.callbacks.LightRNNTableReassignment",
     "init_args": {"every_n_epochs": 1, "max_batches": 4, "batch_size": 8, "solver": "separable"}},
]  # fmt: skip


class PruningWindows(L.Callback):
    """The loss window ``DSPruning`` decides on at each of its checks: ``step -> (batches,
    sum of their losses)`` (placed before it, it adds the step's own loss)."""

    def __init__(self) -> None:
        self.windows: dict[int, tuple[int, float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pruning = next(c for c in trainer.callbacks if type(c).__name__ == "DSPruning")
        if trainer.global_step % pruning.every_n_steps == 0:
            loss = float(trainer.callback_metrics["train/loss"])
            count, total = pruning._loss_count, float(pruning._loss_sum)
            self.windows[trainer.global_step] = (count + 1, total + loss)


def options(tmp: Path, ptb_path: str, *extra_callbacks: dict) -> list[str]:
    """``fit``'s options after ``configs/lm/ptb.yaml`` for the run the module docstring
    describes, logging and checkpointing under ``tmp`` (``last/last.ckpt``: each epoch's
    end)."""
    callbacks = [
        *CALLBACKS,
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp / "ckpt"), "every_n_train_steps": EVERY,
                       "save_top_k": -1, "filename": "{step}"}},
        {"class_path": "app.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp / "last"), "save_last": True, "save_top_k": 0}},
        *extra_callbacks,
    ]  # fmt: skip
    return [
        "--data.init_args.path", ptb_path, "--data.init_args.vocab", "hybrid_lightrnn",
        "--data.init_args.max_vocab_size", "2000", "--data.init_args.lightrnn_frequent", "200",
        "--data.init_args.batch_size", "4", "--data.init_args.eval_batch_size", "4",
        "--data.init_args.bptt", "10",
        "--model.init_args.tie_weights", "false",
        "--model.init_args.backbone.init_args.embedding_size", "16",
        "--model.init_args.backbone.init_args.hidden_size", "16",
        "--model.init_args.backbone.init_args.num_layers", "1",
        # dropout: the resumed epoch draws the masks the uninterrupted one drew
        "--model.init_args.backbone.init_args.input_dropout", "0.3",
        "--model.init_args.backbone.init_args.hidden_dropout", "0.3",
        "--model.init_args.backbone.init_args.output_dropout", "0.3",
        "--model.init_args.head", "heads.DSSoftmaxHead",
        "--model.init_args.head.init_args.lambda_lasso", "0.01",
        "--trainer.max_epochs", "3", "--trainer.limit_train_batches", str(EPOCH),
        "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(tmp), "--trainer.logger.name", "csv",
        "--trainer.callbacks", yaml.safe_dump(callbacks),
    ]  # fmt: skip


def logged(tmp: Path, key: str) -> dict[int, float]:
    """``step -> value`` of one logged metric (the epoch-level ones at the epoch's last step)."""
    values: dict[int, float] = {}
    for path in tmp.rglob("metrics.csv"):
        with path.open() as f:
            for row in csv.DictReader(f):
                if row.get(key):
                    values[int(row["step"])] = float(row[key])
    return values


def structure(cli) -> dict:
    model, trainer = cli.model, cli.trainer
    mitosis = next(c for c in trainer.callbacks if type(c).__name__ == "Mitosis")
    pruning = next(c for c in trainer.callbacks if type(c).__name__ == "DSPruning")
    return {
        "vocab": cli.datamodule.vocab.state_dict(),
        "lightrnn_cells": cli.datamodule.vocab.cells.tolist(),
        "row_class": model.head.row_class.tolist(),
        "expert_offsets": model.head.expert_offsets.tolist(),
        "splits": mitosis.splits,
        "pruned_rows": pruning.pruned_rows,
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
    }


@pytest.fixture(scope="module")
def uninterrupted(cli_run, tmp_path_factory, ptb_path):
    """The uninterrupted run (3 epochs) and its folder."""
    folder = tmp_path_factory.mktemp("whole")
    return cli_run("fit", *options(folder, ptb_path), experiment="ptb_softmax"), folder


def assert_same_run(whole, whole_folder: Path, resumed, parts: list[Path], since: int) -> None:
    """The resumed run ends as the uninterrupted one: its structure, weights and curves (the
    ``parts``' curves, the later's from step ``since``, make up the uninterrupted ones)."""
    expected, got = structure(whole), structure(resumed)
    assert got["splits"] == expected["splits"] == 2  # 2 -> 4 -> 8 experts
    assert len(got["expert_offsets"]) == 9
    assert got["pruned_rows"] > 0
    assert got["lightrnn_cells"] != list(range(len(got["lightrnn_cells"])))  # re-assigned
    for key in expected:
        assert got[key] == expected[key], key

    for name, value in whole.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, msg=name)

    # the curves: the first part's steps, then the resumed run's, are the uninterrupted one,
    # per batch (train/loss) and per epoch (train/loss_epoch, train/ppl over the whole epoch,
    # val/loss, val/ppl)
    for key in ("train/loss", "train/loss_epoch", "train/ppl", "val/loss", "val/ppl"):
        before, again = logged(parts[0], key), logged(parts[1], key)
        assert max(before) < since <= min(again), key
        assert sorted({**before, **again}) == sorted(logged(whole_folder, key)), key
        for step, value in {**before, **again}.items():
            assert value == pytest.approx(logged(whole_folder, key)[step], rel=1e-6), key


def test_killed_mid_epoch_and_resumed_equals_an_uninterrupted_run(
    cli_run, uninterrupted, tmp_path, ptb_path
):
    whole, whole_folder = uninterrupted
    whole_losses = logged(whole_folder, "train/loss")
    fail = {"class_path": FAIL_AT_STEP, "init_args": {"step": FAIL_AT}}
    with pytest.raises(InjectedFailure, match=f"global step {FAIL_AT}"):
        cli_run("fit", *options(tmp_path / "killed", ptb_path, fail), experiment="ptb_softmax")
    ckpt = tmp_path / "killed" / "ckpt" / f"step={FAIL_AT}.ckpt"
    assert ckpt.is_file(), sorted(p.name for p in (tmp_path / "killed" / "ckpt").iterdir())
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    # the data position inside the epoch is in the checkpoint (3 of the third epoch's 6)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"batches_served": FAIL_AT % EPOCH}
    ]

    resumed = cli_run("fit", *options(tmp_path / "resumed", ptb_path), "--ckpt_path", str(ckpt),
                      experiment="ptb_softmax")  # fmt: skip
    # the resumed epoch skipped the batches trained before the failure
    assert resumed.trainer.train_dataloader.resumed_from == FAIL_AT % EPOCH

    assert_same_run(whole, whole_folder, resumed,
                    [tmp_path / "killed", tmp_path / "resumed"], FAIL_AT)  # fmt: skip
    assert len(whole_losses) == 3 * EPOCH
    # DSPruning's first check after the resume decides on its whole window: the loss of the
    # step before the checkpoint too (the window in progress is in its state)
    windows = next(c for c in whole.trainer.callbacks if isinstance(c, PruningWindows)).windows
    again = next(c for c in resumed.trainer.callbacks if isinstance(c, PruningWindows)).windows
    assert min(again) == FAIL_AT + 1 and again[FAIL_AT + 1][0] == 2
    for step, (count, total) in again.items():
        assert (count, total) == (windows[step][0], pytest.approx(windows[step][1])), step


def test_stopped_at_an_epoch_end_and_resumed_with_more_epochs_equals_an_uninterrupted_run(
    cli_run, uninterrupted, tmp_path, ptb_path
):
    """The usual ``last.ckpt``, written at an epoch's end: the next epoch's dropout draws the
    masks the uninterrupted run drew, the plateau scheduler has taken that epoch's step, and
    the Hybrid-LightRNN table skipped after what was then the last epoch is re-learnt."""
    whole, whole_folder = uninterrupted
    first = cli_run("fit", *options(tmp_path / "first", ptb_path), "--trainer.max_epochs", "2",
                    experiment="ptb_softmax")  # fmt: skip
    assert first.trainer.global_step == 2 * EPOCH
    ckpt = tmp_path / "first" / "last" / "last.ckpt"
    resumed = cli_run("fit", *options(tmp_path / "resumed", ptb_path), "--ckpt_path", str(ckpt),
                      experiment="ptb_softmax")  # fmt: skip
    assert resumed.trainer.train_dataloader.resumed_from == 0  # a new epoch
    assert_same_run(whole, whole_folder, resumed,
                    [tmp_path / "first", tmp_path / "resumed"], 2 * EPOCH)  # fmt: skip


def tensorboard(run: Path, tag: str) -> dict[int, float]:
    """``step -> value`` of a TensorBoard tag in ``run`` (what TensorBoard shows: events a
    later writer purged are left out)."""
    events = EventAccumulator(str(run))
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars(tag)]
    assert len({step for step, _ in points}) == len(points), (tag, points)  # once a step
    return dict(points)


TINY_LM = [
    "--data.init_args.batch_size", "4", "--data.init_args.eval_batch_size", "4",
    "--data.init_args.bptt", "10",
    "--model.init_args.backbone.init_args.embedding_size", "16",
    "--model.init_args.backbone.init_args.hidden_size", "16",
    "--trainer.max_epochs", "3", "--trainer.limit_train_batches", str(EPOCH),
    "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0",
    "--trainer.log_every_n_steps", "1", "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]  # fmt: skip


def test_a_resumed_fit_continues_its_run_folder_and_its_best_checkpoint(
    cli_run, tmp_path, ptb_path
):
    """``fit --ckpt_path last`` of a run killed after an epoch: the fit logs and checkpoints in
    the run's folder, ``ModelCheckpoint`` keeps the best validation of the epochs before the
    resume (a new folder made it forget them: the resumed run's first validation became
    'best', worse or not), and TensorBoard shows one curve, the uninterrupted run's."""
    common = [*TINY_LM, "--data.init_args.path", ptb_path]

    def logs(name: str) -> list[str]:
        return [*common, "--trainer.logger.init_args.save_dir", str(tmp_path / name)]

    whole = cli_run("fit", *logs("whole"), experiment="ptb_softmax")
    fail = ["--trainer.callbacks+", FAIL_AT_STEP, "--trainer.callbacks.step", str(EPOCH + 1)]
    with pytest.raises(InjectedFailure):
        cli_run("fit", *logs("runs"), *fail, experiment="ptb_softmax")
    run = tmp_path / "runs" / "ptb" / "version_0"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = cli_run("fit", *logs("runs"), "--ckpt_path", "last", experiment="ptb_softmax")
    assert resumed.trainer.ckpt_path == str(run / "checkpoints" / "last.ckpt")
    # (nor that the folder it continues is not empty)
    assert not [w for w in caught if "dirpath has changed" in str(w.message)]
    assert not [w for w in caught if "not empty" in str(w.message)], [
        str(w.message) for w in caught
    ]
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    assert resumed.trainer.log_dir == str(run)

    def best(cli) -> dict:
        (checkpoint,) = [c for c in cli.trainer.callbacks if type(c).__name__ == "ModelCheckpoint"]
        return {"score": float(checkpoint.best_model_score),
                "file": Path(checkpoint.best_model_path).name,
                "kept": sorted(Path(path).name for path in checkpoint.best_k_models)}  # fmt: skip

    assert best(resumed) == best(whole)
    logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                       init_args=Namespace(save_dir=str(tmp_path / "runs"), name="ptb",
                                           version=None))  # fmt: skip
    assert run_checkpoint("best", Namespace(logger=logger)).name == best(whole)["file"]
    # one curve: the killed run's steps after the checkpoint are hidden, the resumed run's
    # continue it, the uninterrupted run's values
    for tag in ("train/loss", "val/loss"):
        expected, got = (
            tensorboard(tmp_path / "whole" / "ptb" / "version_0", tag),
            tensorboard(run, tag),
        )
        assert sorted(got) == sorted(expected), tag
        for step, value in got.items():
            assert value == pytest.approx(expected[step], rel=1e-6), (tag, step)


@pytest.mark.slow
def test_resume_under_ddp_continues_each_ranks_streams(tmp_path, ptb_path):
    # Two ranks, each with its own streams, recurrent state and dropout generator: the
    # checkpoint keeps both ranks' (gathered), and each rank continues its own.
    from tests.test_ddp import fit as ddp_fit
    from tests.test_ddp import rank_states

    common = ["--trainer.log_every_n_steps", "1", "--trainer.enable_checkpointing", "true",
              "--model.init_args.backbone.init_args.hidden_dropout", "0.3"]  # fmt: skip
    every = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 4,
                           "save_top_k": -1, "filename": "{step}"}}  # fmt: skip
    fail = {"class_path": FAIL_AT_STEP, "init_args": {"step": 8}}
    whole = ddp_fit(tmp_path / "whole", ptb_path, "ptb_softmax", *common, devices=2)
    with pytest.raises(AssertionError, match="injected failure at global step 8"):
        ddp_fit(tmp_path / "killed", ptb_path, "ptb_softmax", *common, devices=2,
                callbacks=[every, fail])  # fmt: skip
    ckpt = tmp_path / "ckpt" / "step=8.ckpt"
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["train_epoch_state"]["world_size"] == 2
    resumed = ddp_fit(tmp_path / "resumed", ptb_path, "ptb_softmax", *common,
                      "--ckpt_path", str(ckpt), devices=2)  # fmt: skip
    assert resumed["step"] == whole["step"]
    for key in ("train/loss", "val/loss"):
        assert resumed[key] == pytest.approx(whole[key], rel=1e-5), key
    for got, expected in zip(rank_states(tmp_path / "resumed", 2),
                             rank_states(tmp_path / "whole", 2), strict=True):  # fmt: skip
        for name, value in expected["head"].items():
            torch.testing.assert_close(got["head"][name], value, msg=name)
    whole_curve = logged(tmp_path / "whole", "train/loss")
    resumed_curve = logged(tmp_path / "resumed", "train/loss")
    assert sorted(resumed_curve) == list(range(8, 12))  # steps 8-11 (the last is the epoch's)
    for step, value in resumed_curve.items():
        assert value == pytest.approx(whole_curve[step], rel=1e-5), step
