"""The C softmax passes of the CPU losses (heads/native/softmax_rows.c) against torch."""

import shutil

import pytest
import torch

from heads import MixtapeHead
from heads.cross_entropy import EXP_FLOOR, add_exp_sums_, exp_shifted_rows_
from heads.native import softmax_rows_kernels

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
    reason="the native kernels are optional: this machine has no C compiler",
)


def torch_passes(z: torch.Tensor, top: torch.Tensor | None = None):
    """The PyTorch path written out: max, shift and floor in float32 as the kernel does them
    (exact but for the shift's rounding), then exp and sum in float64 for reference."""
    top = z.amax(-1) if top is None else top
    shifted = (z - top.unsqueeze(-1)).clamp(min=EXP_FLOOR).double()
    exps = shifted.exp()
    return exps, top.double(), exps.sum(-1)


@pytest.fixture
def native_only():
    assert softmax_rows_kernels() is not None  # the C path is the one under test


@pytest.mark.parametrize(
    "rows, cols, ld",
    [(1, 1, 1), (3, 7, 7), (5, 400, 416), (64, 2993, 3008), (9, 33_000, 33_000)],
    ids=["1x1", "odd", "padded-stride", "chunks", "long-rows"],
)
def test_exps_maxima_and_sums_equal_float64_math(native_only, rows, cols, ld):
    gen = torch.Generator().manual_seed(cols)
    storage = 20 * torch.randn(rows, ld, generator=gen)  # spread: many exps at the floor
    z = storage[:, :cols]
    expected = torch_passes(z)
    exps, top, normaliser = exp_shifted_rows_(z)
    assert exps.data_ptr() == storage.data_ptr()  # in place, the padding columns untouched
    torch.testing.assert_close(top, expected[1].float(), rtol=0, atol=0)
    torch.testing.assert_close(exps.double(), expected[0], rtol=3e-7, atol=0)  # ~2 ulp
    torch.testing.assert_close(normaliser.double(), expected[2], rtol=1e-6, atol=0)


def test_infinities_nan_and_the_floor_behave_as_torch(native_only):
    z = torch.tensor(
        [
            [0.0, -torch.inf, -1000.0, 5.0],  # -inf and far below: exp(EXP_FLOOR)
            [1.0, torch.nan, 2.0, 3.0],  # NaN: its exp and the sum are NaN
            [torch.inf, 0.0, 1.0, 2.0],  # +inf: inf - inf is NaN, as in torch
            [-3.0, -3.0, -3.0, -3.0],
        ]
    )
    exps, top, normaliser = exp_shifted_rows_(z.clone())
    ref_exps, ref_top, ref_sum = torch_passes(z)
    torch.testing.assert_close(normaliser.double(), ref_sum, equal_nan=True)
    assert torch.isnan(normaliser[1:3]).all()
    torch.testing.assert_close(exps[0].double(), ref_exps[0])
    assert exps[0, 1] == exps[0, 2]
    torch.testing.assert_close(exps[0, 1].double(), torch.tensor(EXP_FLOOR).double().exp())
    assert top[0] == 5.0 and top[3] == -3.0 and torch.isinf(top[2])


def test_blocks_with_a_shared_shift_accumulate_their_sums(native_only):
    gen = torch.Generator().manual_seed(5)
    blocks = [torch.randn(130, width, generator=gen) * 4 for width in (16, 1000, 3)]
    top = torch.stack([b.amax(1) for b in blocks]).amax(0)
    normaliser = torch.zeros(130)
    expected = sum(torch_passes(b, top)[2] for b in blocks)
    for b in blocks:
        add_exp_sums_(b, top, normaliser)
    torch.testing.assert_close(normaliser.double(), expected, rtol=1e-6, atol=0)


def test_several_threads_give_the_single_thread_result(native_only):
    z = torch.randn(300, 4000, generator=torch.Generator().manual_seed(6))  # above the
    threads = torch.get_num_threads()  # kernel's threshold for parallel rows
    try:
        torch.set_num_threads(1)
        one = exp_shifted_rows_(z.clone())
        torch.set_num_threads(max(2, threads))
        many = exp_shifted_rows_(z.clone())
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)  # rows are independent: bit for bit


def test_float32_losses_match_the_pytorch_path(native_only, monkeypatch):
    """Softmax-ending heads in float32: the same NLL and gradients with the C passes as
    without them (LM_HEADS_NATIVE=0), Mixtape's blocks included."""
    from heads import SoftmaxHead

    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(70, 24, generator=gen)
    target = torch.randint(0, 397, (70,), generator=gen)
    results = {}
    for native in ("1", "0"):
        monkeypatch.setenv("LM_HEADS_NATIVE", native)
        softmax_rows_kernels.cache_clear()
        assert (softmax_rows_kernels() is None) == (native == "0")
        for head_type in (SoftmaxHead, MixtapeHead):
            torch.manual_seed(0)
            head = head_type(24, 397).eval()
            h = hidden.clone().requires_grad_(True)
            out = head(h, target)
            grads = torch.autograd.grad(out.loss, [h, *head.parameters()])
            results[native, head_type] = (out.nll.detach(), *grads)
    softmax_rows_kernels.cache_clear()
    for head_type in (SoftmaxHead, MixtapeHead):
        for a, b in zip(results["1", head_type], results["0", head_type], strict=True):
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6)
