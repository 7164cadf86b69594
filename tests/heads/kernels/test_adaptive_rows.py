"""heads/kernels/adaptive_rows.py: the adaptive softmax's whole loss and gradients in one
function (plan ``rows`` on CUDA's plans), against PyTorch's ``AdaptiveLogSoftmaxWithLoss`` in
float64: by torch operators (any device) and by the Triton rows kernel (Triton's interpreter
here, the device in the gpu tests)."""

from __future__ import annotations

import os

import pytest
import torch

from heads import adaptive
from heads.adaptive import AdaptiveSoftmaxHead
from heads.fused_cross_entropy import LossOptions
from heads.kernels import chunks, rows_ce
from tests.heads.test_adaptive import copy_into_torch

pytestmark = pytest.mark.usefixtures("one_thread")

D, V, CUTOFFS = 16, 300, [20, 90]


@pytest.fixture
def cuda_plans(monkeypatch):
    """CUDA's execution plans on this CPU (``chunks.GPU_PLAN_DEVICES``)."""
    monkeypatch.setattr(chunks, "GPU_PLAN_DEVICES", {"cuda", "cpu"})


@pytest.fixture(params=["torch", "triton"])
def body(request, monkeypatch, cuda_plans):
    """Each classifier's pass by torch operators, or by the Triton rows kernel (interpreted)."""
    if request.param == "triton":
        pytest.importorskip("triton", reason="Triton is an optional GPU extra")
        if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without CUDA
            pytest.skip("with CUDA, the gpu tests run the kernels on the device")
        monkeypatch.setattr(rows_ce, "TRITON_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(rows_ce, "TRITON_DTYPES", (*rows_ce.TRITON_DTYPES, torch.float64))
    return request.param


def _head(head_bias: bool = False) -> AdaptiveSoftmaxHead:
    torch.manual_seed(0)
    head = AdaptiveSoftmaxHead(D, V, cutoffs=CUTOFFS, div_value=2.0, head_bias=head_bias)
    head = head.double()
    head.loss_options = LossOptions(plan="rows")
    return head


def _batch(rows: int = 64, high: int = V, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, high, (rows,), generator=gen)
    target[:3] = -100
    hidden = torch.randn(rows, D, generator=gen, dtype=torch.float64, requires_grad=True)
    return hidden, target


def _reference(head, hidden, target):
    """PyTorch's layer (a copy of ``head``), its NLL per row (0 where ignored) and their mean
    over the kept rows."""
    ref = copy_into_torch(head, head.div_value)
    keep = target >= 0
    log_probs = ref.log_prob(hidden)
    nll = -log_probs.gather(1, target.clamp_min(0)[:, None]).squeeze(1)
    nll = torch.where(keep, nll, 0.0)
    return ref, nll, nll.sum() / keep.sum().clamp_min(1)


def _grads(loss, inputs):
    return torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("head_bias", [False, True])
def test_the_loss_and_every_gradient_equal_pytorchs_layer(body, head_bias, monkeypatch):
    """Short list and both clusters in one function (no per-classifier loss runs): loss, NLL
    and the gradients of the input and of every parameter, ignored rows included."""
    for name in ("mean_cross_entropy", "plain_nll", "linear_lse"):
        monkeypatch.setattr(adaptive, name, None)  # a per-classifier path would fail here
    head = _head(head_bias)
    hidden, target = _batch()
    out = head(hidden, target)
    ref, nll, loss = _reference(head, hidden, target)
    torch.testing.assert_close(out.nll, nll)
    torch.testing.assert_close(out.loss, loss)
    ours, theirs = [hidden, *head.parameters()], [hidden, *ref.parameters()]
    for got, want in zip(_grads(out.loss, ours), _grads(loss, theirs), strict=True):
        torch.testing.assert_close(got, want)


def test_a_cluster_no_target_falls_in_gets_zero_gradients(body):
    """Targets only in the short list and the first cluster: the second cluster runs on no
    rows, and its parameters get zero gradients (DDP without find_unused_parameters)."""
    head = _head()
    hidden, target = _batch(high=CUTOFFS[1])
    out = head(hidden, target)
    grads = torch.autograd.grad(out.loss, list(head.tail[1].parameters()))
    assert all(g is not None and not g.any() for g in grads)
    _, _, loss = _reference(head, hidden, target)
    torch.testing.assert_close(out.loss, loss)


def test_the_nll_output_differentiated_too(body):
    """``loss + sum_n g_n nll_n``: the backward walks the classifiers again with ``g``."""
    head = _head(head_bias=True)
    hidden, target = _batch()
    g = torch.linspace(-1, 2, hidden.size(0), dtype=torch.float64)
    out = head(hidden, target)
    ref, nll, loss = _reference(head, hidden, target)
    ours, theirs = [hidden, *head.parameters()], [hidden, *ref.parameters()]
    want = _grads(loss + (g * nll).sum(), theirs)
    for got, expected in zip(_grads(out.loss + (g * out.nll).sum(), ours), want, strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("slots", [(64, 64), (16, 40), (50, 0), (48, 3)])
def test_fixed_slots_give_the_same_loss_and_gradients(body, slots):
    """A captured step's layout (``captured_as``): each tail cluster on a fixed number of
    slots, the ones past its rows holding other rows (of the next cluster, or clamped to the
    last row), with no weight: loss, NLL and every gradient as PyTorch's layer's, the NLL's
    own gradient too."""
    head = _head(head_bias=True)
    # rows in the clusters: 15 and 39; with ids below the second cluster's, 48 and none
    high = V if slots[1] > 3 else CUTOFFS[1]
    hidden, target = _batch(high=high)
    with head.captured_as(("slots", slots)):
        out = head(hidden, target)
    ref, nll, loss = _reference(head, hidden, target)
    torch.testing.assert_close(out.nll, nll)
    torch.testing.assert_close(out.loss, loss)
    g = torch.linspace(-1, 2, hidden.size(0), dtype=torch.float64)
    ours, theirs = [hidden, *head.parameters()], [hidden, *ref.parameters()]
    want = _grads(loss + (g * nll).sum(), theirs)
    for got, expected in zip(_grads(out.loss + (g * out.nll).sum(), ours), want, strict=True):
        torch.testing.assert_close(got, expected)


def test_slots_too_few_for_a_cluster_fail_the_step(cuda_plans):
    head = _head()
    hidden, target = _batch()
    with head.captured_as(("slots", (4, 64))), pytest.raises(RuntimeError, match="outgrew"):
        head(hidden, target)


@pytest.mark.parametrize("rows", [1, 5])
def test_one_row_and_every_row_ignored(body, rows):
    head = _head()
    hidden, target = _batch(rows=rows)
    if rows == 5:
        target[:] = -100  # every row ignored: loss 0, gradients 0
    out = head(hidden, target)
    _, nll, loss = _reference(head, hidden, target)
    torch.testing.assert_close(out.nll, nll)
    torch.testing.assert_close(out.loss, loss)
    grads = _grads(out.loss, [hidden, *head.parameters()])
    assert all(torch.isfinite(g).all() for g in grads)
    if rows == 5:
        assert not any(g.any() for g in grads)


def test_half_precision_autocast_stays_near_float64(cuda_plans):
    """Products in bfloat16 under autocast (as on CUDA), statistics in float32."""
    head = _head().float()
    hidden, target = _batch()
    hidden = hidden.detach().float().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(hidden, target)
    _, nll, loss = _reference(head.double(), hidden.double(), target)
    torch.testing.assert_close(out.loss.double(), loss, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.nll.double(), nll, rtol=3e-2, atol=5e-2)


def test_smoothing_evaluation_and_compiling_keep_the_other_plans(cuda_plans, monkeypatch):
    """Label smoothing and no_grad steps run the per-classifier plans (the function's
    gradient-in-the-forward is for training steps of the plain NLL)."""
    calls = []
    monkeypatch.setattr(adaptive, "adaptive_rows_loss", lambda *a: calls.append(a))
    head = _head()
    hidden, target = _batch()
    head(hidden, target, label_smoothing=0.1)
    with torch.no_grad():
        head(hidden, target)
    assert calls == []


@pytest.mark.gpu
def test_on_cuda_under_bf16_it_matches_float64_and_reads_nothing_back():
    """The Triton pass on the device, products in bfloat16: loss, NLL and gradients near
    PyTorch's layer's in float64; with the cluster sizes counted on the host
    (``expect_targets``) the step makes no host sync."""
    torch.manual_seed(0)
    head = AdaptiveSoftmaxHead(64, 3000, cutoffs=[300, 1000]).cuda().train()
    head.loss_options = LossOptions(plan="rows")
    gen = torch.Generator().manual_seed(1)
    target = torch.randint(0, 3000, (512,), generator=gen)
    target[:7] = -100
    hidden = torch.randn(512, 64, generator=gen).cuda().requires_grad_(True)
    head.expect_targets(target)
    target = target.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = head(hidden, target)
        grads = torch.autograd.grad(out.loss, [hidden, *head.parameters()])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    h64 = hidden.detach().double().requires_grad_(True)
    ref, nll, loss = _reference(head.double(), h64, target)
    torch.testing.assert_close(out.loss.double(), loss, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.nll.double(), nll, rtol=3e-2, atol=5e-2)
    want = torch.autograd.grad(loss, [h64, *ref.parameters()])
    for got, expected in zip(grads, want, strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=5e-2, atol=2e-3)
