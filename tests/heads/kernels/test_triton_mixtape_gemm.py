"""Mixtape's frequent block as fused products (heads/kernels/triton_mixtape_gemm.py) against
the float64 maths written plainly here, by autograd: the block's log-sum-exp and target
logit, and the gradients of the contexts, ``W``, the bias, the gate inputs and the gate
weights for ``dz = scale p - onehot [x = t]`` over a softmax larger than the block; with and
without gate noise and a bias, at K = 2, 4, 8, targets at the block's edges, outside it and
ignored, padded columns. On a CPU under Triton's interpreter where Triton is installed (an
optional GPU extra), in small tiles so that a row has several blocks."""

import dataclasses
import math
import os

import pytest
import torch

from heads.kernels.sigmoid_tree import sigmoid_tree_priors
from tests.heads.kernels.test_triton_gemm import SMALL

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fused(monkeypatch):
    """The module, its kernel through Triton's interpreter in small tiles."""
    pytest.importorskip("triton", reason="Triton is an optional GPU extra (requirements-gpu.txt)")
    if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without CUDA
        pytest.skip("with CUDA, the gpu tests run the kernels on the device")
    from heads.kernels import triton_gemm, triton_mixtape_gemm

    small = triton_mixtape_gemm.FrequentLaunch(block_m=16, block_n=16, block_k=16, block_e=16)
    monkeypatch.setattr(triton_mixtape_gemm, "FREQUENT_LAUNCH", small)
    # the planes' dz^T h over two of its blocks a tile, as the heads' 128 over 32
    monkeypatch.setattr(triton_gemm, "GEMM_LAUNCH", dataclasses.replace(SMALL, weight_block_c=32))
    return triton_mixtape_gemm


def _case(k, rows=5, d=20, e=24, s=70, width=96, seed=0):
    """Contexts, ``W`` (``s`` rows, then zero rows to ``width``), gate inputs and weights, a
    bias, targets (the block's edges, outside it, ignored) and per-row coefficients."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    h, g = randn(rows * k, d), randn(rows * (k - 1), e)
    w, gw = torch.zeros(width, d, dtype=torch.float64), torch.zeros(width, e, dtype=torch.float64)
    w[:s], gw[:s] = randn(s, d), randn(s, e)
    bias = randn(s)
    target = torch.tensor([0, s - 1, s + 3, -1, 17])[:rows]
    scale, onehot = (torch.rand(rows, generator=gen, dtype=torch.float64) for _ in range(2))
    rare = randn(rows)  # the rest of the softmax's log-sum-exp (the rare block's)
    return h, w, g, gw, bias, target, scale, onehot, rare


def _reference(h, w, g, gw, bias, target, s, k, noise, scale, onehot, rare):
    """``(lse, z_target, gradients of h, w, bias, g, gw)`` in float64, by autograd."""
    rows = target.numel()
    leaves = [x.clone().requires_grad_() for x in (h, w[:s], g, gw[:s])]
    hh, ww, gg, gww = leaves
    b = bias.clone().requires_grad_()
    pre = (gg @ gww.t()).view(rows, k - 1, s) + noise  # Eq. 4
    priors = sigmoid_tree_priors(pre.transpose(1, 2)).transpose(1, 2)  # Eq. 3
    z = (priors * (hh @ ww.t()).view(rows, k, s)).sum(1) + b  # Eq. 2
    inside = (target >= 0) & (target < s)
    picked = torch.where(inside, z.gather(1, target.clamp(0, s - 1)[:, None])[:, 0], 0.0)
    lse = torch.logsumexp(z, 1)
    loss = (scale * torch.logaddexp(lse, rare) - onehot * picked).sum()
    grads = torch.autograd.grad(loss, [*leaves, b])
    return lse.detach(), picked.detach(), grads


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("noise_std", [0.0, 0.5])
@pytest.mark.parametrize("with_bias", [True, False])
def test_block_and_gradients_equal_the_float64_maths(fused, k, noise_std, with_bias):
    _check(fused, k, noise_std, with_bias)


def test_gradients_with_dz_w_split_over_column_blocks(fused, monkeypatch):
    """Few row tiles: each plane's ``dz W`` split over more programs, the splits summed into
    the plane's rows of the contexts' and gate inputs' gradients (strided views)."""
    from heads.kernels import triton_gemm

    monkeypatch.setattr(triton_gemm, "_INTERPRETED_SMS", 16)
    assert triton_gemm._splits(5, 20, 6, torch.device("cpu"), triton_gemm.GEMM_LAUNCH) > 1
    _check(fused, 4, 0.5, True)


