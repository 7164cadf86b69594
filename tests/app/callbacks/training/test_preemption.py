"""A preempted fit loses nothing: ``python cli.py fit`` sent SIGTERM (or SIGINT) mid-epoch saves a
resumable checkpoint, says where in one line and exits 143 (130); ``fit --ckpt_path`` of it ends
with the parameters of an uninterrupted run. Real processes and real signals (the process
signals itself in the middle of a batch, as a scheduler would, at a step chosen by the test)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.test_bad_input import WORDS, write_lm_corpus

pytestmark = pytest.mark.slow  # a handful of cli.py processes, ~20 s each on 2 cores

EPOCH = 6  # training batches per epoch
SIGNAL_AT = 8  # mid-epoch: the 3rd batch of the second epoch


def fit(tmp: Path, corpus: str, name: str, *extra: str) -> subprocess.CompletedProcess:
    args = [
        sys.executable, "cli.py", "fit", "--config", "configs/lm/ptb.yaml",
        "--data.init_args.path", corpus, "--data.init_args.batch_size", "4",
        "--data.init_args.eval_batch_size", "2", "--data.init_args.bptt", "5",
        "--model.init_args.backbone.init_args.embedding_size", "16",
        "--model.init_args.backbone.init_args.hidden_size", "16",
        "--model.init_args.backbone.init_args.input_dropout", "0",
        "--model.init_args.backbone.init_args.hidden_dropout", "0",
        "--model.init_args.backbone.init_args.output_dropout", "0",
        "--trainer.max_epochs", "3", "--trainer.limit_train_batches", str(EPOCH),
        "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.logger.init_args.save_dir", str(tmp), "--trainer.logger.init_args.name", name,
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


def final_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_lm_corpus(tmp_path_factory.mktemp("tiny"), WORDS)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("whole")
    done = fit(tmp, corpus, "whole")
    assert done.returncode == 0, done.stderr[-3000:]
    return final_weights(tmp / "whole" / "version_0" / "checkpoints" / "last.ckpt")


@pytest.mark.parametrize("name, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_mid_epoch_saves_a_checkpoint_that_resumes_exactly(
    tmp_path, corpus, uninterrupted, name, status
):
    stopped = fit(tmp_path, corpus, "run", "--trainer.callbacks+",
                  "app.callbacks.training.fail_at_step.SignalAtStep", "--trainer.callbacks.step",
                  str(SIGNAL_AT), "--trainer.callbacks.signal", name)  # fmt: skip
    assert stopped.returncode == status, stopped.stderr[-3000:]
    checkpoint = tmp_path / "run" / "version_0" / "checkpoints" / "last.ckpt"
    lines = [line for line in stopped.stderr.splitlines() if line.startswith(f"{name} at step")]
    assert lines == [
        f"{name} at step {SIGNAL_AT + 1}: saved {checkpoint}; resume with `python cli.py fit "
        f"<same options> --ckpt_path {checkpoint}`"
    ]
    assert "Traceback" not in stopped.stderr
    # the signal named as it is (Lightning's notifier calls every signal SIGTERM), and no
    # line about a default the callback sets
    assert "Received SIGTERM: 2" not in stopped.stderr and "weights_only" not in stopped.stderr
    said = "SIGINT: saving a checkpoint after this batch (Ctrl+C again: stop now)"
    assert (said in stopped.stderr) == (name == "SIGINT")
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert saved["global_step"] == SIGNAL_AT + 1  # the batch under way was finished first
    assert not list(checkpoint.parent.glob(".*partial"))

    resumed = fit(tmp_path, corpus, "resumed", "--ckpt_path", str(checkpoint))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    weights = final_weights(tmp_path / "resumed" / "version_0" / "checkpoints" / "last.ckpt")
    assert weights.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=0, msg=key)
