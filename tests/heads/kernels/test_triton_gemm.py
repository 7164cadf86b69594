"""The fused products (heads/kernels/triton_gemm.py): each kernel against the float64 maths
written plainly here (rows and blocks of ``-inf``, targets outside ``[0, V)``, padding
columns, bias or none, the ``dz W`` product split or not, ``dz^T h`` added to what is there),
and the rows plan through them (softmax, mixture, block; the NLL output differentiated too:
float64 equality with the plain maths). On a CPU under Triton's interpreter where Triton is
installed (an optional GPU extra), in small tiles so that a row has several blocks; on CUDA
in the ``gpu`` tests, in bf16, as the heads launch them."""

import math

import pytest
import torch

import heads.kernels.rows_ce as rows_ce
import heads.kernels.triton_gemm as triton_gemm
from heads.fused_cross_entropy import LossOptions, mean_cross_entropy
from heads.kernels.triton_gemm import GemmLaunch, gradients, logits_blocks
from tests.heads.kernels import test_rows_ce as rows_tests
from tests.heads.kernels.cases import float64_case

pytestmark = pytest.mark.usefixtures("one_thread")
# tiles the interpreter runs quickly, several a row, the gradient products' steps and tiles
# half a block (tl.dot takes 16 at least)
SMALL = GemmLaunch(block_m=16, block_n=32, block_k=16, hidden_block_m=16, hidden_block_d=16,
                   hidden_step=16, weight_block_c=16, weight_block_d=16, block_r=16)  # fmt: skip


