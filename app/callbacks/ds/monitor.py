"""Logs DS-Softmax's structure on validation: utilisation, expert sizes, speed-up, heatmap."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from app.callbacks.ds.optim import DSCallback, find_ds_head, head_inputs
from heads.cross_entropy import IGNORE_INDEX
from heads.errors import HeadConfigError
from lightning_modules.weighted_mean import WeightedMean

# what a DS run's progress bar shows after each validation: how far the structure has come
ON_THE_BAR = ("ds/speedup", "ds/num_experts")


class DSMonitor(DSCallback):
    """After each validation epoch logs ``ds/speedup`` (``|V| / (sum_k |v_k| u_k + K)``),
    ``ds/num_experts`` (both on the progress bar), ``ds/rows`` (``sum_k |v_k|``),
    ``ds/mean_expert_size``, ``ds/max_utilisation``, and to TensorBoard the histograms of
    ``u_k`` and ``|v_k|`` and the expert x class membership image (classes binned to
    ``heatmap_columns`` when V is larger).

    ``u_k`` is counted after each validation batch from what the head saw (the task's
    ``head_inputs``) over the tokens that are not ignored (weighted 0: nothing read back),
    summed over DDP ranks.
    """

    def __init__(self, heatmap_columns: int = 1000) -> None:
        self.heatmap_columns = heatmap_columns
        self._counts: torch.Tensor | None = None

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _, head = find_ds_head(pl_module)
        self._counts = torch.zeros(head.num_experts, dtype=torch.float64, device=pl_module.device)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:  # fmt: skip
        if self._counts is None:
            return
        _, head = find_ds_head(pl_module)
        hidden, target = head_inputs(pl_module)
        expert, _ = head.select(hidden)
        kept = (target != IGNORE_INDEX).double()
        self._counts += torch.bincount(expert, weights=kept, minlength=head.num_experts)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._counts is None or trainer.sanity_checking:
            return
        _, head = find_ds_head(pl_module)
        counts = trainer.strategy.reduce(self._counts, reduce_op="sum")
        utilisation = (counts / counts.sum().clamp_min(1)).cpu()
        sizes = torch.tensor(head.expert_sizes(), dtype=torch.float64)
        stats = {
            "ds/speedup": head.flops_speedup(utilisation),
            "ds/num_experts": float(head.num_experts),
            "ds/rows": float(sizes.sum()),
            "ds/mean_expert_size": float(sizes.mean()),
            "ds/max_utilisation": float(utilisation.max()),
        }
        for key, value in stats.items():  # host numbers: the bar reads nothing back
            pl_module.log(key, value, sync_dist=False, prog_bar=key in ON_THE_BAR)
        experiment = getattr(trainer.logger, "experiment", None)
        if trainer.is_global_zero and hasattr(experiment, "add_image"):
            step = trainer.global_step
            experiment.add_histogram("ds/utilisation", utilisation, step)
            experiment.add_histogram("ds/expert_sizes", sizes, step)
            experiment.add_image("ds/expert_class", self.heatmap(head)[None], step)

    def heatmap(self, head) -> torch.Tensor:
        """``[K, columns]`` in [0, 1]: share of each bin's classes alive in each expert."""
        image = head.membership().float()
        if image.size(1) > self.heatmap_columns:
            bins = torch.arange(image.size(1)) * self.heatmap_columns // image.size(1)
            summed = torch.zeros(image.size(0), self.heatmap_columns).index_add(1, bins, image)
            image = summed / torch.bincount(bins, minlength=self.heatmap_columns).clamp_min(1)
        return image


class TopKAccuracy(Callback):
    """Logs ``{val,test}/acc_top{k}`` of any module whose head is a ``heads.Head`` attribute
    ``head`` (LanguageModel, Classifier...), through ``head.topk``: the inference path, so for
    DS-Softmax a class outside the selected expert is never retrieved.

    After every evaluation batch it reads the context vectors and targets the head saw (the
    task's ``head_inputs``); hits over the tokens that are not ignored (weighted 0: nothing
    read back) are averaged by ``WeightedMean`` (reduced over DDP ranks).
    ``prefix`` goes in front of ``acc_top{k}`` (the Classifier already logs ``acc_top{k}``
    itself).
    """

    def __init__(self, top_k: tuple[int, ...] = (1, 5, 10), prefix: str = "") -> None:
        if not top_k or min(top_k) < 1:
            raise HeadConfigError(f"top_k must hold positive integers, got {top_k!r}")
        self.top_k = tuple(sorted(top_k))
        self.prefix = prefix
        self._metrics: dict[int, WeightedMean] = {}

    def _start(self, pl_module: L.LightningModule) -> None:
        ks = [k for k in self.top_k if k <= pl_module.head.vocab_size]
        self._metrics = {k: WeightedMean().to(pl_module.device) for k in ks}

    def _count(self, pl_module: L.LightningModule) -> None:
        if not self._metrics:
            return
        hidden, target = head_inputs(pl_module)
        _, indices = pl_module.head.topk(hidden, max(self._metrics))
        hits = indices == target[:, None]
        kept = (target != IGNORE_INDEX).float()
        for k, metric in self._metrics.items():
            metric.update(hits[:, :k].any(dim=1).float(), weight=kept)

    def _end(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if trainer.sanity_checking:
            return
        for k, metric in self._metrics.items():
            pl_module.log(f"{stage}/{self.prefix}acc_top{k}", metric.compute(), sync_dist=False)

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end(trainer, pl_module, "val")

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:  # fmt: skip
        self._count(pl_module)

    def on_test_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start(pl_module)

    def on_test_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                          outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None:  # fmt: skip
        self._count(pl_module)

    def on_test_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end(trainer, pl_module, "test")
