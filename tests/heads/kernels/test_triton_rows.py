"""The rows plan's Triton kernels (heads/kernels/triton_rows.py): each kernel against the
float64 maths written plainly here (rows of ``-inf``, ignored targets, bias or none, the fused
and the two-kernel forms), and the rows plan through them (softmax, mixture, block: float64
equality with the plain maths). On a CPU they run under Triton's interpreter where Triton is
installed (an optional GPU extra); on CUDA in the ``gpu`` tests, in bf16."""

import math
import os

import pytest
import torch

import heads.kernels.rows_ce as rows_ce
from heads.fused_cross_entropy import LossOptions
from heads.kernels.triton_rows import row_gradient_, row_statistics
from tests.heads.kernels import test_rows_ce as rows_tests
from tests.heads.kernels.cases import float64_case

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels on a CPU, through Triton's interpreter, and the rows plan's tiles by them
    (float64 too: the kernels take the statistics' dtype from the logits')."""
    pytest.importorskip("triton", reason="Triton is an optional GPU extra (requirements-gpu.txt)")
    if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without CUDA
        pytest.skip("with CUDA, the gpu tests run the kernels on the device")
    monkeypatch.setattr(rows_ce, "TRITON_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(rows_ce, "TRITON_DTYPES", (*rows_ce.TRITON_DTYPES, torch.float64))


def _logits_case(device="cpu", dtype=torch.float64, rows=6, columns=5000, seed=0):
    """Logits with a row of ``-inf``, targets at both ends, two outside ``[0, V)`` (one in
    the last block's padding)."""
    gen = torch.Generator().manual_seed(seed)
    z = 3 * torch.randn(rows, columns, generator=gen, dtype=torch.float64)
    z[2] = -math.inf
    bias = torch.randn(columns, generator=gen, dtype=torch.float64)
    target = torch.randint(0, columns, (rows,), generator=gen)
    target[:6] = torch.tensor([0, columns - 1, 3, -1, columns + 3, 4096])  # + 3: padding
    coefficients = [torch.rand(rows, generator=gen, dtype=torch.float64) for _ in range(3)]
    return z.to(device, dtype), bias.to(device), target.to(device), coefficients


def _reference(z, bias, target, scale, onehot, uniform):
    """``(lse, z_target, sum z, dz)`` in float64, plainly."""
    z = z.double() + (0 if bias is None else bias.double())
    lse = torch.logsumexp(z, 1)
    inside = (target >= 0) & (target < z.size(1))
    picked = torch.where(inside, z.gather(1, target.clamp(0, z.size(1) - 1)[:, None])[:, 0], 0)
    p = torch.where(lse[:, None] == -math.inf, 0.0, torch.exp(z - lse[:, None]))
    hit = torch.arange(z.size(1), device=z.device)[None, :] == target[:, None]
    dz = scale[:, None] * p - torch.where(hit, onehot[:, None], 0.0) - uniform[:, None]
    return lse, picked, z.sum(1), dz


def _check_kernels(z, bias, target, coefficients, rtol=None, atol=None):
    scale, onehot, uniform = (c.to(z.device, torch.float32 if z.dtype != torch.float64 else
                                   torch.float64) for c in coefficients)  # fmt: skip
    acc = scale.dtype
    lse, picked, total, dz = _reference(z, bias, target, scale, onehot, uniform)
    finite = lse != -math.inf  # sum of a row of -inf: -inf either way
    close = {"rtol": rtol, "atol": atol}
    got = row_statistics(z.clone(), bias, target, True, acc=acc)
    torch.testing.assert_close(got[0].double(), lse, **close)
    torch.testing.assert_close(got[1].double(), picked, **close)
    torch.testing.assert_close(got[2][finite].double(), total[finite], **close)
    two = row_gradient_(z.clone(), bias, target, got[0], scale, onehot, uniform)
    fused = z.clone()
    row_statistics(fused, bias, target, False, fuse=(scale, onehot, uniform), acc=acc)
    for form in (two, fused):
        assert form.dtype == z.dtype
        torch.testing.assert_close(form.double(), dz, **close)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("bias", [True, False])
def test_kernels_equal_the_float64_maths(bias):
    z, b, target, coefficients = _logits_case()
    _check_kernels(z, b if bias else None, target, coefficients)


@pytest.mark.usefixtures("interpreted")
def test_kernels_read_bf16_logits_and_write_bf16_gradients():
    z, b, target, coefficients = _logits_case(dtype=torch.bfloat16)
    _check_kernels(z, b.float(), target, coefficients, rtol=1e-2, atol=1e-2)


def _check_padding(device, dtype, columns, bias, rows=6, **close):
    """``v`` of the row's columns count; the rest (the products' padding to 64, read for
    16-byte loads) hold large logits here, which would decide the log-sum-exp if counted; a
    target there is outside ``[0, v)``. ``dz`` is 0 over them in both forms."""
    z, b, target, coefficients = _logits_case(device, dtype, rows, columns)
    v, width = z.size(1), -(-columns // 64) * 64
    padded = torch.cat((z, torch.full((rows, width - v), 50.0, dtype=dtype, device=device)), 1)
    target[4] = v + 10
    b = b.to(_acc(dtype)) if bias else None
    scale, onehot, uniform = (c.to(device, _acc(dtype)) for c in coefficients)
    lse, picked, total, dz = _reference(z, b, target, scale, onehot, uniform)
    got = row_statistics(padded.clone(), b, target, True, acc=_acc(dtype), v=v)
    torch.testing.assert_close(got[0].double(), lse, **close)
    torch.testing.assert_close(got[1].double(), picked, **close)
    finite = lse != -math.inf
    torch.testing.assert_close(got[2][finite].double(), total[finite], **close)
    two = row_gradient_(padded.clone(), b, target, got[0], scale, onehot, uniform, v=v)
    fused = padded.clone()
    row_statistics(fused, b, target, False, fuse=(scale, onehot, uniform), acc=_acc(dtype), v=v)
    for form in (two, fused):
        torch.testing.assert_close(form[:, :v].double(), dz, **close)
        assert not form[:, v:].any()


def _check_outside(device, dtype, columns, **close):
    """``outside_lse``: the columns are one block of a softmax whose other blocks' log-sum-exp
    is given (Mixtape's rare block, the frequent one outside): ``dz = a exp(z - logaddexp(lse,
    outside)) - b [x = t] - c``; the returned statistics stay the block's own. A row of
    ``-inf`` here and outside too gives ``p = 0``; an outside of ``-inf`` the block alone."""
    z, b, target, coefficients = _logits_case(device, dtype, 6, columns)
    b = b.to(_acc(dtype))
    scale, onehot, uniform = (c.to(device, _acc(dtype)) for c in coefficients)
    outside = torch.tensor([1.0, 50.0, -math.inf, -math.inf, 3.0, -2.0], device=device,
                           dtype=_acc(dtype))  # fmt: skip
    lse, picked, _, _ = _reference(z, b, target, scale, onehot, uniform)
    whole = torch.logaddexp(lse, outside.double())
    p = torch.where(whole[:, None] == -math.inf, 0.0,
                    torch.exp(z.double() + b.double() - whole[:, None]))  # fmt: skip
    hit = torch.arange(z.size(1), device=device)[None, :] == target[:, None]
    dz = scale[:, None] * p - torch.where(hit, onehot[:, None], 0.0) - uniform[:, None]
    fused = z.clone()
    got = row_statistics(fused, b, target, False, fuse=(scale, onehot, uniform),
                         acc=_acc(dtype), outside_lse=outside)  # fmt: skip
    torch.testing.assert_close(got[0].double(), lse, **close)
    torch.testing.assert_close(got[1].double(), picked, **close)
    torch.testing.assert_close(fused.double(), dz.double(), **close)


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("bias", [True, False])
def test_padding_columns_are_read_but_not_counted_and_their_gradient_is_zero(bias):
    _check_padding("cpu", torch.float64, 4993, bias)


@pytest.mark.usefixtures("interpreted")
def test_fused_gradient_of_a_block_takes_p_over_the_whole_softmax():
    _check_outside("cpu", torch.float64, 5000)
    z, b, target, _ = _logits_case()
    with pytest.raises(ValueError, match="pass fuse as well"):
        row_statistics(z, b, target, False, outside_lse=torch.zeros(6, dtype=torch.float64))


@pytest.mark.usefixtures("interpreted")
def test_masked_columns_then_very_negative_logits_give_no_nan():
    """The online sum rescaled from an empty start (maximum ``-inf``) to a finite one far
    below 0: ``0 * exp(-inf - (-1000))`` would be ``0 * inf``."""
    z = torch.full((2, 5000), -math.inf, dtype=torch.float64)
    z[0, 3000:], z[1, :] = -1000.0, -1000.0
    z[1, 4000] = -990.0
    lse, _, _ = row_statistics(z, None, torch.tensor([3500, 4000]), False, acc=torch.float64)
    torch.testing.assert_close(lse, torch.logsumexp(z, 1))


@pytest.mark.usefixtures("interpreted")
def test_a_bad_layout_is_refused_in_one_line():
    z, b, target, _ = _logits_case()
    with pytest.raises(ValueError, match="unit column stride"):
        row_statistics(z.t(), b, target, False)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("use", rows_tests.USES.values(), ids=rows_tests.USES.keys())
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "two_kernels"])
def test_rows_plan_through_the_kernels_equals_the_plain_maths(monkeypatch, use, eps, fuse):
    monkeypatch.setattr(rows_ce, "FUSE_SOFTMAX", fuse)
    got, want = rows_tests._results(use, *float64_case(seed=6), eps,
                                    LossOptions(plan="rows", rows=4))  # fmt: skip
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("interpreted")
def test_the_tiles_products_are_padded_and_take_the_bias_as_a_column():
    """V = 23 classes, d = 6: the products' weight gets 41 zero rows (16-byte rows of logits
    for Hopper's GEMMs), the kernels read the first 23 columns (16-byte loads of all 64); the
    bias is a column of the products, ``[h | 1 | 0] [W | b | 0]^T``, so that no pass reads it
    (and none without a bias); the equality tests above run at this V."""
    hidden, weight, b, target = float64_case()
    d = weight.size(1)
    walk = rows_ce._Walk(hidden, weight, b, target, torch.float64, None, 1)
    assert walk.triton and walk.columns == 64 and walk.b is None
    assert walk.w.shape == (64, 8) and walk.h.shape == (hidden.size(0), 8)  # d + 1, to 8s
    assert torch.equal(walk.w[:23, :d], weight) and torch.equal(walk.w[:23, d], b)
    assert not walk.w[23:].any() and not walk.w[:, d + 1 :].any()
    assert torch.equal(walk.h[:, :d], hidden) and (walk.h[:, d] == 1).all()
    assert not walk.h[:, d + 1 :].any()
    plain = rows_ce._Walk(hidden, weight, None, target, torch.float64, None, 1)
    assert plain.w.shape == (64, d) and torch.equal(plain.h, hidden) and plain.b is None


