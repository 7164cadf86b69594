"""Small C kernels for the latency-bound inference paths, compiled at first use.

Only the batch-1 DS-Softmax top-k lives here (``ds_topk.c``): at batch 1 its arithmetic takes
a few microseconds and eager PyTorch's per-call overhead dominates. The shared library is
built with the system C compiler (``$CC``, else ``cc``/``gcc``) into a per-user cache keyed by
the source, the flags and the CPU, and loaded with ctypes, so no PyTorch headers are compiled.

Everything here is optional: without a compiler, on a build error, or with
``LM_HEADS_NATIVE=0`` in the environment, :func:`ds_topk_kernel` returns ``None`` and the
caller keeps its PyTorch path (same results, tested to agree).
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
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("ds_topk.c")
# Re-association lets the dot products vectorise; no -ffast-math, so -inf and NaN keep their
# meaning (the kernel starts its running maximum at -inf).
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


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "lm_heads" / "native"


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: several processes (DDP ranks) may race here
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        os.replace(built, target)


@cache
def ds_topk_kernel() -> ctypes._CFuncPtr | None:
    """``ds_topk_one`` from ``ds_topk.c`` (signature there), or ``None`` when unavailable."""
    if os.environ.get("LM_HEADS_NATIVE", "1") == "0":
        return None
    compiler = next(
        (c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None
    )
    if compiler is None:
        log.info("no C compiler found: DS-Softmax batch-1 top-k stays in PyTorch")
        return None
    key = hashlib.sha256(
        "\0".join([_SOURCE.read_text(), compiler, *_FLAGS, _cpu_id()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"ds_topk_{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("DS-Softmax native top-k not built (%s); using PyTorch", detail)
        return None
    kernel = library.ds_topk_one
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    kernel.argtypes = [ptr, i64, ptr, i64, ptr, i64, ctypes.c_int32, ptr, ptr, i64, i64, ptr, ptr]
    kernel.restype = i64
    return kernel
