"""A preempted or interrupted fit loses nothing: a resumable checkpoint on the way out.

A cluster scheduler sends ``SIGTERM`` before it kills a job (``kill`` sends it too) and a user
presses Ctrl+C (``SIGINT``). Lightning already turns ``SIGTERM`` into a clean stop: its handler
sets ``trainer.received_sigterm`` and the loop raises ``SIGTERMException`` once the current batch
is done (broadcast to every DDP rank). This callback gives ``SIGINT`` the same path (a second
Ctrl+C stops at once), saves the exact-resume checkpoint in ``on_exception`` (atomically, as
``last.ckpt`` beside the run's other checkpoints), prints one line saying where, and sets the exit
status a scheduler reads as an interruption: 128 + the signal (143 for SIGTERM, 130 for SIGINT)
instead of the 0 that ``SIGTERMException`` (a ``SystemExit``) would give. SLURM's warning signal
is Lightning's own business (``SLURMEnvironment(auto_requeue=True)``: an ``hpc`` checkpoint and a
requeue).

A signal is held while a validation of the fit runs and handed to Lightning at its end:
Lightning stops an evaluation at its next batch, so a signal in an epoch's last training batch
(or in a validation) lost that validation (no ``val/loss``, no best checkpoint, no plateau or
NT-ASGD decision) and the epoch's end, and the resumed run went another way. Handed over at
the validation's end, Lightning stops after the batch (mid-epoch) or after the epoch's end.
Likewise over an accumulation window (``accumulate_grad_batches`` k): stopped after a batch that
did not step, the checkpoint kept no gradient of the window's earlier batches, and the resumed
run's next step was of its last batches alone; the signal is handed over after the batch that
steps.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SIGNAL_LOG = "lightning.pytorch.trainer.connectors.signal_connector"
FILENAME = "last.ckpt"


@contextlib.contextmanager
def _quiet(logger_name: str, text: str) -> Iterator[None]:
    """Drop the records of ``logger_name`` that contain ``text`` meanwhile."""

    def keep(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()

    logger = logging.getLogger(logger_name)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


class PreemptionCheckpoint(Callback):
    """On ``SIGTERM`` or ``SIGINT`` during ``fit``: finish the batch, save a resumable
    checkpoint, say where, exit with 128 + the signal number. (A plain ``Callback``: a
    ``Checkpoint`` subclass would clash with ``--trainer.enable_checkpointing false``, which
    this one honours by saving nothing.)"""

    def __init__(self) -> None:
        super().__init__()
        self.received: int | None = None
        self._trainer: L.Trainer | None = None
        self._previous: dict[int, Any] = {}
        self._validating = False  # a validation of the fit runs: a signal is held (docstring)
        self._accumulating = False  # the last batch left gradients for the next: held too
        self._told = False  # Lightning's notifier called

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning registered its SIGTERM handler before this hook; ours records the signal
        # and hands SIGTERM on to it, SIGINT to the same notifier
        self._trainer, self.received, self._validating, self._told = trainer, None, False, False
        self._accumulating = False
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl+C: stop now, without a checkpoint
        first = self.received is None
        self.received = signum
        if first and signum == signal.SIGINT:
            rank_zero_info("SIGINT: saving a checkpoint after this batch (Ctrl+C again: stop now)")
        if not (self._validating or self._accumulating):
            self._hand_over(frame)

    def _hand_over(self, frame: FrameType | None = None) -> None:
        """Lightning told of the signal received: it stops after the batch under way."""
        connector = self._trainer._signal_connector
        if self._told:  # held over a validation: told once is enough (its notifier would
            connector.received_sigterm = True  # signal a launcher's children again)
            return
        self._told = True
        previous = self._previous.get(self.received)
        if self.received == signal.SIGTERM and callable(previous):
            previous(self.received, frame)  # Lightning's: sets trainer.received_sigterm
            return
        with _quiet(_SIGNAL_LOG, "Received SIGTERM"):  # its notifier names every signal so
            connector._sigterm_notifier_fn(self.received, frame)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        # (Lightning's own test whether this batch left its gradients to the next one's step;
        # it reads the signal just after this hook)
        self._accumulating = trainer.fit_loop.epoch_loop._should_accumulate()
        if self.received is None or self._validating:
            return
        if self._accumulating:  # handed over in this batch: held to the window's end
            trainer._signal_connector.received_sigterm = False
        else:
            self._hand_over()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return
        self._validating = True
        if self.received is not None:  # handed over in the batch before: held again
            trainer._signal_connector.received_sigterm = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._validating:
            return
        self._validating = False
        if self.received is not None and not self._accumulating:
            self._hand_over()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException) or self.received is None:
            return
        exception.code = 128 + self.received  # SIGTERMException would exit with status 0
        if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
            return  # nothing trained yet to save
        name = signal.Signals(self.received).name
        if trainer.checkpoint_callback is None:  # --trainer.enable_checkpointing false
            rank_zero_info(
                f"{name} at step {trainer.global_step}: checkpointing is off, none saved"
            )
            return
        path = self.checkpoint_path(trainer)
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint):
            # in the state saved, this file is the callback's own last checkpoint: resumed, it
            # goes on writing last.ckpt (one it does not know of, it would keep beside a new
            # last-v1.ckpt, and whatever reads last.ckpt would read this stopped state)
            callback.last_model_path = os.path.join(callback.dirpath, FILENAME)
        # written beside, then renamed: a kill during the save leaves the old last.ckpt whole
        partial = path.with_name(f".{path.name}.partial")
        trainer.save_checkpoint(partial, weights_only=False)  # said, not left to a log line
        if trainer.is_global_zero:
            os.replace(partial, path)
            print(
                f"{name} at step {trainer.global_step}: saved {path}; resume with "
                f"`python cli.py fit <same options> --ckpt_path {path}`",
                file=sys.stderr,
            )

    @staticmethod
    def checkpoint_path(trainer: L.Trainer) -> Path:
        """``last.ckpt`` in the folder of the run's ``ModelCheckpoint``."""
        folder = Path(trainer.checkpoint_callback.dirpath)
        folder.mkdir(parents=True, exist_ok=True)
        return folder / FILENAME

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning's own teardown (earlier) puts back the handlers from before the fit;
        # ours are replaced only if something left them in place
        for signum, handler in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler)
        self._previous.clear()
