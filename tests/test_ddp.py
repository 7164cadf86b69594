"""DDP on CPU (gloo) through cli.py: two processes reproduce a single-process run.

Each run is a real ``python cli.py fit`` in a subprocess: Lightning's DDP launcher re-executes
the command line for rank 1, which cannot be pytest's.
"""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

NO_DROPOUT_TINY_LSTM = [
    "--model.init_args.backbone.init_args.embedding_size", "32",
    "--model.init_args.backbone.init_args.hidden_size", "32",
    "--model.init_args.backbone.init_args.input_dropout", "0",
    "--model.init_args.backbone.init_args.hidden_dropout", "0",
    "--model.init_args.backbone.init_args.output_dropout", "0",
    "--model.init_args.head.init_args.hidden_size", "32",
]  # fmt: skip


def fit(tmp: Path, ptb_path: str, config: str, *extra: str, devices: int = 1) -> dict[str, float]:
    """Runs a short fit and returns the last logged value of every metric."""
    args = [
        sys.executable, "cli.py", "fit", "--config", f"configs/lm/{config}.yaml",
        "--data.init_args.path", ptb_path, *NO_DROPOUT_TINY_LSTM,
        "--trainer.default_root_dir", str(tmp),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(tmp), "--trainer.logger.name", "csv",
        "--trainer.callbacks", "null", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.max_epochs", "1",
        "--trainer.limit_train_batches", "12", "--trainer.limit_val_batches", "20",
        "--trainer.accelerator", "cpu", "--trainer.devices", str(devices),
        "--trainer.strategy", "ddp" if devices > 1 else "auto", *extra,
    ]  # fmt: skip
    # one thread per process: two ranks with two threads each would oversubscribe 2 cores
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    last: dict[str, float] = {}
    with next(tmp.rglob("metrics.csv")).open() as f:
        for row in csv.DictReader(f):
            last.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return last


def test_two_process_ddp_matches_one_process_with_the_same_global_batch(tmp_path, ptb_path):
    # batch_size is global: 20 streams on one process, 10 on each of two ranks. The
    # validation perplexity is reduced over both ranks' halves of the validation streams.
    single = fit(tmp_path / "single", ptb_path, "ptb_softmax")
    ddp = fit(tmp_path / "ddp", ptb_path, "ptb_softmax", devices=2)
    assert single["step"] == ddp["step"] == 11  # 12 steps, logged 0-based
    assert ddp["val/loss"] == pytest.approx(single["val/loss"], rel=1e-4)
    # an untrained model is at log(10k) = 9.21: the 12 steps did train
    assert single["val/loss"] < math.log(10_000) - 0.2
