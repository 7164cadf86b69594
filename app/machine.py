"""Facts about the machine that benchmarks and studies record beside their numbers."""

from __future__ import annotations

import os


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (2 decimals), or None where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):  # AttributeError: no os.getloadavg (Windows)
        return None
