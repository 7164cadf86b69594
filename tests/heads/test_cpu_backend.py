"""heads/cpu_backend.py: the opt-in CPU backend of the fused loss (aligned products, the C
passes' fallback) and glibc's malloc thresholds."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from heads import MixtapeHead, SoftmaxHead
from heads.cpu_backend import CpuPasses
from heads.fused_cross_entropy import LossOptions
from heads.native import softmax_rows_kernels

REPO = Path(__file__).resolve().parents[2]


def test_aligned_products_are_views_of_16_float_rows():
    hidden, weight, bias = torch.randn(70, 3), torch.randn(7, 3), torch.randn(7)
    logits = CpuPasses().logits(hidden, weight, bias, torch.float32)
    assert logits.shape == (70, 7) and logits.stride() == (16, 1)
    torch.testing.assert_close(logits, F.linear(hidden, weight, bias))
    few_rows = CpuPasses().logits(hidden[:20], weight, bias, torch.float32)
    assert few_rows.stride() == (7, 1)  # too few rows for the padded copy to pay


@pytest.mark.parametrize("native", ["1", "0"], ids=["c_passes", "torch_fallback"])
def test_heads_on_the_cpu_backend_equal_the_portable_path(native, monkeypatch):
    """Softmax and Mixtape (whose frequent blocks use the passes too) in float32: the same NLL
    and gradients on ``loss_backend: cpu`` as on the portable path, with the C passes and
    without them (``LM_HEADS_NATIVE=0``, no compiler)."""
    monkeypatch.setenv("LM_HEADS_NATIVE", native)
    softmax_rows_kernels.cache_clear()
    try:
        assert (softmax_rows_kernels() is None) == (native == "0")
        gen = torch.Generator().manual_seed(7)
        hidden = torch.randn(70, 24, generator=gen)
        target = torch.randint(0, 397, (70,), generator=gen)
        for head_type in (SoftmaxHead, MixtapeHead):
            results = []
            for backend in ("torch", "cpu"):
                torch.manual_seed(0)
                head = head_type(24, 397).eval()
                head.loss_options = LossOptions(backend=backend, columns=64, saved_bytes=0)
                h = hidden.clone().requires_grad_(True)
                out = head(h, target, label_smoothing=0.1)
                grads = torch.autograd.grad(out.loss, [h, *head.parameters()])
                results.append((out.nll.detach(), *grads))
            for a, b in zip(*results, strict=True):
                torch.testing.assert_close(b, a, rtol=2e-5, atol=1e-6)
    finally:
        softmax_rows_kernels.cache_clear()


glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="the settings are glibc's",
)

# In a fresh process: hold a 20 MiB malloc block and report the bytes glibc mmapped for it.
PROBE = """
import ctypes
from heads.cpu_backend import tune_glibc_malloc
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
applied = tune_glibc_malloc()
before = libc.mallinfo2().hblkhd
block = libc.malloc(20 * 2**20)
print(applied, libc.mallinfo2().hblkhd - before)
"""


def probe(tuning: str) -> tuple[bool, int]:
    env = {**os.environ, "LM_HEADS_MALLOC_TUNING": tuning, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.split()  # fmt: skip
    return out[0] == "True", int(out[1])


@glibc
def test_tuned_malloc_keeps_a_20_mib_block_on_the_heap():
    applied, mmapped = probe("1")
    assert applied and mmapped == 0  # reused from the heap step after step


@glibc
def test_switched_off_glibc_mmaps_it_as_by_default():
    applied, mmapped = probe("0")
    assert not applied and mmapped >= 20 * 2**20  # a fresh mapping, faulted in page by page
