"""Timing shared by the benchmarks: the clocks, a device sync, one timed call."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from scipy.stats import quantile_test

# wall: elapsed time. cpu: this process's CPU time (its threads summed), which other jobs on
# a shared machine barely disturb; on a GPU only wall time means anything.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously); a no-op elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_compile_workers() -> None:
    """Shut Inductor's compile worker processes down (where a subject compiled: its warm-up
    ran), so that none runs beside the timed steps; a later compile starts them again. On an
    H100 (2026-11-27) the adaptive softmax's eager, host-bound steps ran 5x slower on the host
    in a process that had compiled another subject, PyTorch's layer (its host waiting on the
    GPU anyway) unchanged: the timed rows record the host's other work
    (``app.machine.host_use``)."""
    module = sys.modules.get("torch._inductor.async_compile")
    if module is not None and hasattr(module, "shutdown_compile_workers"):
        module.shutdown_compile_workers()


def time_once(
    step: Callable[[], object], device: torch.device, clock=time.perf_counter, steps: int = 1
) -> float:
    """Seconds a ``step()`` on ``clock``: ``steps`` of them back to back, the device synced
    before the first and after the last only (as a training loop runs them: the host queues
    the next step while the device runs this one, so a step's host work before its first
    kernel is hidden where the device is the slower), their mean."""
    sync(device)
    start = clock()
    for _ in range(steps):
        step()
    sync(device)
    return (clock() - start) / steps


def check_clock(parser: argparse.ArgumentParser, clock: str, device: str) -> None:
    """``--clock cpu`` on a GPU device: a parser error (CPU time misses the GPU's work)."""
    if clock == "cpu" and device.startswith("cuda"):
        parser.error("--clock cpu measures the host only: use --clock wall on a GPU")


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """A parser error for a device this machine has not got (one line, not a traceback)."""
    try:
        kind = torch.device(device).type
    except RuntimeError as error:
        parser.error(f"--device {device}: {error}")
    if kind == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: no CUDA device here (torch {torch.__version__})")


def paired_ratio(
    numerators: Sequence[float], denominators: Sequence[float]
) -> tuple[float, float, float]:
    """The median of ``numerators[i] / denominators[i]`` (times measured side by side, in the
    same round) and its distribution-free 95% confidence interval from order statistics
    (``scipy.stats.quantile_test``; nan bounds below 6 pairs; at 6 and 7 the interval is the
    ratios' range, its coverage 96.9% and 98.4%)."""
    ratios = np.asarray(numerators, dtype=float) / np.asarray(denominators, dtype=float)
    median = float(np.median(ratios))
    interval = quantile_test(ratios, q=median, p=0.5).confidence_interval(0.95)
    return median, float(interval.low), float(interval.high)


def interval_text(low: float, high: float) -> str:
    """``1.62-1.71``, or ``-`` where there is no interval."""
    return "-" if math.isnan(low) or math.isnan(high) else f"{low:.2f}-{high:.2f}"
