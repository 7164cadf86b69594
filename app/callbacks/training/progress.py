"""Lightning's progress bar without a host-device sync per batch.

Lightning converts every metric logged with ``prog_bar=True`` to a Python number after each
batch, and ``TQDMProgressBar`` shows them then: each conversion reads a device tensor back to
the host (``Tensor.item``), on a GPU a sync, which holds the host until the device has run the
whole step, so the host cannot queue the next step while the device runs this one. A small step
(a PTB batch) is launch-bound, and that overlap is most of its speed. So the tasks log their
per-batch ``train/loss`` without ``prog_bar``, and :class:`IntervalProgressBar` shows it (with
whatever else is named in ``shown``) from the trainer's callback metrics at the logging interval
(``Trainer.log_every_n_steps``, where the loggers read it anyway) and at an epoch's end, its count
moving every batch as Lightning's does. The app's CLI uses it unless the trainer is given another
progress bar or none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar


class IntervalProgressBar(TQDMProgressBar):
    """``TQDMProgressBar`` whose training metrics are read every ``log_every_n_steps`` batches
    and at the epoch's end: Lightning's ``prog_bar`` metrics, and the latest value of each
    callback metric in ``shown`` (logged without ``prog_bar``, so never read back per batch);
    its count moves every ``refresh_rate`` batches."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False,
                 shown: Sequence[str] = ("train/loss",)) -> None:  # fmt: skip
        super().__init__(refresh_rate, process_position, leave)
        self.shown = tuple(shown)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        for name in self.shown:  # a read-back each: only when the bar shows its metrics
            value = trainer.callback_metrics.get(name)
            if value is not None:
                metrics[name] = f"{float(value):.3f}"
        return metrics

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:  # fmt: skip
        bar = self.train_progress_bar
        count = batch_idx + 1
        if bar is None or bar.disable or not self.is_enabled:
            return
        last = count == bar.total
        if count % self.refresh_rate and not last:
            return
        bar.n = count
        if count % max(trainer.log_every_n_steps, 1) == 0 or last:
            bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()