@pytest.fixture
def interpreted(monkeypatch):
    """The kernels through Triton's interpreter in small tiles, and the rows plan's Triton
    tiles by them where asked for (``fused_products``; float64 too)."""
    pytest.importorskip("triton", reason="Triton is an optional GPU extra (requirements-gpu.txt)")
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without CUDA
        pytest.skip("with CUDA, the gpu tests run the kernels on the device")
    monkeypatch.setattr(triton_gemm, "GEMM_LAUNCH", SMALL)
    monkeypatch.setattr(rows_ce, "TRITON_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(rows_ce, "TRITON_DTYPES", (*rows_ce.TRITON_DTYPES, torch.float64))
    monkeypatch.setattr(rows_ce, "FUSED_DTYPES", (*rows_ce.FUSED_DTYPES, torch.float64))


def _case(device="cpu", dtype=torch.float64, rows=37, v=150, width=192, d=20, seed=0):
    """``h``, ``w`` (``v`` rows, then zero rows to ``width``), a bias with a masked span
    (``-inf``), targets at both ends, inside the masked span, ignored and in the padding, and
    the per-row coefficients."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, d, generator=gen, dtype=torch.float64)
    w = torch.zeros(width, d, dtype=torch.float64)
    w[:v] = torch.randn(v, d, generator=gen, dtype=torch.float64)
    bias = torch.randn(v, generator=gen, dtype=torch.float64)
    target = torch.randint(0, v, (rows,), generator=gen)
    target[:6] = torch.tensor([0, v - 1, 40, -1, v + 3, 33])
    coefficients = [torch.rand(rows, generator=gen, dtype=torch.float64) for _ in range(3)]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (h.to(device, dtype), w.to(device, dtype), bias.to(device, acc), target.to(device),
            [c.to(device, acc) for c in coefficients])  # fmt: skip


def _reference(h, w, bias, target, v, scale, onehot, uniform):
    """``(lse, z_target, sum z, dz)`` over the first ``v`` columns, in float64, plainly."""
    z = h.double() @ w[:v].double().t() + (0 if bias is None else bias.double())
    lse = torch.logsumexp(z, 1)
    inside = (target >= 0) & (target < v)
    picked = torch.where(inside, z.gather(1, target.clamp(0, v - 1)[:, None])[:, 0], 0)
    p = torch.where(lse[:, None] == -math.inf, 0.0, torch.exp(z - lse[:, None]))
    hit = torch.arange(v, device=z.device)[None, :] == target[:, None]
    dz = scale.double()[:, None] * p - torch.where(hit, onehot.double()[:, None], 0.0)
    return lse, picked, z.sum(1), dz - uniform.double()[:, None]


def _close(got, want, norm=None, **close):
    """Equal within ``close`` (assert_close's), or with ``norm``: in norm, relative (bf16
    gradients: most entries far below any absolute tolerance that the largest would pass)."""
    if norm is None:
        torch.testing.assert_close(got, want, **close)
    else:
        assert (got - want).norm() <= norm * want.norm(), ((got - want).norm(), want.norm())


def _check(h, w, bias, target, coefficients, v, sums=True, norm=None, **close):
    scale, onehot, uniform = coefficients
    lse, picked, total, dz = _reference(h, w, bias, target, v, scale, onehot, uniform)
    blocks = logits_blocks(h, w, bias, target, v, True, acc=scale.dtype)
    torch.testing.assert_close(blocks.lse.double(), lse, **close)
    finite = picked != -math.inf  # a target in the masked span: -inf either way
    assert (blocks.picked[~finite] == -math.inf).all()
    torch.testing.assert_close(blocks.picked[finite].double(), picked[finite], **close)
    if sums:
        torch.testing.assert_close(blocks.logit_sum.double(), total, **close)
    width, d = w.shape
    dh = torch.empty_like(h, dtype=scale.dtype)
    dw = torch.full((width, d), 0.5, dtype=scale.dtype, device=h.device)
    db = torch.full((width,), 0.25, dtype=scale.dtype, device=h.device)
    gradients(blocks, h, w, target, v, scale, onehot, uniform, dh, dw, db, accumulate=True)
    _close(dh.double(), dz @ w[:v].double(), norm, **close)
    _close(dw[:v].double() - 0.5, dz.t() @ h.double(), norm, **close)
    _close(db[:v].double() - 0.25, dz.sum(0), norm, **close)
    assert (dw[v:] == 0.5).all() and (db[v:] == 0.25).all()  # the padding's gradient is 0
    return blocks


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("bias", ["bias", "masked_bias", "none"])
def test_kernels_equal_the_float64_maths(bias):
    h, w, b, target, coefficients = _case()
    if bias == "masked_bias":
        b[30:100] = -math.inf  # DS-Softmax's pruned columns, say; targets 33 and 40 there
    _check(h, w, None if bias == "none" else b, target, coefficients, 150,
           sums=bias != "masked_bias")  # fmt: skip


@pytest.mark.usefixtures("interpreted")
def test_dz_h_product_over_several_blocks_a_tile_is_the_same(monkeypatch):
    """``dz^T h``'s column tiles may span whole blocks of the forward's statistics (each
    block's factor over its own columns): the same product, the blocks at the edge of ``C``
    included."""
    import dataclasses

    wide = dataclasses.replace(SMALL, weight_block_c=64)  # two blocks of 32 a tile
    monkeypatch.setattr(triton_gemm, "GEMM_LAUNCH", wide)
    h, w, b, target, coefficients = _case(width=160)  # 5 blocks: the last tile half outside
    _check(h, w, b, target, coefficients, 150)
    with pytest.raises(ValueError, match="must divide block_n"):
        dataclasses.replace(SMALL, weight_block_c=48)  # neither divides the other


@pytest.mark.usefixtures("interpreted")
def test_rows_and_blocks_of_minus_inf_give_no_nan():
    """A row whose every logit is ``-inf`` has ``lse = -inf`` and ``p = 0``; a block of
    ``-inf`` in a finite row adds nothing (``exp(-inf - -inf)`` would be NaN)."""
    h, w, b, target, (scale, onehot, uniform) = _case(rows=20)
    b[:] = -math.inf
    b[:32] = 0.0  # the first block alone is finite...
    h[3] = 0.0
    b_rows = b.clone()
    blocks = logits_blocks(h, w, b_rows, target, 150, False, acc=torch.float64)
    assert torch.isfinite(blocks.lse).all()
    _check(h, w, b, target, (scale, onehot, uniform), 150, sums=False)
    b[:] = -math.inf  # ...and then none: every row's lse is -inf
    blocks = logits_blocks(h, w, b, target, 150, False, acc=torch.float64)
    assert (blocks.lse == -math.inf).all()
    dh, dw = torch.empty_like(h), torch.zeros_like(w)
    gradients(blocks, h, w, target, 150, scale, onehot, uniform, dh, dw, None, False)
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()
    _, _, _, dz = _reference(h, w, b, target, 150, scale, onehot, uniform)
    torch.testing.assert_close(dh, dz @ w[:150])


@pytest.mark.usefixtures("interpreted")
def test_dz_w_split_over_column_blocks_adds_up_to_the_same(monkeypatch):
    """Few row tiles: ``dz W``'s column blocks split over more programs (as on a GPU with
    more SMs than tiles), the splits summed in a fixed order."""
    h, w, b, target, coefficients = _case()
    monkeypatch.setattr(triton_gemm, "_INTERPRETED_SMS", 16)
    assert triton_gemm._splits(37, 20, 12, h.device, SMALL) > 1  # 192 columns, 16 a step
    _check(h, w, b, target, coefficients, 150)


def test_gradient_steps_must_divide_the_forwards_blocks():
    with pytest.raises(ValueError, match="must divide block_n"):
        GemmLaunch(block_n=64, hidden_step=128)


@pytest.mark.usefixtures("interpreted")
def test_a_bad_layout_is_refused_in_one_line():
    h, w, b, target, _ = _case()
    with pytest.raises(ValueError, match="unit column strides"):
        logits_blocks(h, w.t().contiguous().t(), b, target, 150, False)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize("use", rows_tests.USES.values(), ids=rows_tests.USES.keys())
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
def test_rows_plan_through_the_fused_products_equals_the_plain_maths(use, eps, bias):
    case = float64_case(rows=40, classes=150, dim=20, seed=3, bias=bias)
    walk = rows_ce._Walk(*case[:4], torch.float64, None, 1, fused=True)
    assert walk.fused and walk.columns == 192 and walk.w.shape == (192, 20)  # no bias column
    assert not rows_ce._Walk(*case[:4], torch.float64, None, 1).fused  # opt-in
    options = LossOptions(plan="rows", rows=16, fused_products=True)
    got, want = rows_tests._results(use, *case, eps, options)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("interpreted")
def test_mixture_and_block_through_the_fused_products_equal_the_plain_maths():
    use = rows_tests.USES["both"]
    case = rows_tests._mixture_case(tokens=9, classes=70, dim=17, seed=13)
    fused = LossOptions(plan="rows", rows=12, fused_products=True)
    got, want = rows_tests._mixture_results(use, fused, case)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    case = float64_case(rows=30, classes=150, dim=20, seed=7)
    options = LossOptions(plan="rows", rows=16, fused_products=True)
    got, want = rows_tests._block_results(use, 40, options, *case)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("interpreted")
@pytest.mark.parametrize(
    "head", ["softmax-projection", "mos-one_chunk", "mixtape-shared_gates", "adaptive-two_clusters"]
)
def test_heads_asking_for_the_fused_products_run_them_and_match_the_reference(monkeypatch, head):
    """``loss_backend: fused`` reaches the tiles of every head whose rows plan has them
    (softmax's and MoS's tiles, Mixtape's rare block, the adaptive softmax's classifiers; the
    DS experts' losses take the column plan): the kernels run, and the loss, NLL and
    gradients equal the float64 formula at the contract's edges."""
    from functools import partial

    from tests.heads.contract import HEADS, check_loss_matches_reference, run_check

    calls = []
    real = rows_ce.logits_blocks

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(rows_ce, "logits_blocks", counted)
    import heads.kernels.mixtape_rows as mixtape_rows

    monkeypatch.setattr(mixtape_rows, "logits_blocks", counted)
    options = (LossOptions(plan="rows", rows=4, fused_products=True),)
    run_check(partial(check_loss_matches_reference, options=options, inference=False),
              HEADS[head])  # fmt: skip
    assert calls


@pytest.mark.gpu
def test_cuda_kernels_as_the_heads_launch_them():
    """bf16 operands, V = 100,003 padded to 64 columns, the default tiles: the statistics
    against float64 from the same bf16 operands, the gradients within bf16's rounding of
    ``dz`` (the products take it in bf16, as the cuBLAS tiles do)."""
    h, w, b, target, coefficients = _case("cuda", torch.bfloat16, rows=300, v=100_003,
                                          width=100_032, d=512)  # fmt: skip
    h, w = h / 8, w / 8  # logits of a few units, as a trained head's
    _check(h, w, b, target, coefficients, 100_003, norm=2e-2, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["softmax", "mos"])
def test_cuda_rows_plan_with_fused_products_matches_the_cublas_tiles(monkeypatch, name):
    """The rows plan's loss and gradients in bf16 with and without the fused products, at a
    size that takes several tiles: equal within bf16's rounding (each gradient's error in
    norm, relative: its entries span many magnitudes)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = 1 if name == "softmax" else 3
    tokens, v, d = 1024, 50_000, 256
    hidden = torch.randn(tokens * k, d, device="cuda", generator=gen).div(4).requires_grad_()
    weight = torch.randn(v, d, device="cuda", generator=gen).div(4).requires_grad_()
    bias = torch.randn(v, device="cuda", generator=gen).requires_grad_()
    target = torch.randint(0, v, (tokens,), device="cuda", generator=gen)
    log_prior = torch.randn(tokens, k, device="cuda", generator=gen).log_softmax(-1)
    results = []
    for fused in (False, True):
        options = LossOptions(plan="rows", rows=256, fused_products=fused)
        with torch.autocast("cuda", torch.bfloat16):
            out = mean_cross_entropy(hidden, weight, bias, target,
                                     log_prior=log_prior if k > 1 else None,
                                     options=options)  # fmt: skip
        results.append([out.loss, *torch.autograd.grad(out.loss, (hidden, weight, bias))])
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-2, atol=0)  # the loss
    for cublas, fused in zip(results[0][1:], results[1][1:], strict=True):  # the gradients
        error = (fused.double() - cublas.double()).norm() / cublas.double().norm()
        assert error < 2e-2, error.item()
