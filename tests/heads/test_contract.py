"""The head contract (``tests/heads/contract.py``) on every head of its registry ``HEADS``."""

from functools import partial

import pytest

import heads.kernels.compiled_lse as compiled_lse
from heads.fused_cross_entropy import LossOptions
from tests.heads.contract import HEADS, check_loss_matches_reference, each_check, run_check

pytestmark = pytest.mark.usefixtures("one_thread")


@each_check
@pytest.mark.parametrize("make", HEADS.values(), ids=HEADS.keys())
def test_contract(check, make):
    run_check(check, make)


# one head of each kind, built as users build them (no forced chunking)
GPU_PLAN_HEADS = ["softmax-projection", "mos-one_chunk", "mixtape-shared_gates",
                  "adaptive-two_clusters", "ds-k2_bias"]  # fmt: skip


@pytest.mark.parametrize("head", GPU_PLAN_HEADS)
def test_the_gpu_plans_loss_matches_the_reference(head, monkeypatch):
    """The loss as ``auto`` runs it on CUDA, run here: compiled chunk and block bodies (through
    torch.compile's aot_eager backend, seconds instead of Inductor's minutes), equal chunks
    of 5 columns and row tiles of 4, at the contract's edges in float64."""
    import torch._dynamo

    monkeypatch.setattr(compiled_lse, "COMPILE_BACKEND", "aot_eager")
    gpu_plan = LossOptions(plan="compiled", columns=5, rows=4)
    try:
        run_check(partial(check_loss_matches_reference, options=(gpu_plan,)), HEADS[head])
    finally:
        torch._dynamo.reset()
