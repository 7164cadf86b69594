"""Test helper for the DDP tests: each rank writes the state that must agree across ranks."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


class DumpRankState(L.Callback):
    """At the end of ``fit``, rank r saves ``<folder>/rank<r>.pt``: the head's state dict,
    the Hybrid-LightRNN table (if any), and the DS callbacks' counters."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        data = trainer.datamodule  # a translation's coded vocabulary is its target side
        vocab = getattr(data, "target_vocab", None) or getattr(data, "vocab", None)
        state = {
            "head": {
                k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                for k, v in pl_module.head.state_dict().items()
            },
            "cells": getattr(vocab, "cells", None),
            "global_step": trainer.global_step,
        }
        for callback in trainer.callbacks:
            for name in ("splits", "pruned_rows"):
                if hasattr(callback, name):
                    state[f"{type(callback).__name__}.{name}"] = getattr(callback, name)
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save(state, self.folder / f"rank{trainer.global_rank}.pt")
