"""What the application prints besides Lightning's own lines."""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from app.cli.errors import known_error_line
from heads.errors import user_error

# Set (to anything) to get the full traceback of an error that is otherwise one line.
TRACEBACK_ENV = "OUTPUT_HEADS_TRACEBACK"


def error_line(exc: BaseException) -> str | None:
    """The one line for ``exc``: a user error's message (raised or wrapped, e.g. by
    jsonargparse), or a known Lightning/PyTorch error that means "fix your command"; None for
    anything else."""
    cause = user_error(exc)
    if cause is not None:
        return str(cause)
    while exc is not None:
        line = known_error_line(exc)
        if line is not None:
            return line
        exc = exc.__cause__
    return None


# what a Ctrl+C outside the training loop leaves (the data cache writes each part atomically)
INTERRUPTED = (
    "stopped before or after training; the data cache keeps the parts it finished, the next "
    "run prepares the rest"
)


def exit_status(run: Callable[[], Any]) -> int:
    """The exit status of an entry point: ``run()``'s own when it returns an int, else 0; a user
    error becomes one ``error:`` line on stderr (printed by one process under DDP) and status 2,
    a Ctrl+C outside the training loop one ``interrupted`` line and status 130 (128 + SIGINT);
    anything else propagates with its traceback, as everything does with ``$TRACEBACK_ENV``."""
    try:
        status = run()
    except KeyboardInterrupt:  # Ctrl+C before or after the trainer's loop (its own: a checkpoint)
        if os.environ.get(TRACEBACK_ENV):
            raise
        if rank_zero_only.rank == 0:
            # (on a line of its own: a progress bar may hold the current one)
            print(f"\ninterrupted (Ctrl+C): {INTERRUPTED}", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as exc:
        line = error_line(exc)
        if line is None or os.environ.get(TRACEBACK_ENV):
            raise
        if rank_zero_only.rank == 0:
            print(f"error: {line}", file=sys.stderr)
        return 2
    finally:
        release_process_group()
    return status if isinstance(status, int) else 0


def release_process_group() -> None:
    """Destroy the default process group while the interpreter is whole. Lightning does it at
    exit for NCCL only; a Gloo group left to interpreter finalisation can join its worker
    threads too late and abort the process (SIGABRT, "terminate called without an active
    exception"), turning a clean exit status into -6 (pytorch/pytorch#190489)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class _DropAdvertisement(logging.Filter):
    """Drops Lightning's "💡 Tip" lines: advertisements for its paid services, not about the
    run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_lightning() -> None:
    """Silence the Lightning lines that say nothing about the run: its tips (an
    advertisement at every fit), the model summary's warning that a mixed precision is
    "not supported", where the 32 bits it then counts are the parameters' own (mixed
    precision keeps them in float32), and advice that does not apply to our loaders. For
    ``cli.py`` and the tools that run the CLI's objects (``app.rank``)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdvertisement) for f in logger.filters):
            logger.addFilter(_DropAdvertisement())
    warnings.filterwarnings("ignore", r"Precision \S+-mixed is not supported by the model summary")
    # Our BPTT loaders are deliberately single-process: the streams are memory-mapped views.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*IterableDataset.*has `__len__` defined.*")
    warnings.filterwarnings("ignore", ".*infer the batch indices.*")
    # overfit_batches: Lightning cannot tell that the BPTT windows (an IterableDataset) come
    # in order; translation keeps its training batches alike itself (LengthSortedSampler)
    warnings.filterwarnings("ignore", ".*requested to overfit but enabled .* shuffling.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")
    # Lightning's own all_gather (a checkpoint's per-rank epoch state under DDP) calls it
    warnings.filterwarnings("ignore", ".*torch.distributed.nn.functional.all_gather is deprec.*")


# the layers whose INFO lines a run prints: the data's cache hits and builds, the heads'
# decisions (the adaptive softmax's cut-offs and cost model, CUDA graphs captured, the DS C
# kernel's fallback), the tasks' (what compile leaves eager)
APP_LOGGERS = ("datamodules", "heads", "lightning_modules")


def show_app_log() -> None:
    """Print the application's INFO lines (:data:`APP_LOGGERS`) on stderr, as Lightning does
    for its own logger: a handler of our own only when the root logger has none, so a user's
    logging setup (or pytest's) gets the lines instead."""
    for name in APP_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        if not logging.getLogger().hasHandlers() and not logger.handlers:
            logger.addHandler(logging.StreamHandler())
            logger.propagate = False
