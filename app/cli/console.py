"""What the application prints besides Lightning's own lines."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
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


# what a Ctrl+C or SIGTERM outside the training loop leaves (the data cache writes each part
# atomically)
INTERRUPTED = (
    "stopped before or after training; the data cache keeps the parts it finished, the next "
    "run prepares the rest"
)
# what a SIGTERM inside an evaluation's loop (validate, test, predict) leaves
EVALUATION_STOPPED = "stopped before its end: what it printed or wrote so far is incomplete"
# how each signal is named in the line it leaves
_SIGNAL_NAMES = {signal.SIGINT: "interrupted (Ctrl+C)", signal.SIGTERM: "terminated (SIGTERM)"}


class Stopped(BaseException):
    """A ``SIGTERM`` or ``SIGINT`` received outside the training loop (the data being
    prepared): raised by :func:`stop_on_signals`' handler so that ``finally`` blocks run (the
    cache's temporary files go, its lock is released). Not a ``KeyboardInterrupt``: Lightning
    turns one raised inside ``Trainer.fit`` (``prepare_data``) into its own message and exit
    status 1."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    # only while it is the signal's handler: the training loop's handlers (Lightning's, whose
    # stop saves a checkpoint, and PreemptionCheckpoint's) call the one they found before them,
    # and the stop is theirs then
    if signal.getsignal(signum) is _raise_stopped:
        raise Stopped(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """``SIGTERM`` and ``SIGINT`` raise :class:`Stopped` while the signal's handler is the
    default one (a signal ignored, e.g. by ``nohup``, stays ignored); the handlers go back on
    exit. The default ``SIGTERM`` ended the process silently (status 143 and no line, a
    temporary file left in the data cache), and a Ctrl+C inside ``Trainer.fit`` was Lightning's
    "Detected KeyboardInterrupt" and status 1."""
    if threading.current_thread() is not threading.main_thread():  # (signal.signal refuses)
        yield
        return
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    previous = {}
    for signum, default in defaults.items():
        if signal.getsignal(signum) is default:
            previous[signum] = signal.signal(signum, _raise_stopped)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if signal.getsignal(signum) is _raise_stopped:
                signal.signal(signum, handler)


def _stopped_line(signum: int, what: str = INTERRUPTED) -> int:
    """The one line of a stop by ``signum`` outside the training loop, and its exit status."""
    if rank_zero_only.rank == 0:
        # (on a line of its own: a progress bar may hold the current one)
        print(f"\n{_SIGNAL_NAMES[signum]}: {what}", file=sys.stderr)
    return 128 + signum


def exit_status(run: Callable[[], Any], signals: bool = False) -> int:
    """The exit status of an entry point: ``run()``'s own when it returns an int, else 0; a user
    error becomes one ``error:`` line on stderr (printed by one process under DDP) and status 2,
    a Ctrl+C outside the training loop one ``interrupted`` line and status 130 (128 + SIGINT);
    with ``signals`` (:func:`stop_on_signals`), a ``SIGTERM`` there too (``terminated``, 143); a
    ``SIGTERM`` that stopped an evaluation's loop (Lightning's ``SIGTERMException`` of status
    0) one ``terminated`` line and 143;
    anything else propagates with its traceback, as everything does with ``$TRACEBACK_ENV``."""
    try:
        with stop_on_signals() if signals else contextlib.nullcontext():
            status = run()
    except (KeyboardInterrupt, Stopped) as stop:  # the trainer's loop has its own: a checkpoint
        if os.environ.get(TRACEBACK_ENV):
            raise
        return _stopped_line(getattr(stop, "signum", signal.SIGINT))
    except SIGTERMException as stop:
        # Lightning's stop of a loop on SIGTERM, a SystemExit of status 0: a fit's
        # (PreemptionCheckpoint) gives it 143 and its own line; an evaluation's had none, and
        # a killed `predict > out.jsonl` read as a success
        if stop.code is not None or os.environ.get(TRACEBACK_ENV):
            raise
        return _stopped_line(signal.SIGTERM, EVALUATION_STOPPED)
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
