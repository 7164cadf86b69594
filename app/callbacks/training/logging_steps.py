"""When Lightning reads a training step's metrics back: the callbacks that need the device's
values (a sync on a GPU) take them then, so that a step makes no sync of its own."""

from __future__ import annotations

import lightning as L


def logs_this_batch(trainer: L.Trainer) -> bool:
    """Whether Lightning sends the step metrics to the loggers after the training batch now
    ending (every ``log_every_n_steps`` optimizer steps, counted across epochs, and at a stop;
    with gradient accumulation, after the step's last batch): where it reads them back from
    the device anyway."""
    return (
        trainer._logger_connector.should_update_logs and not trainer.fit_loop._should_accumulate()
    )