@pytest.mark.usefixtures("interpreted")
def test_mixture_and_block_through_the_kernels_equal_the_plain_maths():
    use = rows_tests.USES["both"]
    case = rows_tests._mixture_case(seed=13)
    got, want = rows_tests._mixture_results(use, LossOptions(plan="rows", rows=6), case)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    got, want = rows_tests._block_results(use, 9, LossOptions(plan="rows", rows=4),
                                          *float64_case(seed=7))  # fmt: skip
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.gpu
def test_cuda_kernels_as_the_heads_launch_them():
    """bf16 logits padded to a multiple of 64 columns (V = 100,003: 16-byte loads, the rows
    plan's launch), the padding not counted; the fused form as a block of a larger softmax."""
    bf16 = {"rtol": 1e-2, "atol": 1e-2}
    _check_padding("cuda", torch.bfloat16, 100_003, True, rows=64, **bf16)
    _check_outside("cuda", torch.bfloat16, 100_003, **bf16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernels_equal_the_float64_maths(dtype):
    z, b, target, coefficients = _logits_case("cuda", dtype, rows=64, columns=100_003)
    # float32: sums of 100k terms in float32 (5e-6 relative measured on an H200)
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 3e-5, "atol": 1e-3}
    _check_kernels(z, b.float(), target, coefficients, **tol)
