"""Evaluation under DDP counts every point once: a split that does not divide among the ranks.

Lightning gives a map-style evaluation loader a ``DistributedSampler``, which pads the split
with repeated points so that every rank has as many (its warning: "replicates some samples"):
the synthetic hierarchy's 27 test points on 2 ranks were evaluated as 28, the first counted
twice in the loss, the top-k accuracies and DS-Softmax's utilisation. Two gloo processes on the
CPU must give the figures of one process, and both those of a plain sum over the split.

    python -m tests.test_ddp_eval_once <devices> <folder> [<data class path>]

Run as a module from the repository root: Lightning's DDP launcher re-executes this command
line for rank 1.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from heads import SoftmaxHead
from lightning_modules import Classifier
from lightning_modules.backbones import MLPBackbone

REPO = Path(__file__).resolve().parents[1]
# 3 x 3 classes x 3 test points: 27, odd; a batch of 4 leaves each rank a short last one
DATA = {"num_super": 3, "num_sub": 3, "dim": 4, "test_per_sub": 3, "eval_batch_size": 4}
DATA_CLASS = "datamodules.SyntheticHierarchyDataModule"


def data_module(class_path: str = DATA_CLASS) -> L.LightningDataModule:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)(**DATA)


def model() -> Classifier:
    torch.manual_seed(0)  # the same weights in every process
    return Classifier(MLPBackbone(DATA["dim"], 8), SoftmaxHead(8, 9), top_k=(1, 5))


def evaluate(devices: int, folder: Path, class_path: str = DATA_CLASS) -> None:
    strategy = (
        DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60))
        if devices > 1
        else "auto"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    (metrics,) = trainer.test(model(), datamodule=data_module(class_path))
    if trainer.is_global_zero:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(metrics, folder / f"test{devices}.pt")


def plain_figures() -> dict[str, float]:
    """The test split's mean NLL and top-1 accuracy, summed point by point."""
    data, net = data_module(), model().eval()
    points, labels = data.data["test"]
    nll, hits = 0.0, 0
    with torch.no_grad():
        for x, y in zip(points, labels, strict=True):
            hidden = net.backbone(x[None])
            logits = hidden @ net.head.weight.T + net.head.bias
            log_probs = torch.log_softmax(logits.double(), -1)[0]
            nll -= float(log_probs[y])
            hits += int(log_probs.argmax() == y)
    return {"test/loss": nll / len(labels), "test/acc_top1": hits / len(labels)}


@pytest.mark.slow  # two processes start: ~40 s on 2 shared cores
@pytest.mark.usefixtures("one_thread")
def test_a_split_the_ranks_do_not_divide_is_evaluated_once(tmp_path):
    evaluate(1, tmp_path)  # in this process: one rank
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_ddp_eval_once", "2", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    single, ddp = torch.load(tmp_path / "test1.pt"), torch.load(tmp_path / "test2.pt")
    plain = plain_figures()
    assert 0 < plain["test/acc_top1"] < 1  # 27 points: one counted twice would show
    for key, expected in plain.items():
        assert single[key] == pytest.approx(expected, rel=1e-5), key
        assert ddp[key] == pytest.approx(expected, rel=1e-5), key
    assert ddp["test/acc_top5"] == pytest.approx(single["test/acc_top5"], rel=1e-6)
    assert "replicates some samples" not in done.stderr  # Lightning's padding warning


if __name__ == "__main__":
    evaluate(int(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:4])
