"""Mixtape's frequent-block Triton kernels (heads/kernels/triton_mixtape.py) against the float64
maths written plainly here: the gated logits' statistics and the in-place gradients, with
gate noise, a row whose logits are all ``-inf``, targets outside the block, and padded columns
left untouched. On a CPU under Triton's interpreter where Triton is installed (an optional
GPU extra); on CUDA in the ``gpu`` tests, in bf16."""

import math
import os

import pytest
import torch

from heads.kernels.sigmoid_tree import sigmoid_tree_priors

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def kernels():
    pytest.importorskip("triton", reason="Triton is an optional GPU extra (requirements-gpu.txt)")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("the kernels need CUDA or TRITON_INTERPRET=1 (tests/conftest.py)")
    from heads.kernels import triton_mixtape

    return triton_mixtape


def _case(device="cpu", dtype=torch.float64, rows=5, k=4, s=300, padded=320, seed=0):
    """A tile's products' outputs (``padded`` columns, ``s`` of them the block's), the bias,
    targets (at the block's edges, outside it, ignored) and three coefficients per row."""
    gen = torch.Generator().manual_seed(seed)
    values = 2 * torch.randn(rows * k, padded, generator=gen, dtype=torch.float64)
    pre = 2 * torch.randn(rows * (k - 1), padded, generator=gen, dtype=torch.float64)
    bias = torch.randn(s, generator=gen, dtype=torch.float64)
    target = torch.tensor([0, s - 1, s + 3, -1, 17])[:rows]
    coefficients = [torch.rand(rows, generator=gen, dtype=torch.float64) for _ in range(3)]
    return (
        values.to(device, dtype),
        pre.to(device, dtype),
        bias.to(device),
        target.to(device),
        [c.to(device) for c in coefficients],
    )


def _reference(values, pre, bias, target, s, k, noise, lse_all, scale, onehot, uniform):
    """``(lse, z_target, sum z, dL/d values, dL/d pre)`` in float64, by autograd."""
    rows = target.numel()
    values = values.double()[:, :s].reshape(rows, k, s).clone().requires_grad_()
    pre = pre.double()[:, :s].reshape(rows, k - 1, s).clone().requires_grad_()
    priors = sigmoid_tree_priors((pre + noise).transpose(1, 2)).transpose(1, 2)  # Eq. 3
    z = (priors * values).sum(1) + bias.double()  # Eq. 2
    inside = (target >= 0) & (target < s)
    picked = torch.where(inside, z.gather(1, target.clamp(0, s - 1)[:, None])[:, 0], 0.0)
    lse = torch.logsumexp(z, 1)
    lse_all = lse if lse_all is None else lse_all
    p = torch.where(lse_all[:, None] == -math.inf, 0.0, torch.exp(z - lse_all[:, None]))
    hit = torch.arange(s, device=z.device)[None, :] == target[:, None]
    dz = scale[:, None] * p - torch.where(hit, onehot[:, None], 0.0) - uniform[:, None]
    grad_values, grad_pre = torch.autograd.grad(z, (values, pre), dz.detach())
    return lse, picked, z.sum(1), grad_values, grad_pre


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("noise_std", [0.0, 0.5])
def test_statistics_and_gradient_equal_the_float64_maths(kernels, k, noise_std):
    values, pre, bias, target, (scale, onehot, uniform) = _case(k=k)
    s, rows = bias.numel(), target.numel()
    seed = torch.tensor([99], dtype=torch.int64)
    noise = noise_std * kernels.gate_noise(seed, rows, k, s, row0=7).double()
    args = dict(seed=seed, noise_std=noise_std, row0=7)
    lse, picked, total = kernels.frequent_statistics(values, pre, bias, target, s, True,
                                                     acc=torch.float64, **args)  # fmt: skip
    # the gradient's log-sum-exp: the whole softmax's, here this block's plus some more
    lse_all = lse + 0.25
    want = _reference(values, pre, bias, target, s, k, noise, lse_all, scale, onehot, uniform)
    for got, expected in zip((lse, picked, total), want[:3], strict=True):
        torch.testing.assert_close(got, expected)
    kernels.frequent_gradient_(values, pre, bias, target, s, lse_all, scale, onehot, uniform,
                               **args)  # fmt: skip
    torch.testing.assert_close(values[:, :s].view(rows, k, s), want[3])
    torch.testing.assert_close(pre[:, :s].view(rows, k - 1, s), want[4])
    # the padding (non-zero here, unlike a product's with zero weight rows) written 0
    assert not values[:, s:].any() and not pre[:, s:].any()


def test_a_row_of_minus_infinity_gives_no_nan(kernels):
    """Every logit ``-inf`` (a bias of ``-inf``): ``lse = -inf``, ``p = 0``."""
    values, pre, bias, target, (scale, onehot, uniform) = _case()
    bias.fill_(-math.inf)
    s = bias.numel()
    lse, picked, _ = kernels.frequent_statistics(values, pre, bias, target, s, False,
                                                 acc=torch.float64)  # fmt: skip
    assert (lse == -math.inf).all()
    kernels.frequent_gradient_(values, pre, bias, target, s, lse, scale, onehot, uniform)
    assert torch.isfinite(values).all() and torch.isfinite(pre).all()


def test_noise_is_standard_normal_and_keyed_by_row(kernels):
    seed = torch.tensor([12345], dtype=torch.int64)
    big = kernels.gate_noise(seed, 64, 4, 1000)
    assert abs(big.mean().item()) < 0.02 and abs(big.std().item() - 1) < 0.02
    assert torch.equal(kernels.gate_noise(seed, 2, 4, 1000, row0=5)[0], big[5])
    assert not torch.equal(kernels.gate_noise(seed + 1, 1, 4, 1000)[0], big[0])


def test_bad_shapes_are_refused_in_one_line(kernels):
    values, pre, bias, target, _ = _case(k=4)
    with pytest.raises(ValueError, match=r"values \[R K, S\]"):
        kernels.frequent_statistics(values[:-1], pre, bias, target, bias.numel(), False)
    with pytest.raises(ValueError, match="power of two"):
        kernels.frequent_statistics(values[:15], pre[:10], bias, target, bias.numel(), False)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2, 4, 8])
def test_cuda_kernels_in_bf16_equal_the_float64_maths(kernels, k):
    s = 10_007
    values, pre, bias, target, (scale, onehot, uniform) = _case(
        "cuda", torch.bfloat16, rows=5, k=k, s=s, padded=10_048
    )
    seed = torch.tensor([3], dtype=torch.int64, device="cuda")
    noise = 0.3 * kernels.gate_noise(seed, 5, k, s).double()
    args = dict(seed=seed, noise_std=0.3)
    lse, picked, total = kernels.frequent_statistics(values, pre, bias.float(), target, s, True,
                                                     **args)  # fmt: skip
    want = _reference(values, pre, bias, target, s, k, noise, lse.double(), scale.float(),
                      onehot.float(), uniform.float())  # fmt: skip
    torch.testing.assert_close(lse.double(), want[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(picked.double(), want[1], rtol=1e-4, atol=1e-4)
    kernels.frequent_gradient_(values, pre, bias.float(), target, s, lse, scale.float(),
                               onehot.float(), uniform.float(), **args)  # fmt: skip
    for got, expected in ((values, want[3]), (pre, want[4])):
        assert not got[:, s:].any()  # the padding to 64 columns: written 0
        got = got[:, :s].double().view(expected.shape)
        assert ((got - expected).norm() / expected.norm()) < 1e-2
