"""The adaptive softmax under DDP with ``find_unused_parameters=False`` (issue 28, point 1).

A rank whose batch has no target in a tail cluster must still give that cluster's parameters
a gradient (zero), or DDP's reducer waits for it: the other rank all-reduces a bucket this one
never fills, and the run fails or hangs. Two gloo processes on the CPU, rank 1 never touching
the last cluster, must end with the parameters of one process trained on both ranks' rows.
"""

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.ddp_fit import STEPS, main

REPO = Path(__file__).resolve().parents[1]


def test_adaptive_under_ddp_with_a_cluster_missing_on_one_rank_matches_one_process(tmp_path):
    main(1, tmp_path / "single")  # in this process: the reference
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.ddp_fit", "2", str(tmp_path / "ddp")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    single = torch.load(tmp_path / "single" / "rank0.pt")
    ranks = [torch.load(tmp_path / "ddp" / f"rank{r}.pt") for r in range(2)]
    assert single["steps"] == ranks[0]["steps"] == ranks[1]["steps"] == STEPS
    for name, expected in single["state"].items():
        for rank in ranks:
            torch.testing.assert_close(rank["state"][name], expected, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
