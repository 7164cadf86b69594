"""Logs the data's optimum beside a model's loss, for corpora where it is known exactly (the
synthetic Markov chain, ``datamodules/markov_chain.py``)."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback


class DataOptimum(Callback):
    """At the end of each validation and test: ``{val,test}/optimum_nll`` (the true chain's
    mean NLL on that split, nats), ``{val,test}/entropy_rate`` and ``{val,test}/data_rank``
    (the rank of the chain's row-centred log-transition matrix), read from the data module
    (``optimum_nll(split)``, ``summary``). A model's excess over the optimum is
    ``{stage}/loss - {stage}/optimum_nll`` (the study report computes it). A data module
    without ``optimum_nll`` logs nothing."""

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        data = getattr(trainer, "datamodule", None)
        if not hasattr(data, "optimum_nll") or trainer.sanity_checking:
            return
        summary = data.summary
        pl_module.log(f"{stage}/optimum_nll", data.optimum_nll(stage), sync_dist=False)
        pl_module.log(f"{stage}/entropy_rate", float(summary["entropy_rate"]), sync_dist=False)
        pl_module.log(f"{stage}/data_rank", float(summary["centred_rank"]), sync_dist=False)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._log(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._log(trainer, pl_module, "test")
