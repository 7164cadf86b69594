"""What the application prints besides Lightning's own lines."""

from __future__ import annotations

import logging


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
