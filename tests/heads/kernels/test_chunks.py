"""``heads/kernels/chunks.py``'s products into a float32 accumulator."""

import pytest
import torch

from heads.kernels import chunks


@pytest.mark.parametrize("add", [False, True])
def test_half_precision_operands_into_float32(add, monkeypatch):
    """``out (+)= a b`` with bf16 operands and a float32 ``out``: equal to the product of the
    operands' values. Where the device refuses float32 products (this CPU, when told to try
    them), the product is rounded to bf16 first, once with a warning, and never tried again."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 300, generator=gen).bfloat16()
    b = torch.randn(300, 8, generator=gen).bfloat16()
    start = torch.randn(64, 8, generator=gen)
    exact = (a.double() @ b.double()) + (start.double() if add else 0)
    monkeypatch.setitem(chunks.FLOAT32_PRODUCTS, "cpu", True)
    monkeypatch.setitem(chunks.FLOAT32_PRODUCTS, "addmm", True)
    out = start.clone()
    with pytest.warns(UserWarning, match="float32 products of torch.bfloat16 operands refused"):
        chunks.accumulate_mm(out, a, b, add)
    assert chunks.FLOAT32_PRODUCTS["cpu"] is False
    assert chunks.FLOAT32_PRODUCTS["addmm"] is not add  # the in-place form tried first
    rounded = (a.double() @ b.double()).bfloat16().double() + (start.double() if add else 0)
    torch.testing.assert_close(out.double(), rounded, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.double(), exact, rtol=1e-2, atol=1e-1)
    out = start.clone()
    chunks.accumulate_mm(out, a, b, add)  # no second try, no warning
    torch.testing.assert_close(out.double(), rounded, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("add", [False, True])
def test_cuda_products_of_bf16_operands_are_float32(add):
    """On CUDA the product is written in float32 (cuBLAS's float32 accumulation kept): closer
    to the exact product than its rounding to bf16 can be; added in place where this torch
    takes a float32 accumulator (``FLOAT32_PRODUCTS["addmm"]`` says which form ran)."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(256, 4096, generator=gen).bfloat16().cuda()
    b = torch.randn(4096, 64, generator=gen).bfloat16().cuda()
    start = torch.randn(256, 64, generator=gen).cuda()
    exact = (a.double() @ b.double()) + (start.double() if add else 0)
    out = start.clone()
    chunks.accumulate_mm(out, a, b, add)
    assert chunks.FLOAT32_PRODUCTS["cuda"] is True
    error = (out.double() - exact).abs().max()
    rounding = ((a.double() @ b.double()).bfloat16().double() - (a.double() @ b.double())).abs()
    assert error < rounding.max() / 4, (error, rounding.max())


def test_a_span_of_all_rows_is_the_tensor_itself():
    """One tile: no slicing operator (the same tensor back); else the rows asked for."""
    x = torch.arange(12.0).view(6, 2)
    assert chunks.span_of(x, 0, 6) is x
    assert chunks.span_of(None, 0, 3) is None
    part = chunks.span_of(x, 2, 5)
    assert part.data_ptr() == x[2].data_ptr() and torch.equal(part, x[2:5])
    assert chunks.span_of(x, 0, 0).shape == (0, 2)
    whole = chunks.span_of(x, 0, 6, view=True)  # a slice all the same (a compiled body's)
    assert whole is not x and torch.equal(whole, x)


def test_a_gradient_as_its_input_is_reshaped_and_cast_only_where_it_differs():
    x = torch.zeros(2, 3, 4, dtype=torch.float16)
    same = torch.ones(2, 3, 4, dtype=torch.float16)
    assert chunks.as_input(same, x) is same
    flat = torch.arange(24.0).view(6, 4)
    got = chunks.as_input(flat, x)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, flat.view(2, 3, 4).half())
