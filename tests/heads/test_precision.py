"""Lightning's ``bf16-true`` (the model itself cast to bfloat16) on every kind of head, at a
vocabulary wide enough for a bfloat16 sum over it to show: the losses in float32, near the
float64 loss of the same rounded weights and inputs (docs/design.md, "Numerics": products in
the weights' dtype, normalisations and reductions in float32), and every gradient in its
parameter's dtype. ``64-true`` is the contract's float64 reference check (``contract.py``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial

import pytest
import torch

from heads import (
    IGNORE_INDEX,
    AdaptiveSoftmaxHead,
    DSSoftmaxHead,
    Head,
    MixtapeHead,
    MoSHead,
    SoftmaxHead,
)
from heads.fused_cross_entropy import LossOptions

pytestmark = pytest.mark.usefixtures("one_thread")

# V: 3,000 terms of a row's normaliser; a bfloat16 running sum (8 bits) stops growing once it
# is 256 times a term, so a sum over the vocabulary in bfloat16 is off by about log(V / 256)
V, D, N = 3000, 16, 48


def _pruned_ds() -> Head:
    """A DS head pruned in bfloat16 (about half its rows gone), with every regulariser on:
    the pruned classes' constant ``log(V - |v_k|)`` and the aux terms in bf16-true."""
    head = DSSoftmaxHead(D, V, num_experts=3, bias=True, lambda_lasso=1e-3,
                         lambda_expert=1e-3, lambda_load=1.0).to(torch.bfloat16)  # fmt: skip
    norms = torch.linalg.vector_norm(head.weight.detach().float(), dim=1)
    assert head.prune(norms.median().item()) is not None
    return head


HEADS: dict[str, Callable[[], Head]] = {
    "softmax": partial(SoftmaxHead, D, V, embedding_size=8),
    "mos": partial(MoSHead, D, V, num_components=3, embedding_size=8),
    "mixtape": partial(MixtapeHead, D, V, gate_embedding_size=4, frequent_ratio=0.2),
    "mixtape-weight_norm": partial(
        MixtapeHead, D, V, gate_embedding_size=4, weight_norm_scale=2.0
    ),  # fmt: skip
    "adaptive": partial(AdaptiveSoftmaxHead, D, V, cutoffs=[100, 1000], div_value=2.0),
    "ds-pruned": _pruned_ds,
}


def check_bf16_true(make: Callable[[], Head], plan: str, label_smoothing: float) -> None:
    torch.manual_seed(0)
    head = make().to(torch.bfloat16).train()
    head.loss_options = LossOptions(plan=plan)
    reference = copy.deepcopy(head).double().eval()  # the same (rounded) weights, exactly
    head.eval()  # no dropout or gate noise: the two see the same function
    gen = torch.Generator().manual_seed(1)
    hidden = (3 * torch.randn(N, D, generator=gen)).bfloat16().requires_grad_(True)
    target = torch.randint(0, V, (N,), generator=gen)
    target[[3, 7]] = IGNORE_INDEX
    exact = hidden.detach().double().requires_grad_(True)
    got = head(hidden, target, label_smoothing=label_smoothing)
    want = reference(exact, target, label_smoothing=label_smoothing)
    assert got.loss.dtype == got.nll.dtype == got.aux_loss.dtype == torch.float32
    # bfloat16 products: each logit off by ~2^-9 of its size; a bfloat16 sum would be ~2.4 off
    torch.testing.assert_close(got.loss.double(), want.loss, rtol=0, atol=2e-2)
    torch.testing.assert_close(got.nll.double(), want.nll, rtol=0, atol=1e-1)
    torch.testing.assert_close(got.aux_loss.double(), want.aux_loss, rtol=1e-3, atol=1e-6)
    (got.loss + got.aux_loss).backward()
    (want.loss + want.aux_loss).backward()
    pairs = [(hidden, exact), *zip(head.parameters(), reference.parameters(), strict=True)]
    for mine, exact_one in pairs:
        assert (mine.grad is None) == (exact_one.grad is None)
        if mine.grad is None:
            continue
        assert mine.grad.dtype == mine.dtype == torch.bfloat16
        error = (mine.grad.double() - exact_one.grad).norm() / exact_one.grad.norm()
        assert error < 5e-2, (tuple(mine.shape), error.item())


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("plan", ["auto", "eager", "checkpoint", "rows", "plain"])
@pytest.mark.parametrize("head", HEADS)
def test_bf16_true_matches_float64(head, plan, label_smoothing):
    """Each head on every plan a CPU runs, with and without label smoothing (its sum over the
    vocabulary), against float64. DS-Softmax's products take float32 rows (``G h``, upcast)
    against bfloat16 weights: the ``checkpoint`` plan multiplied them as they came and failed
    ("expected m1 and m2 to have the same dtype"); it now casts both to the products' dtype,
    as the other plans do."""
    check_bf16_true(HEADS[head], plan, label_smoothing)
