"""Exact resume: a run killed mid-epoch and resumed with ``fit --ckpt_path`` ends in the state
of an uninterrupted run, and its loss curve continues the uninterrupted one.

Everything that training changes structurally is in play at once, with dropout: a Hybrid-LightRNN
vocabulary whose table is re-assigned after every epoch, a DS-Softmax head split by mitosis
at every epoch start and pruned every 2 steps, a ``ReduceLROnPlateau`` scheduler, and the
data position inside the epoch (with the recurrent state carried across BPTT windows).
"""

import csv
from pathlib import Path

import pytest
import torch
import yaml

from app.callbacks.training.fail_at_step import InjectedFailure

EPOCH = 6  # training batches per epoch
FAIL_AT = 15  # mid-epoch: the 4th batch of the third epoch
EVERY = 5  # checkpoint interval (steps)
FAIL_AT_STEP = "app.callbacks.training.fail_at_step.FailAtStep"

CALLBACKS = [
    {"class_path": "app.callbacks.Mitosis",
     "init_args": {"max_experts": 8, "every_n_epochs": 1, "noise_std": 0.01}},
    {"class_path": "app.callbacks.DSPruning",
     "init_args": {"gamma": 0.9, "every_n_steps": 2}},
    {"class_path": "app.callbacks.LightRNNTableReassignment",
     "init_args": {"every_n_epochs": 1, "max_batches": 4, "batch_size": 8, "solver": "separable"}},
]  # fmt: skip


def options(tmp: Path, ptb_path: str, *extra_callbacks: dict) -> list[str]:
    """``fit``'s options after ``configs/lm/ptb.yaml`` for the run the module docstring
    describes, logging and checkpointing under ``tmp``."""
    callbacks = [
        *CALLBACKS,
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp / "ckpt"), "every_n_train_steps": EVERY,
                       "save_top_k": -1, "filename": "{step}"}},
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


def test_killed_mid_epoch_and_resumed_equals_an_uninterrupted_run(cli_run, tmp_path, ptb_path):
    whole = cli_run("fit", *options(tmp_path / "whole", ptb_path), experiment="ptb_softmax")
    whole_losses = logged(tmp_path / "whole", "train/loss")
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

    expected, got = structure(whole), structure(resumed)
    assert got["splits"] == expected["splits"] == 2  # 2 -> 4 -> 8 experts
    assert len(got["expert_offsets"]) == 9
    assert got["pruned_rows"] > 0
    assert got["lightrnn_cells"] != list(range(len(got["lightrnn_cells"])))  # re-assigned
    for key in expected:
        assert got[key] == expected[key], key

    for name, value in whole.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, msg=name)

    # the curves: the killed run's steps, then the resumed run's, are the uninterrupted one,
    # per batch (train/loss) and per epoch (train/loss_epoch, train/ppl over the whole epoch,
    # val/loss, val/ppl)
    for key in ("train/loss", "train/loss_epoch", "train/ppl", "val/loss", "val/ppl"):
        killed, again = logged(tmp_path / "killed", key), logged(tmp_path / "resumed", key)
        assert max(killed) < FAIL_AT <= min(again), key
        assert sorted({**killed, **again}) == sorted(logged(tmp_path / "whole", key)), key
        for step, value in {**killed, **again}.items():
            assert value == pytest.approx(logged(tmp_path / "whole", key)[step], rel=1e-6), key
    assert len(whole_losses) == 3 * EPOCH


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
