import pytest
import torch
import torch.nn.functional as F

from heads.cross_entropy import (
    IGNORE_INDEX,
    _linear_aligned,
    cross_entropy_nll,
    linear_cross_entropy_nll,
)


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


def test_a_retained_graph_gives_the_same_gradient_twice():
    logits, target = _case(torch.float32)
    loss = cross_entropy_nll(logits, target).sum()
    (first,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (second,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(first, second)


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


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "rows, classes",
    [(11, 17), (70, 17), (70, 32)],
    ids=["few-rows", "padded-to-32", "aligned"],  # see _linear_aligned
)
def test_linear_cross_entropy_equals_linear_then_torch_cross_entropy(dtype, bias, rows, classes):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(rows, 5, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(classes, 5, generator=gen, dtype=dtype).requires_grad_()
    b = torch.randn(classes, generator=gen, dtype=dtype).requires_grad_() if bias else None
    target = torch.randint(0, classes, (rows,), generator=gen)
    target[[2, 7]] = IGNORE_INDEX
    target[3] = classes - 1  # the last real class, next to the padding
    weights = torch.rand(rows, generator=gen, dtype=dtype)  # a non-uniform incoming gradient
    inputs = [hidden, weight] + ([b] if bias else [])
    ours = linear_cross_entropy_nll(hidden, weight, b, target)
    grads_ours = torch.autograd.grad((ours * weights).sum(), inputs)
    ref = F.cross_entropy(F.linear(hidden, weight, b), target, reduction="none")
    grads_ref = torch.autograd.grad((ref * weights).sum(), inputs)
    torch.testing.assert_close(ours, ref)
    for got, want in zip(grads_ours, grads_ref, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("rows", [6, 66], ids=["plain", "padded"])
def test_linear_cross_entropy_gradcheck_and_retained_graph(rows):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(rows, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 3, IGNORE_INDEX, 6, 1, 1] * 11)[:rows]
    assert torch.autograd.gradcheck(
        lambda h, w, b: linear_cross_entropy_nll(h, w, b, target), (hidden, weight, bias)
    )
    loss = linear_cross_entropy_nll(hidden, weight, bias, target).sum()
    first = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight))
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("rows", [6, 40])
def test_linear_cross_entropy_of_a_peaked_softmax(rows):
    """Logits spread over thousands: most exps sit below the floor (EXP_FLOOR) and the
    targets' probabilities underflow float32, yet losses and gradients match torch's."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(rows, 8, generator=gen).requires_grad_()
    weight = (300 * torch.randn(37, 8, generator=gen)).requires_grad_()
    target = torch.randint(0, 37, (rows,), generator=gen)
    ours = linear_cross_entropy_nll(hidden, weight, None, target)
    ref = F.cross_entropy(F.linear(hidden, weight), target, reduction="none")
    assert ours.max() > 1000  # probabilities far below the smallest float32
    torch.testing.assert_close(ours, ref)
    grads = torch.autograd.grad(ours.sum(), (hidden, weight))
    for got, want in zip(grads, torch.autograd.grad(ref.sum(), (hidden, weight)), strict=True):
        torch.testing.assert_close(got, want)


def test_aligned_product_pads_with_minus_infinity():
    hidden, weight, bias = torch.randn(70, 3), torch.randn(7, 3), torch.randn(7)
    logits = _linear_aligned(hidden, weight, bias)
    assert logits.shape == (70, 16)
    torch.testing.assert_close(logits[:, :7], F.linear(hidden, weight, bias))
    assert torch.isneginf(logits[:, 7:]).all()
    assert (logits.softmax(-1)[:, 7:] == 0).all()
    assert _linear_aligned(hidden[:20], weight, bias).shape == (20, 7)  # too few rows to pay


def test_linear_cross_entropy_under_bf16_autocast_is_float32():
    hidden = torch.randn(4, 3, requires_grad=True)
    weight = torch.randn(5, 3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        nll = linear_cross_entropy_nll(hidden, weight, None, torch.tensor([0, 1, 2, 3]))
    assert nll.dtype == torch.float32
    nll.sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)  # fmt: skip
def test_half_logits_are_normalised_in_float32(device):
    """bf16 logits: a float32 NLL equal to float32 math on the same (rounded) logits, and a
    gradient in the logits' dtype (on a GPU without a float32 copy of them)."""
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
