"""app/allocator.py: glibc's malloc thresholds for CPU training."""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="the settings are glibc's",
)

# In a fresh process: hold a 20 MiB malloc block and report the bytes glibc mmapped for it.
PROBE = """
import ctypes
from app.allocator import tune_glibc_malloc
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