def _check(fused, k, noise_std, with_bias):
    from heads.kernels import triton_mixtape

    h, w, g, gw, bias, target, scale, onehot, rare = _case(k)
    s, rows = bias.numel(), target.numel()
    bias = bias if with_bias else torch.zeros_like(bias)
    seed = torch.tensor([99], dtype=torch.int64)
    # the cuBLAS tile's kernels' draw: the same noise either way
    noise = noise_std * triton_mixtape.gate_noise(seed, rows, k, s, row0=7).double()
    blocks = fused.frequent_blocks(h, w, g, gw, bias if with_bias else None, target, s, seed,
                                   noise_std, row0=7, acc=torch.float64)  # fmt: skip
    lse, picked, want = _reference(h, w, g, gw, bias, target, s, k, noise.view(rows, k - 1, s),
                                   scale, onehot, rare)  # fmt: skip
    torch.testing.assert_close(blocks.lse, lse)
    torch.testing.assert_close(blocks.picked, picked)
    width, (d, e) = w.size(0), (h.size(1), g.size(1))
    out = fused.FrequentGradients(
        h=torch.empty_like(h), g=torch.empty_like(g), w=torch.full((width, d), 0.5).double(),
        b=torch.full((width,), 0.25).double(), gw=torch.full((width, e), 0.5).double(),
    )  # fmt: skip
    total = torch.logaddexp(blocks.lse, rare)
    fused.frequent_gradients(blocks, h, w, g, gw, target, s, total, scale, onehot, out,
                             accumulate=True)  # fmt: skip
    dh, dw, dg, dgw, db = want
    torch.testing.assert_close(out.h, dh)
    torch.testing.assert_close(out.g, dg)
    torch.testing.assert_close(out.w[:s] - 0.5, dw)
    torch.testing.assert_close(out.gw[:s] - 0.5, dgw)
    torch.testing.assert_close(out.b[:s] - 0.25, db)
    # the padding's gradients are 0
    assert (out.w[s:] == 0.5).all() and (out.gw[s:] == 0.5).all() and (out.b[s:] == 0.25).all()


def test_rows_of_minus_inf_give_no_nan(fused):
    """A bias of ``-inf`` over the whole block (a masked block): lse ``-inf``, no NaN in the
    gradients, which are 0."""
    h, w, g, gw, bias, target, scale, onehot, rare = _case(4)
    s = bias.numel()
    blocks = fused.frequent_blocks(h, w, g, gw, torch.full_like(bias, -math.inf), target, s,
                                   acc=torch.float64)  # fmt: skip
    assert (blocks.lse == -math.inf).all()
    out = fused.FrequentGradients(h=torch.empty_like(h), w=torch.empty_like(w))
    fused.frequent_gradients(blocks, h, w, g, gw, target, s, rare, scale, torch.zeros_like(onehot),
                             out, accumulate=False)  # fmt: skip
    assert (out.h == 0).all() and (out.w == 0).all()


def test_a_bad_layout_is_refused_in_one_line(fused):
    h, w, g, gw, bias, target, *_ = _case(4)
    with pytest.raises(ValueError, match=r"expected h \[R K, d\]"):
        fused.frequent_blocks(h[:-1], w, g, gw, bias, target, bias.numel())


@pytest.mark.gpu
def test_cuda_block_as_the_head_launches_it():
    """On CUDA in bf16 at the benchmark's size per tile (S = 10,000 frequent tokens of
    V = 100k, K = 4, d = 512, the gate inputs 72 wide), 512 tokens: the block's statistics
    and every gradient against float64 (gradients in norm: bf16 planes)."""
    from heads.kernels import triton_mixtape, triton_mixtape_gemm

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    k, rows, d, e, s, width = 4, 512, 512, 72, 10_000, 10_048
    h, w, g, gw, bias, target, scale, onehot, rare = _case(k, rows=5, d=d, e=e, s=s, width=width)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(rows * k, d, generator=gen, dtype=torch.float64) / 8
    g = torch.randn(rows * (k - 1), e, generator=gen, dtype=torch.float64)
    target = torch.randint(-1, 2 * s, (rows,), generator=gen)  # some rare (outside), some none
    scale, onehot, rare = (torch.rand(rows, generator=gen, dtype=torch.float64) for _ in range(3))
    seed = torch.tensor([7], dtype=torch.int64, device="cuda")
    cuda = [x.cuda().to(torch.bfloat16) for x in (h, w, g, gw)]
    blocks = triton_mixtape_gemm.frequent_blocks(*cuda, bias.float().cuda(), target.cuda(), s,
                                                 seed, 0.3, row0=0)  # fmt: skip
    noise = 0.3 * triton_mixtape.gate_noise(seed, rows, k, s, row0=0).double().cpu()
    exact = [x.double() for x in (cuda[0].cpu(), cuda[1].cpu(), cuda[2].cpu(), cuda[3].cpu())]
    lse, picked, want = _reference(*exact, bias.float().double(), target, s, k,
                                   noise.view(rows, k - 1, s), scale, onehot, rare)  # fmt: skip
    torch.testing.assert_close(blocks.lse.double().cpu(), lse, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(blocks.picked.double().cpu(), picked, rtol=1e-3, atol=1e-3)
    out = triton_mixtape_gemm.FrequentGradients(
        h=torch.empty(rows * k, d, device="cuda"), g=torch.empty(rows * (k - 1), e, device="cuda"),
        w=torch.empty(width, d, device="cuda"), b=torch.empty(width, device="cuda"),
        gw=torch.empty(width, e, device="cuda"),
    )  # fmt: skip
    total = torch.logaddexp(blocks.lse.double().cpu(), rare)
    on = [x.float().cuda() for x in (total, scale, onehot)]
    triton_mixtape_gemm.frequent_gradients(blocks, *cuda, target.cuda(), s, *on, out,
                                           accumulate=False)  # fmt: skip
    for got, expected in zip((out.h, out.w[:s], out.g, out.gw[:s], out.b[:s]), want, strict=True):
        error = (got.double().cpu() - expected).norm() / expected.norm()
        assert error < 2e-2, error
