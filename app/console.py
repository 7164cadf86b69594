"""What the application prints besides Lightning's own lines."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from heads.errors import user_error


def exit_status(run: Callable[[], Any]) -> int:
    """The exit status of an entry point: ``run()``'s own when it returns an int, else 0; a user
    error (raised or wrapped, e.g. by jsonargparse) becomes one ``error:`` line on stderr and
    status 2; anything else propagates with its traceback."""
    try:
        status = run()
    except Exception as exc:
        cause = user_error(exc)
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr)
        return 2
    return status if isinstance(status, int) else 0


def show_data_log() -> None:
    """Print the data layer's INFO lines on stderr (whether a prepared corpus came from the
    cache or was built, and how long it took), as Lightning does for its own logger: a handler
    of our own only when the root logger has none, so a user's logging setup (or pytest's)
    gets the lines instead."""
    logger = logging.getLogger("datamodules")
    logger.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not logger.handlers:
        logger.addHandler(logging.StreamHandler())
        logger.propagate = False
