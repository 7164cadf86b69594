"""Tokens per second, through Lightning's ``ThroughputMonitor``."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor


def _streams(batch: Any) -> int:
    return 1 if isinstance(batch, dict) else batch[0].size(0)  # predict: one prompt


def _tokens(batch: Any) -> int:
    return batch["ids"].numel() if isinstance(batch, dict) else batch[0].numel()


class TokenThroughputMonitor(ThroughputMonitor):
    """Logs ``train/device/items_per_sec`` (tokens/s) and ``train/device/batches_per_sec``
    for BPTT batches ``(input [B, T], target [B, T])``, a rolling mean over ``window_size``
    logged steps."""

    def __init__(self, window_size: int = 20) -> None:
        super().__init__(batch_size_fn=_streams, length_fn=_tokens, window_size=window_size)

    def setup(self, trainer, pl_module, stage: str) -> None:  # type: ignore[override]
        # No FLOP count for these models: tell the monitor so instead of warning each run.
        if not hasattr(pl_module, "flops_per_batch"):
            pl_module.flops_per_batch = None
        super().setup(trainer, pl_module, stage)
