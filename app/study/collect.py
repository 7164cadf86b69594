"""What a finished run left on disk, as plain data: CSVLogger metrics, the best checkpoint."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import torch

from lightning_modules.checkpoint_file import best_checkpoint_state

EPOCH_TIME = "time/train_epoch_s"


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a CSVLogger ``metrics.csv`` with their non-empty values as floats."""
    if not path.is_file():
        return []
    rows = []
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            values = {}
            for key, text in row.items():
                if key and text not in (None, ""):
                    try:
                        values[key] = float(text)
                    except ValueError:
                        continue
            rows.append(values)
    return rows


def validation_curve(rows: list[dict[str, float]], curve_metric: str) -> list[dict[str, float]]:
    """One point per validation run: its epoch, step, every ``val/*`` value, the epoch's training
    seconds and ``train_s``, the training seconds spent up to that point: the earlier epochs'
    and, for a validation inside its epoch (``val_check_interval``), the share of its epoch's
    seconds that its steps make."""
    epoch_seconds: dict[int, float] = {}
    epoch_end: dict[int, int] = {}  # the step of each epoch's time row: its last
    for row in rows:
        if EPOCH_TIME in row and "epoch" in row:
            epoch_seconds[int(row["epoch"])] = row[EPOCH_TIME]
            if "step" in row:
                epoch_end[int(row["epoch"])] = int(row["step"])
    points: dict[tuple[int, int], dict[str, float]] = {}
    for row in rows:
        if curve_metric not in row and not any(k.startswith("val/") for k in row):
            continue
        key = (int(row.get("epoch", -1)), int(row.get("step", -1)))
        point = points.setdefault(key, {"epoch": key[0], "step": key[1]})
        point.update({k: v for k, v in row.items() if k.startswith("val/")})
    curve = []
    for (epoch, _), point in sorted(points.items()):
        if curve_metric not in point:
            continue
        earlier = sum(s for e, s in epoch_seconds.items() if e < epoch)
        point["train_s"] = earlier
        if epoch in epoch_seconds:
            point[EPOCH_TIME] = epoch_seconds[epoch]
            point["train_s"] += _epoch_share(epoch, point["step"], epoch_end) * epoch_seconds[epoch]
        curve.append(point)
    return curve


def _epoch_share(epoch: int, step: float, epoch_end: dict[int, int]) -> float:
    """The share of ``epoch``'s steps done at ``step``: 1 at its end, or where its first or
    last step is not known (an epoch before it has no time row)."""
    end = epoch_end.get(epoch)
    start = epoch_end.get(epoch - 1, -1 if epoch == 0 else None)  # the step before its first
    if end is None or start is None or step >= end or end <= start:
        return 1.0
    return max(0.0, (step - start) / (end - start))


def last_values(rows: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """The last logged value of every metric starting with ``prefix`` (e.g. ``test/``)."""
    values: dict[str, float] = {}
    for row in rows:
        values.update({k: v for k, v in row.items() if k.startswith(prefix)})
    return values


def max_regression(curve: list[dict[str, float]], metric: str, mode: str) -> float:
    """The largest relative step back of the validation metric from its best so far: 0 for a
    curve that never gets worse, 0.32 for perplexity 202 -> 268 (a divergence that the loss
    alone, staying finite, does not flag). For ``mode == "max"`` (BLEU) a drop from 30 to 27
    gives 0.1."""
    best, worst = None, 0.0
    for point in curve:
        value = point.get(metric)
        if value is None or not math.isfinite(value):
            return math.inf
        if best is not None and best > 0:
            change = (value - best) / best if mode == "min" else (best - value) / best
            worst = max(worst, change)
        best = value if best is None else (min(best, value) if mode == "min" else max(best, value))
    return worst


def checkpoint_summary(last_checkpoint: Path) -> dict[str, Any]:
    """From a run's ``last.ckpt``: the best checkpoint its ModelCheckpoint kept (path, score,
    monitored key), the epoch and step it stopped at and the number of parameters."""
    checkpoint = torch.load(last_checkpoint, map_location="cpu", weights_only=False)
    summary: dict[str, Any] = {
        "epoch": checkpoint.get("epoch"),
        "global_step": checkpoint.get("global_step"),
    }
    state = checkpoint.get("state_dict", {})
    unique = {t.data_ptr(): t.numel() for t in state.values() if isinstance(t, torch.Tensor)}
    summary["parameters"] = int(sum(unique.values()))
    best = best_checkpoint_state(checkpoint)
    if best is not None:
        score = best.get("best_model_score")
        summary.update(
            best_checkpoint=best["best_model_path"],
            best_score=None if score is None else float(score),
            monitor=best.get("monitor"),
        )
    return summary
