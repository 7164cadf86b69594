"""The opt-in CPU backend of the fused loss (``loss_backend: cpu``): CPU-only speed code, kept
in one place and never run on a GPU or under ``torch.compile``.

It runs the portable algorithm of ``heads/fused_cross_entropy.py`` with two CPU refinements,
each kept because the benchmark measures it faster than the portable path on this project's
CPUs (README, "Output-layer benchmark"):

- the row passes in C (``heads/native/softmax_rows.c``): maximum, floored exp and sum in one
  read and one write per row, instead of five eager passes over the chunk;
- products with 16-float aligned output rows: MKL's sgemm runs 25-35% slower when a row's
  length is not a multiple of 16 floats, and adaptive cut-offs and vocabularies rarely are.

and, for the whole process, glibc malloc thresholds that keep a training step's large
temporaries on the heap (:func:`tune_glibc_malloc`), applied by the task when this backend is
chosen for a CPU run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from functools import cache

import torch

from heads.fused_cross_entropy import EXP_FLOOR, RowPasses, as_matrix
from heads.native import SoftmaxRowsKernels, softmax_rows_kernels

log = logging.getLogger(__name__)

ROW_ALIGN = 16
# the padded copy of W costs C d against the product's N C d: worth it from this many rows
_MIN_ROWS_TO_PAD = 64


def _native(tensor: torch.Tensor) -> SoftmaxRowsKernels | None:
    """The C passes where they apply: float32 on the CPU, unit column stride."""
    if tensor.device.type != "cpu" or tensor.dtype != torch.float32 or tensor.dim() != 2:
        return None
    if tensor.size(0) == 0 or (tensor.stride(1) != 1 and tensor.size(1) > 1):
        return None
    return softmax_rows_kernels()


class CpuPasses(RowPasses):
    """:class:`RowPasses` with aligned products and the C softmax passes."""

    floor = EXP_FLOOR

    def logits(self, hidden, weight, bias, accumulate, buffer=None):
        classes = weight.size(0)
        pad = -classes % ROW_ALIGN
        if pad == 0 or hidden.size(0) < _MIN_ROWS_TO_PAD or hidden.dtype != accumulate:
            return super().logits(hidden, weight, bias, accumulate, buffer)
        # [R, C'] with C' a multiple of 16, returned as the view of its first C columns: the
        # passes and the backward's products read it through its aligned row stride
        padded = torch.nn.functional.pad(weight.to(hidden.dtype), (0, 0, 0, pad))
        if buffer is None:
            out = hidden.new_empty(hidden.size(0), classes + pad)
        else:
            out = as_matrix(buffer, hidden.size(0), classes + pad)
        if bias is None:
            torch.mm(hidden, padded.t(), out=out)
        else:
            torch.addmm(torch.nn.functional.pad(bias, (0, pad)), hidden, padded.t(), out=out)
        return out[:, :classes]

    def exp_sum_(self, z):
        kernels = _native(z)
        if kernels is None:
            return super().exp_sum_(z)
        n, c = z.shape
        top, total = z.new_empty(n), z.new_empty(n)
        kernels.softmax_rows(
            z.data_ptr(), n, c, z.stride(0), EXP_FLOOR, top.data_ptr(), total.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return top, total

    def exp_shifted_(self, z, shift):
        kernels = _native(z)
        if kernels is None or not shift.is_contiguous() or shift.dtype != torch.float32:
            return super().exp_shifted_(z, shift)
        n, c = z.shape
        sums = z.new_zeros(n)  # the kernel also sums the rows; unused here
        kernels.exp_shifted_rows(
            z.data_ptr(), n, c, z.stride(0), shift.data_ptr(), EXP_FLOOR, sums.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return z


@cache
def cpu_passes() -> CpuPasses:
    return CpuPasses()


# -- glibc malloc --------------------------------------------------------------------------
# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more than HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit
TRIM_THRESHOLD = 2**30


def tune_glibc_malloc() -> bool:
    """Fixed glibc malloc thresholds for CPU training; False where not applied (not glibc, or
    ``LM_HEADS_MALLOC_TUNING=0``).

    glibc serves large allocations with mmap and, by default, moves that threshold as memory
    is freed. A training step allocates and frees the same tens of MiB every time: wherever the
    moving threshold lands, some of them come back as fresh pages each step, and touching a
    fresh page costs a fault (about 0.55 ms per MiB on the 2-core CPU). A fixed threshold at
    glibc's maximum (32 MiB) and a trim threshold of 1 GiB keep those tensors on the heap,
    reused from step to step, at the cost of holding up to 1 GiB of freed memory for reuse.
    """
    if os.environ.get("LM_HEADS_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    applied = applied and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not applied:
        log.info("glibc refused the malloc thresholds; keeping its defaults")
    return applied
