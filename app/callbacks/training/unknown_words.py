"""Logs, once when fitting starts, how much of each split became ``<unk>``."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback


class UnknownWords(Callback):
    """Logs ``data/<split>_unk_tokens`` and ``data/<split>_unk_share`` (step 0) for the splits the
    data module prepared: the tokens that became ``<unk>`` without being written ``<unk>`` in
    the text (training: words dropped by ``max_vocab_size`` or ``min_freq``; validation: words
    the training split lacks; BPE: unseen characters). The data module read the counts from
    its cache entry (``LanguageModelingDataModule.unknown_tokens``) and printed them; a data
    module without them logs nothing."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        counts = getattr(trainer.datamodule, "unknown_tokens", None) or {}
        metrics: dict[str, float] = {}
        for split, (unknown, tokens) in sorted(counts.items()):
            metrics[f"data/{split}_unk_tokens"] = float(unknown)
            metrics[f"data/{split}_unk_share"] = unknown / max(tokens, 1)
        if not metrics:
            return
        # self.log is not allowed in on_fit_start: straight to the loggers (rank 0 only)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
