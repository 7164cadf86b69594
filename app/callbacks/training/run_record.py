"""What TensorBoard needs to tell the truth about a run; the CLI adds it to every run."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn

# (metric, "min" | "max") a task names as the quality of a run (``hp_metric``)
DEFAULT_HP_METRIC = ("val/loss", "min")


def model_step(checkpoint: dict[str, Any]) -> int:
    """The step at which a run logged the figures of the model a checkpoint holds: Lightning
    logs a batch's figures, and the validation after it, at the steps done before it."""
    return max(int(checkpoint.get("global_step", 0)) - 1, 0)


def _logged_step(trainer: L.Trainer) -> int:
    # the step Lightning gives the figures logged now (what ``self.log`` would use)
    return trainer.fit_loop.epoch_loop._batches_that_stepped


class RunRecord(L.Callback):
    """The run's hyper-parameters and its best validation figure in TensorBoard's HPARAMS tab,
    and evaluations on the training step axis.

    - ``hparams`` (nested dicts; the loggers flatten them, ``head/num_components``) join the
      model's and the data's hyper-parameters in ``hparams.yaml``, with the data's vocabulary
      size; from the first validation of ``fit`` on, HPARAMS holds them all with ``hp_metric``,
      the best value so far of the task's ``HP_METRIC`` (``val/ppl`` for a language model,
      ``val/bleu`` for translation), logged after every validation (loggers configured with
      ``default_hp_metric=False``, so no ``-1`` stands in for it).
    - ``validate``/``test`` of a checkpoint log at the step of the model they measure (that of
      its last training batch, where the run logged its validation), not at step 0.
    """

    def __init__(self, hparams: dict[str, Any] | None = None) -> None:
        self.hparams = dict(hparams or {})
        self.best: float | None = None
        self._summary_written = False
        self._checkpoint_step: int | None = None

    # -- hyper-parameters ----------------------------------------------------------------
    def run_hparams(self, trainer: L.Trainer) -> dict[str, Any]:
        params = dict(self.hparams)
        for name in ("vocab_size", "src_vocab_size"):
            size = getattr(trainer.datamodule, name, None)
            if isinstance(size, int):
                params[name] = size
        return params

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._summary_written = False
        # before Lightning logs the model's and the data's (and writes hparams.yaml): ours
        # join them there
        for logger in trainer.loggers:
            logger.log_hyperparams(self.run_hparams(trainer))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        name, mode = getattr(pl_module, "HP_METRIC", DEFAULT_HP_METRIC)
        value = trainer.callback_metrics.get(name)
        if value is None or not math.isfinite(float(value)):
            return
        value = float(value)
        if self.best is None or (value < self.best if mode == "min" else value > self.best):
            self.best = value
        metrics, step = {"hp_metric": self.best}, _logged_step(trainer)
        for logger in trainer.loggers:
            if self._summary_written or not isinstance(logger, TensorBoardLogger):
                logger.log_metrics(metrics, step=step)
            else:  # HPARAMS: every hyper-parameter logged so far, and the metric's name
                logged = getattr(logger, "hparams", {})
                params = {k: v for k, v in logged.items() if not str(k).startswith("_")}
                params.update(self.run_hparams(trainer))  # (not LightningCLI's _instantiator)
                logger.log_hyperparams(params, metrics=metrics, step=step)
        self._summary_written = True

    # -- the step axis of evaluations ----------------------------------------------------
    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._checkpoint_step = model_step(checkpoint)

    def _log_model_step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if (
            self._checkpoint_step is not None
            and trainer.state.fn != TrainerFn.FITTING
            and trainer.loggers  # (no logger: nothing to place on an axis)
        ):
            # a logged "step" is the x-axis of the figures logged with it (Lightning's rule)
            pl_module.log("step", float(self._checkpoint_step), logger=True, prog_bar=False)

    on_validation_epoch_end = on_test_epoch_end = _log_model_step

    # -- resume: the best so far -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = state_dict.get("best")
