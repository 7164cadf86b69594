"""Where a resumed fit starts. Lightning does not call ``on_train_epoch_start`` for the epoch
that a fit resumes inside (from a mid-epoch checkpoint: preemption, Ctrl+C, a validation
inside the epoch), so a callback that sets an epoch up there does it in ``on_train_start``
too, when :func:`resumed_mid_epoch` says so."""

from __future__ import annotations

import lightning as L


def resumed_mid_epoch(trainer: L.Trainer) -> bool:
    """Whether this fit continues an epoch from a checkpoint written inside it (known from
    ``on_train_start`` on)."""
    return trainer.fit_loop.restarted_mid_epoch
