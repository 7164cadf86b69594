import pytest
import torch
import torch.nn.functional as F

from heads.cross_entropy import IGNORE_INDEX, cross_entropy_nll


def _case(dtype: torch.dtype, rows: int = 11, classes: int = 17):
    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(rows, classes, generator=gen, dtype=dtype)).requires_grad_()
    target = torch.randint(0, classes, (rows,), generator=gen)
    target[[2, 7]] = IGNORE_INDEX
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_and_gradients_equal_torch_cross_entropy(dtype):
    logits, target = _case(dtype)
    weights = torch.rand(target.shape, dtype=dtype)  # a non-uniform incoming gradient
    ours = cross_entropy_nll(logits, target)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    ref = F.cross_entropy(logits, target, reduction="none")
    (grad_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grad_ours, grad_ref)
    assert torch.all(ours[[2, 7]] == 0) and torch.all(grad_ours[[2, 7]] == 0)


def test_float64_gradcheck():
    logits, target = _case(torch.float64, rows=8, classes=6)
    assert torch.autograd.gradcheck(lambda z: cross_entropy_nll(z, target), (logits,))


def test_large_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0]], requires_grad=True)
    nll = cross_entropy_nll(logits, torch.tensor([1]))
    nll.backward()
    assert torch.isfinite(nll).all() and torch.isfinite(logits.grad).all()
    torch.testing.assert_close(nll, torch.tensor([2e4]))


def test_shapes_are_checked():
    with pytest.raises(ValueError, match=r"logits \[N, C\] and target \[N\]"):
        cross_entropy_nll(torch.randn(3, 4), torch.zeros(2, dtype=torch.long))


def test_an_underflowing_target_probability_is_exact_in_log_space():
    # softmax(z)[target] = exp(-200) underflows float32; the nll must still be 200, not inf
    logits = torch.tensor([[200.0, 0.0, 0.0], [0.0, 1.0, 2.0]], requires_grad=True)
    target = torch.tensor([1, 2])
    nll = cross_entropy_nll(logits, target)
    torch.testing.assert_close(nll, F.cross_entropy(logits, target, reduction="none"))
    assert nll[0].item() == pytest.approx(200.0)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)  # fmt: skip
def test_half_logits_are_normalised_in_float32(device):
    """bf16 logits: a float32 NLL equal to float32 math on the same (rounded) logits, and a
    gradient in the logits' dtype (without a float32 copy of them)."""
    gen = torch.Generator().manual_seed(4)
    logits = (8 * torch.randn(33, 301, generator=gen)).to(torch.bfloat16).to(device)
    logits.requires_grad_(True)
    target = torch.randint(0, 301, (33,), generator=gen).to(device)
    target[5] = IGNORE_INDEX
    nll = cross_entropy_nll(logits, target)
    assert nll.dtype == torch.float32
    ref_logits = logits.detach().float().requires_grad_(True)
    ref = F.cross_entropy(ref_logits, target, reduction="none")
    torch.testing.assert_close(nll, ref)
    weights = torch.rand(33, generator=gen).to(device)
    (grad,) = torch.autograd.grad((nll * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), ref_logits)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref_grad, rtol=1e-2, atol=1e-3)
