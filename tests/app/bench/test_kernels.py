"""``python -m app.bench.kernels``: every Triton kernel of the heads compiles for Hopper
(sm_90) on this CPU, through Triton's own ptxas, with nothing spilled to local memory.
Needs Triton (an optional GPU extra): skipped, with the reason, where it is not installed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.kernels import Usage

REPO = Path(__file__).resolve().parents[3]


def test_warps_per_sm_follow_the_registers():
    assert Usage("k", "", 64, 0, 0, 8).warps_per_sm == 32  # 4 blocks of 8 warps
    assert Usage("k", "", 121, 0, 0, 8).warps_per_sm == 16
    assert Usage("k", "", 255, 0, 0, 16).warps_per_sm == 0  # one block is over 64k registers


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_without_spills():
    pytest.importorskip("triton", reason="Triton is an optional GPU extra (requirements-gpu.txt)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-m", "app.bench.kernels"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    for kernel in ("rows.statistics", "rows.gradient", "mixtape.statistics K=4",
                   "mixtape.gradient K=8"):  # fmt: skip
        assert kernel in run.stdout
