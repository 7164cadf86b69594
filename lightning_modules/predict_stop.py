"""``predict`` stops at a ``SIGTERM`` (a scheduler's, ``kill``): Lightning's handler only sets
``trainer.received_sigterm``, which its validation and test loops read before each batch, but
its prediction loop never does, so a predict over a long file went on to its end (a job past its
grace period killed outright) and said nothing. Read here before each batch: the run stops
with ``SIGTERMException`` (the CLI's line and status 143), saying how far the output goes."""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from datamodules.pair_batches import InputOrder

log = logging.getLogger(__name__)


def stop_if_terminated(trainer: Any, order: InputOrder) -> None:
    """Raise ``SIGTERMException`` once the trainer has received ``SIGTERM``, after one line
    saying which of the input's lines were written (in order: the first ``order.written``;
    results held back for an earlier line are not)."""
    if trainer is None or not getattr(trainer, "received_sigterm", False):
        return
    _say_written(order)
    raise SIGTERMException


@rank_zero_only
def _say_written(order: InputOrder) -> None:
    held = f"; {order.held:,} later results held back were not" if order.held else ""
    log.warning(
        "warning: predict stopped by SIGTERM: the input's first %s lines were written%s",
        f"{order.written:,}",
        held,
    )
