"""LanguageModel: backbone + pluggable head, trained with truncated BPTT."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torchmetrics import MeanMetric

from app.backbones import LMBackbone
from heads import Head


class LanguageModel(L.LightningModule):
    """Next-token language model over any :class:`~heads.Head`.

    Perplexity is ``exp`` of the token-weighted mean NLL over the whole split (torchmetrics
    ``MeanMetric`` weighted by token counts, reduced over DDP ranks), not a mean of batch
    perplexities.

    Args:
        backbone: maps ``[B, T]`` ids to ``[B, T, d]`` context vectors.
        head: the output layer; ``head.hidden_size`` must equal ``backbone.output_size``.
        optimizer: optimizer factory (LightningCLI dependency injection).
        scheduler: optional learning-rate scheduler factory; ``ReduceLROnPlateau`` watches
            ``val/loss``.
        tie_weights: share the head's output embeddings with the backbone's input embedding.
        predict_top_k: how many next-token candidates ``predict`` reports.
        generate_tokens: if > 0, ``predict`` also samples this many tokens after the prompt.
        temperature: sampling temperature for ``generate_tokens``.
    """

    def __init__(
        self,
        backbone: LMBackbone,
        head: Head,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable | None = None,
        tie_weights: bool = False,
        predict_top_k: int = 10,
        generate_tokens: int = 0,
        temperature: float = 1.0,
    ) -> None:
        super().__init__()
        if head.hidden_size != backbone.output_size:
            raise ValueError(
                f"head.hidden_size ({head.hidden_size}) must equal the backbone's output size "
                f"({backbone.output_size})"
            )
        if tie_weights:
            head.tie_output_embedding(backbone.embedding.weight)
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        # Only structural options go to hparams: LightningCLI re-applies a checkpoint's hparams
        # over the command line, which must stay free to change the predict options. (Modules
        # and factories are described by the config LightningCLI saves beside the logs.)
        self.save_hyperparameters(
            ignore=[
                "backbone",
                "head",
                "optimizer",
                "scheduler",
                "predict_top_k",
                "generate_tokens",
                "temperature",
            ]
        )
        self.predict_top_k = predict_top_k
        self.generate_tokens = generate_tokens
        self.temperature = temperature
        self.backbone = backbone
        self.head = head
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self._state: dict[str, Any] = {}
        self.metrics = torch.nn.ModuleDict(
            {stage: MeanMetric() for stage in ("train_nll", "val_nll", "test_nll")}
        )

    # -- steps -------------------------------------------------------------------------
    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        inputs, targets = batch
        hidden, new_state = self.backbone(inputs, self._state.get(stage))
        # carry the recurrent state to the next window, without the graph
        self._state[stage] = LMBackbone.detach_state(new_state)
        output = self.head(hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1))
        tokens = (targets != -100).sum()
        metric = self.metrics[f"{stage}_nll"]
        metric.update(output.loss.detach(), weight=tokens)
        loss = output.loss + output.aux_loss
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"non-finite {stage} loss at step {self.global_step} with "
                f"{type(self.head).__name__}: lower the learning rate or check the precision"
            )
        if stage == "train":
            self.log("train/loss", output.loss, prog_bar=True)
            self.log("train/ppl_batch", output.loss.exp())
            if output.aux_loss.requires_grad:
                self.log("train/aux_loss", output.aux_loss)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        self._step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        self._step(batch, "test")

    def _log_split_perplexity(self, stage: str) -> None:
        metric = self.metrics[f"{stage}_nll"]
        mean_nll = metric.compute()
        metric.reset()
        self.log(f"{stage}/loss", mean_nll, prog_bar=stage != "train", sync_dist=False)
        self.log(f"{stage}/ppl", mean_nll.exp(), prog_bar=True, sync_dist=False)

    def on_train_epoch_start(self) -> None:
        self._state.pop("train", None)

    def on_validation_epoch_start(self) -> None:
        self._state.pop("val", None)

    def on_test_epoch_start(self) -> None:
        self._state.pop("test", None)

    def on_train_epoch_end(self) -> None:
        self._log_split_perplexity("train")

    def on_validation_epoch_end(self) -> None:
        self._log_split_perplexity("val")

    def on_test_epoch_end(self) -> None:
        self._log_split_perplexity("test")

    # -- predict: next-token top-k, optional sampling -----------------------------------
    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        vocab = self.trainer.datamodule.vocab
        ids = batch["ids"].to(self.device).unsqueeze(0)
        hidden, state = self.backbone(ids)
        last = hidden[:, -1]
        log_probs, indices = self.head.topk(last, self.predict_top_k)
        result: dict[str, Any] = {
            "prompt": batch["prompt"],
            "top_k": [
                {"token": vocab.itos[i], "prob": round(math.exp(lp), 6)}
                for lp, i in zip(log_probs[0].tolist(), indices[0].tolist(), strict=True)
            ],
        }
        if self.generate_tokens > 0:
            result["sample"] = " ".join(vocab.decode(self._sample(ids, last, state)))
        return result

    def _sample(self, ids: torch.Tensor, last: torch.Tensor, state: Any) -> list[int]:
        sampled: list[int] = []
        for _ in range(self.generate_tokens):
            logits = self.head.log_prob(last) / self.temperature
            token = torch.multinomial(logits.softmax(-1), 1)  # [1, 1]
            sampled.append(int(token))
            if self.backbone.carries_state:
                hidden, state = self.backbone(token, state)
            else:  # re-read the whole context
                ids = torch.cat((ids, token), dim=1)
                hidden, _ = self.backbone(ids)
            last = hidden[:, -1]
        return sampled

    # -- optimisation and checkpoints ------------------------------------------------
    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss", "interval": "epoch"},
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Check the vocabulary before the weights are loaded, so a mismatch is reported as
        # such rather than as a tensor shape error.
        trainer = self._trainer
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        key = type(datamodule).__qualname__
        if datamodule is not None and key in checkpoint and hasattr(datamodule, "load_state_dict"):
            datamodule.load_state_dict(checkpoint[key])
