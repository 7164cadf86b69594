"""Classifier: a vector backbone plus any pluggable head (e.g. the synthetic hierarchy)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn

from heads import Head
from lightning_modules.errors import ModelConfigError
from lightning_modules.head_task import HeadTask
from lightning_modules.optimization import SchedulerInterval
from lightning_modules.weighted_mean import WeightedMean


class Classifier(HeadTask):
    """Classification over any :class:`~heads.Head`.

    Logs ``train/loss`` (task NLL), ``train/aux_loss``, ``{val,test}/loss`` and top-k accuracy
    ``{val,test}/acc_top{k}``. Accuracy comes from ``head.topk``, the inference path: for
    DS-Softmax a class outside the selected expert is never retrieved. Hits are averaged with
    ``WeightedMean`` (reduced over DDP ranks).

    Args:
        backbone: maps ``[N, input]`` to ``[N, d]``; needs ``output_size``.
        head: the output layer; ``head.hidden_size`` must equal ``backbone.output_size``.
        optimizer: optimizer factory (LightningCLI dependency injection).
        scheduler: optional learning-rate scheduler factory (``ReduceLROnPlateau`` watches
            ``val/loss``).
        top_k: accuracies to report.
        compile: ``torch.compile`` the backbone and the head (true, or torch.compile's keyword
            arguments); see ``HeadTask``.
        loss_backend: the head's fused-loss backend (auto, torch, cce, liger) or a plan of
            the torch backend (eager, compiled, rows, plain, checkpoint, fused); see ``HeadTask``.
        cuda_graphs: capture the head's training step as CUDA graphs, one per batch shape
            (not DS-Softmax; CUDA only: elsewhere it runs eagerly); see ``HeadTask``.
        scheduler_interval: when ``scheduler`` steps: ``step`` (after every optimizer step),
            ``epoch``, or unset: the scheduler's own (every step for ``InverseSquareRootLR``,
            ``WarmupCosineLR``, ``OneCycleLR``, ``CyclicLR``; else every epoch). Set ``step``
            for a torch schedule whose lengths count optimizer steps (``CosineAnnealingLR``'s
            ``T_max``, ``LinearLR``'s ``total_iters``, the count a ``LambdaLR`` is given).
    """

    def __init__(
        self,
        backbone: nn.Module,
        head: Head,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable | None = None,
        top_k: tuple[int, ...] = (1, 5, 10),
        compile: bool | dict[str, Any] = False,
        loss_backend: str = "auto",
        cuda_graphs: bool = False,
        scheduler_interval: SchedulerInterval | None = None,
    ) -> None:
        super().__init__(
            backbone, head, optimizer, scheduler, compile, loss_backend, cuda_graphs,
            scheduler_interval=scheduler_interval,
        )  # fmt: skip
        top_k = tuple(k for k in top_k if k <= head.vocab_size)
        if not top_k:
            raise ModelConfigError(
                "top_k needs at least one k not larger than the number of classes"
            )
        self.save_hyperparameters(
            ignore=[
                "backbone",
                "head",
                "optimizer",
                "scheduler",
                "compile",
                "loss_backend",
                "cuda_graphs",
            ]  # fmt: skip
        )
        self.top_k = top_k
        self.metrics = nn.ModuleDict(
            {
                f"{stage}_{name}": WeightedMean()
                for stage in ("val", "test")
                for name in ["loss", *(f"acc_top{k}" for k in top_k)]
            }
        )

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one batch: what Lightning's model summary runs on
        ``example_input_array`` to count each module's FLOPs. Eager even where ``compile`` is
        on (see ``LanguageModel.forward``)."""
        with torch.compiler.set_stance("force_eager"):
            return self.head(self.backbone(inputs), targets).loss

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit":  # set before the summary (on_fit_start)
            self.example_input_array = self._first_training_batch()

    def _first_training_batch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The data module's first training batch (real labels: DS experts count the FLOPs a
        real batch costs), or None where drawing it would start worker processes. The global
        random generators are left as they were: training draws the same numbers."""
        data = getattr(self._trainer, "datamodule", None) if self._trainer else None
        if data is None:
            return None
        with torch.random.fork_rng(devices=[]):
            loader = data.train_dataloader()
            if getattr(loader, "num_workers", 0):
                return None
            inputs, targets = next(iter(loader))
        return inputs, targets

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        inputs, targets = batch
        output = self.head_loss(self.backbone(inputs), targets)
        # not prog_bar: Lightning reads those back after every batch (a GPU sync); the
        # app's progress bar shows it at the logging interval (interval_progress_bar)
        self.log("train/loss", output.loss)
        if output.aux_loss.requires_grad:
            self.log("train/aux_loss", output.aux_loss)
        loss = output.loss + output.aux_loss
        self.check_finite_loss(loss, "train")  # recorded on the device, read at log intervals
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        inputs, targets = batch
        hidden = self.backbone(inputs)
        output = self.head_loss(hidden, targets)
        self.check_finite_loss(output.loss, stage)  # read back once, at the epoch's end
        self.metrics[f"{stage}_loss"].update(output.loss, weight=targets.numel())
        _, indices = self.head.topk(hidden, max(self.top_k))
        hits = indices == targets[:, None]
        for k in self.top_k:
            self.metrics[f"{stage}_acc_top{k}"].update(hits[:, :k].any(dim=1).float())

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def _log_stage(self, stage: str) -> None:
        for name, metric in self.metrics.items():
            if name.startswith(f"{stage}_"):
                self.log(f"{stage}/{name[len(stage) + 1 :]}", metric.compute(), prog_bar=True)
                metric.reset()

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()  # a non-finite loss stops the run before logging
        self._log_stage("val")

    def on_test_epoch_end(self) -> None:
        super().on_test_epoch_end()
        self._log_stage("test")
