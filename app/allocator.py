"""glibc malloc settings for CPU training, applied by the entry points (cli.py, app.bench).

glibc serves large allocations with mmap and, by default, moves that threshold as memory is
freed. A training step allocates and frees the same tens of MiB every time: wherever the
moving threshold lands, some of them come back as fresh pages each step, and touching a fresh
page costs a fault (about 0.55 ms per MiB here). Measured on the 2-core CPU: PTB Mixtape
training 6.6 -> 7.5 it/s, and the Mixtape LM benchmark step from 232 (or 202, run to run) to
a steady 200 ms. A fixed threshold at glibc's maximum (32 MiB) and a trim threshold of 1 GiB
keep those tensors on the heap, reused from step to step, at the cost of holding up to 1 GiB
of freed memory for reuse. ``LM_HEADS_MALLOC_TUNING=0`` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more than HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit
TRIM_THRESHOLD = 2**30


def tune_glibc_malloc() -> bool:
    """Apply the settings above; False where not applied (not glibc, or switched off)."""
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
