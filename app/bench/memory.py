"""Extra peak memory of one training step, measured (not estimated).

CUDA: the caching allocator's peak above what was allocated before the step.

CPU: the process's peak resident set (RSS) during the step above its RSS just before it:
everything the step touches, the gradients, the C kernels' and MKL's buffers and the
allocator's slack included, which is what an out-of-memory kill counts. On Linux the kernel's
high-water mark is reset before the step (``/proc/self/clear_refs``) and glibc hands its freed
memory back (``malloc_trim``) so that no step inherits another's peak or reuses memory another
one freed. Where the mark cannot be reset, the step runs in a fresh child process and its
lifetime peak (``getrusage``) is read there instead.

A CPU step is measured apart from the timed ones (``measure_apart``): in one worker process
whose glibc gives every block of 128 KiB or more its own mapping. glibc otherwise raises that
threshold to the largest block freed so far (up to 32 MiB), after which such blocks come from
its heap, whose holes depend on what ran before: the same MoS step (V = 10k, d = 200, 2,048
tokens) read 153, 175 or 229 MiB after softmax, alone, or after Mixtape, and 134 MiB in every
order with the threshold fixed. The timed steps keep glibc's default, as a training run has it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import ctypes.util
import functools
import gc
import multiprocessing
import re
import resource
import sys
from collections.abc import Callable
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def extra_peak_bytes(step: Callable[[], object], device: torch.device, clear=None) -> int:
    """Peak bytes during ``step()`` above the memory in use just before it (module docstring).
    ``clear()`` drops what the previous step left (its gradients) before the baseline."""
    if clear is not None:
        clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    if not can_reset_peak_rss():
        raise RuntimeError("resetting the peak RSS needs Linux; use measure_in_child")
    _trim()
    before = _status_kib("VmRSS")
    _CLEAR_REFS.write_text("5")  # the high-water mark restarts at the current RSS
    step()
    return max(0, (_status_kib("VmHWM") - before) * 1024)


def can_reset_peak_rss() -> bool:
    if not sys.platform.startswith("linux") or not _STATUS.exists():
        return False
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


def _trim() -> None:
    """glibc's freed memory back to the system (a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fix_mmap_threshold(size: int = 128 * 1024) -> bool:
    """glibc: every allocation of ``size`` bytes or more mapped on its own and unmapped when
    freed, from now on (setting it turns off glibc's raising of the threshold, module
    docstring). False where this is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, size))
    except (OSError, AttributeError):
        return False


def measure_apart(build: Callable[[], Callable[[], object]]) -> int:
    """Extra peak RSS of the step ``build()`` returns, after one warm-up step, measured in the
    memory worker (module docstring): one spawned process kept for the whole run, so that
    what the timed subjects left in this process's heap does not count. Where the peak cannot
    be reset (not Linux), the first step in a fresh process (``measure_in_child``). ``build``
    must be picklable (a module-level function or a ``functools.partial`` of one)."""
    if not can_reset_peak_rss():
        return measure_in_child(build)
    return _memory_worker().submit(_warm_step_peak, build).result()


@functools.cache
def _memory_worker() -> concurrent.futures.ProcessPoolExecutor:
    context = multiprocessing.get_context("spawn")  # no forked OpenMP threads
    worker = concurrent.futures.ProcessPoolExecutor(
        1, mp_context=context, initializer=fix_mmap_threshold
    )
    atexit.register(worker.shutdown)
    return worker


def _warm_step_peak(build: Callable[[], Callable[[], object]]) -> int:
    step = build()
    step()  # warm: lazy initialisation and compilation are not the step's memory
    return extra_peak_bytes(step, torch.device("cpu"), clear=getattr(step, "clear", None))


def measure_in_child(build: Callable[[], Callable[[], object]]) -> int:
    """Extra peak RSS of the first step of ``build()`` in a fresh process (the portable
    fallback): the child's lifetime peak after the step, above its RSS before it. ``build``
    must be picklable (a module-level function or a ``functools.partial`` of one)."""
    context = multiprocessing.get_context("spawn")  # no forked OpenMP threads
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        return pool.submit(_child_first_step, build).result()


def _child_first_step(build: Callable[[], Callable[[], object]]) -> int:
    step = build()
    gc.collect()
    _trim()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return max(0, (peak - before) * scale)
