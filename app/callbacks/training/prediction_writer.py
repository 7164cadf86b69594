"""Prints ``predict`` results and optionally writes them as JSON lines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter


class PredictionWriter(BasePredictionWriter):
    """Prints each prediction (rank 0) as one JSON line and appends it to ``output_file`` if
    given: a batch of predictions (translation's sentences) a line each, as the language
    model's prompts are, so the output is JSON lines for both tasks."""

    def __init__(self, output_file: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_file = Path(output_file) if output_file else None
        self._started = False

    def write_on_batch_end(
        self, trainer, pl_module, prediction: Any, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        if trainer.global_rank != 0:
            return
        records = prediction if isinstance(prediction, list) else [prediction]
        lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        print(lines, end="", flush=True)
        if self.output_file is not None:
            mode = "a" if self._started else "w"
            self.output_file.parent.mkdir(parents=True, exist_ok=True)
            with self.output_file.open(mode, encoding="utf-8") as handle:
                handle.write(lines)
            self._started = True
