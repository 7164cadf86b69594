"""The C softmax passes (heads/native/softmax_rows.c), as the CPU loss backend runs them
(heads/cpu_backend.py, ``CpuPasses``), against float64 math and the torch passes."""

import shutil

import pytest
import torch

from heads.cpu_backend import CpuPasses
from heads.fused_cross_entropy import _TORCH_CPU_PASSES, EXP_FLOOR
from heads.native import softmax_rows_kernels

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
    reason="the native kernels are optional: this machine has no C compiler",
)
PASSES = CpuPasses()


def reference(z: torch.Tensor, top: torch.Tensor | None = None):
    """Max, shift and floor in float32 as the kernel does them (exact but for the shift's
    rounding), then exp and sum in float64."""
    top = z.amax(-1) if top is None else top
    exps = (z - top.unsqueeze(-1)).clamp(min=EXP_FLOOR).double().exp()
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
    expected = reference(z)
    top, total = PASSES.exp_sum_(z)
    assert z.data_ptr() == storage.data_ptr()  # in place, the padding columns untouched
    torch.testing.assert_close(top, expected[1].float(), rtol=0, atol=0)
    torch.testing.assert_close(z.double(), expected[0], rtol=3e-7, atol=0)  # ~2 ulp
    torch.testing.assert_close(total.double(), expected[2], rtol=1e-6, atol=0)


def test_infinities_nan_and_the_floor_behave_as_torch(native_only):
    z = torch.tensor(
        [
            [0.0, -torch.inf, -1000.0, 5.0],  # -inf and far below: exp(EXP_FLOOR)
            [1.0, torch.nan, 2.0, 3.0],  # NaN: its exp and the sum are NaN
            [torch.inf, 0.0, 1.0, 2.0],  # +inf: inf - inf is NaN, as in torch
            [-3.0, -3.0, -3.0, -3.0],
        ]
    )
    ref_exps, _, ref_sum = reference(z)
    exps = z.clone()
    top, total = PASSES.exp_sum_(exps)
    torch.testing.assert_close(total.double(), ref_sum, equal_nan=True)
    assert torch.isnan(total[1:3]).all()
    torch.testing.assert_close(exps[0].double(), ref_exps[0])
    assert exps[0, 1] == exps[0, 2]
    torch.testing.assert_close(exps[0, 1].double(), torch.tensor(EXP_FLOOR).double().exp())
    assert top[0] == 5.0 and top[3] == -3.0 and torch.isinf(top[2])


def test_a_given_shift_matches_the_torch_pass(native_only):
    """``exp_shifted_`` (the backward's recomputed probabilities): the C pass against the
    torch pass, strided rows included."""
    gen = torch.Generator().manual_seed(5)
    storage = 6 * torch.randn(130, 1040, generator=gen)
    z = storage[:, :1000]
    shift = torch.logsumexp(z, 1)
    expected = _TORCH_CPU_PASSES.exp_shifted_(z.clone(), shift)
    got = PASSES.exp_shifted_(z, shift)
    assert got.data_ptr() == storage.data_ptr()
    torch.testing.assert_close(got, expected, rtol=3e-7, atol=1e-30)


def test_several_threads_give_the_single_thread_result(native_only):
    z = torch.randn(300, 4000, generator=torch.Generator().manual_seed(6))  # above the
    threads = torch.get_num_threads()  # kernel's threshold for parallel rows
    try:
        torch.set_num_threads(1)
        one = z.clone()
        one_stats = PASSES.exp_sum_(one)
        torch.set_num_threads(max(2, threads))
        many = z.clone()
        many_stats = PASSES.exp_sum_(many)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip((one, *one_stats), (many, *many_stats), strict=True):
        assert torch.equal(a, b)  # rows are independent: bit for bit
