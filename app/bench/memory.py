"""Peak memory of one call, measured from the allocator (not estimated)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes allocated during ``fn()`` above what was allocated before it.

    CUDA: the caching allocator's peak statistics. CPU: the PyTorch profiler's memory
    timeline, rebuilt from every allocation and free the CPU allocator reported while ``fn``
    ran (``profile_memory=True``).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
        with_stack=True,
    ) as prof:  # fmt: skip
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(device)
    if not sizes:
        return 0
    totals = [sum(row) for row in sizes]
    return int(max(totals) - totals[0])
