"""``last.ckpt`` that is the latest state, as its name says.

Lightning 2.6's ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` only at a step where it
also keeps a top-k checkpoint, that is when the monitored figure improved. After a validation
that did not improve, ``last.ckpt`` stays at an older state, and a fit that crashes (out of
memory, a lost node: no signal to save on) resumes from there and trains those epochs again.
Its end-of-training save also ignores ``fast_dev_run`` and drops ``checkpoints/last.ckpt`` in the
working folder (a ``fast_dev_run`` has no logger, so no run folder).
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same options), except that with ``save_last=True``
    every check it makes (each validation, or each training epoch's end with
    ``save_on_train_epoch_end``) leaves ``last.ckpt`` at the current step, improved or not, and
    a ``fast_dev_run`` writes nothing."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._keep_last_current(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._keep_last_current(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.fast_dev_run:
            super().on_train_end(trainer, pl_module)

    def _keep_last_current(self, trainer: L.Trainer) -> None:
        # skipped where Lightning saves nothing (sanity check, fast_dev_run) and where this
        # step is saved already; save_last="link" keeps Lightning's meaning (a link to the best)
        if self.save_last is True and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
