"""The head contract (``tests/heads/contract.py``) on every head of its registry ``HEADS``."""

from functools import partial

import pytest
import torch

import heads.kernels.chunks as chunks
import heads.kernels.compiled_lse as compiled_lse
from heads import AdaptiveSoftmaxHead, DSSoftmaxHead, MixtapeHead, MoSHead, SoftmaxHead
from heads.fused_cross_entropy import LossOptions
from tests.heads.contract import (
    HEADS,
    check_empty_batch,
    check_loss_matches_reference,
    each_check,
    run_check,
)

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


@pytest.mark.slow  # 10-85 s a head of aot_eager tracing (row counts 5 and 0, both modes)
@pytest.mark.parametrize("head", GPU_PLAN_HEADS)
def test_the_gpu_plans_take_a_batch_of_no_rows(head, monkeypatch):
    """N = 0 through the compiled chunk and block bodies (aot_eager), in training and
    evaluation, with label smoothing: loss 0, zero gradients (``check_empty_batch``)."""
    import torch._dynamo

    monkeypatch.setattr(compiled_lse, "COMPILE_BACKEND", "aot_eager")
    try:
        run_check(partial(check_empty_batch, options=(LossOptions(plan="compiled"),)), HEADS[head])
    finally:
        torch._dynamo.reset()


# each kind at a vocabulary whose log-probs sum past float16's range (65504) in a row
LARGE_VOCAB = 20_000
LARGE_HEADS = {
    "softmax": partial(SoftmaxHead, 32, LARGE_VOCAB),
    "mos": partial(MoSHead, 32, LARGE_VOCAB, num_components=3),
    "mixtape": partial(MixtapeHead, 32, LARGE_VOCAB),
    "adaptive": partial(AdaptiveSoftmaxHead, 32, LARGE_VOCAB, cutoffs=[2000, 10_000]),
    "ds": partial(DSSoftmaxHead, 32, LARGE_VOCAB, num_experts=2),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head", LARGE_HEADS)
def test_the_gpu_plans_smooth_a_large_vocabulary_under_half_autocast(head, dtype, monkeypatch):
    """16-mixed and bf16-mixed as CUDA's plans run them (here, on this CPU), with label
    smoothing, whose per-row sums over the vocabulary a half-precision product would
    overflow or round: the loss equals the float32 one and the input's gradient is finite."""
    import torch._dynamo

    monkeypatch.setattr(chunks, "GPU_PLAN_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(compiled_lse, "COMPILE_BACKEND", "aot_eager")
    torch.manual_seed(0)
    model = LARGE_HEADS[head]().eval()
    hidden, target = 2 * torch.randn(96, 32), torch.randint(0, LARGE_VOCAB, (96,))
    try:
        want = model(hidden, target, label_smoothing=0.1).loss
        hidden.requires_grad_(True)
        with torch.autocast("cpu", dtype=dtype):
            got = model(hidden, target, label_smoothing=0.1).loss
        got.backward()
    finally:
        torch._dynamo.reset()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
    assert torch.isfinite(hidden.grad).all()
