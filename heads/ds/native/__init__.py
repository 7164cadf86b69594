"""Small C kernels for the paths where eager PyTorch's overhead, not arithmetic, sets the time.

- ``ds_topk.c``: the DS-Softmax top-k, one query or a batch sorted by expert (with the SVD
  preview of large experts). At batch 1 its arithmetic takes a few microseconds, where eager
  PyTorch's per-call overhead would dominate.

Each shared library is built with the system C compiler (``$CC``, else ``cc``/``gcc``) into
``native/`` below the project's cache root (``heads/user_cache.py``), keyed by the source, the
flags and the CPU, and loaded with ctypes, so no PyTorch headers are compiled.

Everything here is optional. Without a compiler, on a build error, or with
``OUTPUT_HEADS_NATIVE=0`` in the environment, the functions below return ``None`` and the callers
keep their PyTorch paths (same results, tested to agree).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from heads.user_cache import cache_root

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
# Re-association lets the reductions vectorise; no -ffast-math, so -inf and NaN keep their
# meaning (the kernels start their running maxima at -inf and pass NaN on).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
]


def _cpu_id() -> str:
    """Model and flags of this CPU: ``-march=native`` code must not run on another one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


def _build(compiler: str, flags: list[str], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: several processes (DDP ranks) may race here
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, str(source), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(built, target)


def _library(stem: str, extra_flags: tuple[str, ...], what: str) -> ctypes.CDLL | None:
    """``<stem>.c`` built (once per source, flags and CPU) and loaded, or ``None``."""
    if os.environ.get("OUTPUT_HEADS_NATIVE", "1") == "0":
        return None
    compiler = next(
        (c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None
    )
    if compiler is None:
        log.info("no C compiler found: %s stays in PyTorch", what)
        return None
    source, flags = _HERE / f"{stem}.c", [*_FLAGS, *extra_flags]
    key = hashlib.sha256(
        "\0".join([source.read_text(), compiler, *flags, _cpu_id()]).encode()
    ).hexdigest()[:16]
    target = cache_root("native") / f"{stem}_{key}.so"
    try:
        if not target.exists():
            _build(compiler, flags, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("%s: native kernel not built (%s); using PyTorch", what, detail)
        return None


class DSPlan(ctypes.Structure):
    """``ds_plan`` of ``ds_topk.c``: a DS head's structure, described once, passed by address."""

    _fields_ = [
        ("d", ctypes.c_int64),
        ("n_experts", ctypes.c_int64),
        ("row_stride", ctypes.c_int64),
        ("has_bias", ctypes.c_int64),
        ("max_rows", ctypes.c_int64),
        ("gate", ctypes.c_void_p),
        ("weight", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("row_class", ctypes.c_void_p),
        ("preview_rank", ctypes.c_void_p),
        ("candidates", ctypes.c_void_p),
        ("basis_offsets", ctypes.c_void_p),
        ("preview_offsets", ctypes.c_void_p),
        ("basis", ctypes.c_void_p),
        ("preview", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class DSTopkKernels:
    """``ds_topk_one``, ``ds_topk_batch`` and ``ds_topk_profile`` from ``ds_topk.c``
    (signatures there)."""

    one: ctypes._CFuncPtr
    batch: ctypes._CFuncPtr
    profile: ctypes._CFuncPtr


@cache
def ds_topk_kernels() -> DSTopkKernels | None:
    """The DS-Softmax top-k kernels, or ``None`` when unavailable. OpenMP (batches with more
    than one thread): PyTorch has loaded its ``libgomp.so.1`` already, so the library shares
    that runtime and its threads."""
    library = _library("ds_topk", ("-fopenmp",), "DS-Softmax top-k")
    if library is None:
        return None
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    one = library.ds_topk_one
    one.argtypes = [ptr, ptr, i64, ptr, ptr]
    one.restype = i64
    batch = library.ds_topk_batch
    batch.argtypes = [ptr, ptr, i64, i64, i64, ptr, ptr, i32]
    batch.restype = i64
    profile = library.ds_topk_profile
    profile.argtypes = [ptr, ptr, i64, i64, ptr, ptr, ptr]
    profile.restype = i64
    return DSTopkKernels(one, batch, profile)
