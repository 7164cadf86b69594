"""``last.ckpt`` that is the latest state, as its name says, and an epoch's checkpoint that holds
the whole epoch.

Lightning 2.6's ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` only at a step where it
also keeps a top-k checkpoint, that is when the monitored figure improved. After a validation
that did not improve, ``last.ckpt`` stays at an older state, and a fit that crashes (out of
memory, a lost node: no signal to save on) resumes from there and trains those epochs again.
Its end-of-training save also ignores ``fast_dev_run`` and drops ``checkpoints/last.ckpt`` in the
working folder (a ``fast_dev_run`` has no logger, so no run folder).

Where validations run inside the epoch (``val_check_interval`` < 1 or a number of batches) or
not every epoch (``check_val_every_n_epoch`` > 1), Lightning saves at each validation's end,
callbacks before the module: the validation that ends an epoch was saved before the task took
the epoch's ``ReduceLROnPlateau`` step (``lightning_modules/optimization.py``) and before the
epoch's end (its re-learnt LightRNN table, its epoch metrics). The fit resumed from it skipped
that validation and the epoch's end took no plateau step: the step was lost, and the learning
rate of every later epoch differed. That save is made at the epoch's end instead, as Lightning
does when it validates once an epoch: the same step, the same validation figures.

A fit that ``trainer.max_steps`` stops inside an epoch: Lightning ends the epoch there (the
epoch's end hooks run on part of it: its epoch metrics are computed and reset, the callbacks
make their epoch-end changes) and only then saves, so the fit resumed from that ``last.ckpt``
with a larger ``max_steps`` continued an epoch that had been ended: its epoch figures covered the
batches after the stop only. ``last.ckpt`` is written before that end instead, at the last
batch (or after the validation that follows it), as a preemption or a crash leaves it: the
resumed fit continues the epoch as the uninterrupted one did.

A save by step (``every_n_train_steps``, ``train_time_interval``) that falls on an epoch's last
batch: Lightning writes it at that batch's end, before the epoch's validation, its end hooks and
its plateau step, and a fit resumed from it counts the epoch finished (Lightning 2.6's
``FitLoop.reset``: a save in ``on_train_batch_end`` with ``is_last_batch``): that validation,
the epoch's end (its metrics, its plateau step) and the next epoch's start hooks were lost, and
the generators were not given back. That save is made at the epoch's end instead, after all of
them, as the epoch-ending validation's is: the same step, the same file name.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from lightning_modules.optimization import epoch_batches_done


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same options), except that with ``save_last=True``
    every check it makes (each validation, or each training epoch's end with
    ``save_on_train_epoch_end``) leaves ``last.ckpt`` at the current step, improved or not; the
    save of a validation that ends a training epoch, and a save by step due at an epoch's last
    batch, are made at that epoch's end (module docstring); and a ``fast_dev_run`` writes
    nothing."""

    # the global step whose validation ended its epoch, its save left to the epoch's end
    # (not an __init__ argument: LightningCLI reads the options from Lightning's signature)
    _saved_at_epoch_end: int | None = None
    # (step, the step saved before) when last.ckpt was written at the batch max_steps stopped
    _stopped_at: tuple[int, int] | None = None
    # the index of an epoch's last batch, whose step save (if due) is left to the epoch's end
    _last_batch: int | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:  # fmt: skip
        if trainer.state.fn == TrainerFn.FITTING and epoch_batches_done(trainer):
            self._last_batch = batch_idx  # its validation, end and plateau step to come
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._stops_mid_epoch(trainer):
            previous = self._last_global_step_saved
            self._keep_last_current(trainer)
            self._stopped_at = (trainer.global_step, previous)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stopped_at is not None and self._stopped_at[0] == trainer.global_step:
            # a validation after the batch max_steps stopped at: saved as usual (its top-k
            # checkpoint; last.ckpt after it, which a resumed fit does not run again)
            self._last_global_step_saved = self._stopped_at[1]
            self._stopped_at = None
        if self._validation_ends_epoch(trainer):
            self._saved_at_epoch_end = trainer.global_step
            return
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._keep_last_current(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_batch is not None:
            # the last batch's step save (if due), made now that the epoch has ended (Lightning
            # reads nothing of the batch: trainer.global_step and the clock decide)
            batch_idx, self._last_batch = self._last_batch, None
            super().on_train_batch_end(trainer, pl_module, None, None, batch_idx)
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._keep_last_current(trainer)
        elif self._saved_at_epoch_end == trainer.global_step:
            # the epoch-ending validation's save, as Lightning would have made it then
            super().on_validation_end(trainer, pl_module)
            self._keep_last_current(trainer)
        self._saved_at_epoch_end = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.fast_dev_run:
            super().on_train_end(trainer, pl_module)

    def _stops_mid_epoch(self, trainer: L.Trainer) -> bool:
        """This training batch reached ``max_steps`` before the epoch's last batch."""
        return (
            self.save_last is True
            and trainer.state.fn == TrainerFn.FITTING
            and trainer.max_steps >= 0
            and trainer.global_step >= trainer.max_steps
            and not epoch_batches_done(trainer)
        )

    def _validation_ends_epoch(self, trainer: L.Trainer) -> bool:
        """A validation of the fit after the epoch's last training batch, which Lightning would
        save at its end (not at the epoch's end)."""
        return (
            trainer.state.fn == TrainerFn.FITTING
            and not trainer.sanity_checking
            and not self._should_save_on_train_epoch_end(trainer)
            and epoch_batches_done(trainer)
        )

    def _keep_last_current(self, trainer: L.Trainer) -> None:
        # skipped where Lightning saves nothing (sanity check, fast_dev_run) and where this
        # step is saved already; save_last="link" keeps Lightning's meaning (a link to the best)
        if self.save_last is True and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
