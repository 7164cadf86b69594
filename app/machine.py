"""Facts about the machine that benchmarks and studies record beside their numbers."""

from __future__ import annotations

import os
import time


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (2 decimals), or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # AttributeError: no os.getloadavg (Windows)
        return None


def _child_pids(pid: int) -> list[int]:
    """The live processes descended from ``pid`` (Linux's /proc; empty elsewhere)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _cpu_seconds_of(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (0 where it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # after the name: state is field 3, utime and stime are fields 14 and 15 (proc(5))
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def host_use() -> dict[str, float | None]:
    """A snapshot of the host's work: ``wall_s`` (a monotonic clock), ``process_cpu_s`` (this
    process, every thread), ``children_cpu_s`` (its live descendants, e.g. Inductor's compile
    workers; None where the OS has no /proc). :func:`host_use_between` of two snapshots says
    what ran on the host beside a timed section."""
    own = os.times()
    children = None
    if os.path.isdir("/proc/self/task"):
        children = sum(_cpu_seconds_of(pid) for pid in _child_pids(os.getpid()))
    return {"wall_s": time.monotonic(), "process_cpu_s": own.user + own.system,
            "children_cpu_s": children}  # fmt: skip


def host_use_between(before: dict, after: dict) -> dict[str, float | None]:
    """What the host spent between two :func:`host_use` snapshots (seconds, 3 decimals;
    ``children_cpu_s`` counts the descendants alive at the end)."""
    return {
        key: None if before[key] is None or after[key] is None
        else round(after[key] - before[key], 3)
        for key in before
    }  # fmt: skip
