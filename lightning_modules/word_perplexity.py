"""Word-level perplexity over code targets (BPE pieces, Hybrid-LightRNN codes): the summed code
NLL over the number of words, a word counted at each target code that starts one (the data
module's ``word_start_mask``). Per-code perplexities of different vocabularies do not compare;
per-word ones do. The sums are kept apart per stage (a window may hold code NLLs but no word
start) and read back only when an epoch ends."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torchmetrics import SumMetric

from heads import IGNORE_INDEX
from lightning_modules.weighted_mean import FloatSums


class WordSum(FloatSums, SumMetric):
    """torchmetrics' ``SumMetric`` summed in float32, or float64 under ``64-true``
    (:class:`~lightning_modules.weighted_mean.FloatSums`): under ``bf16-true`` its sum was
    bfloat16, where an epoch's code NLLs stop adding up, and under ``64-true`` float32."""

    def update(self, value: torch.Tensor | float) -> None:
        if isinstance(value, torch.Tensor):
            self.promote_for(value)
        super().update(value)


def word_sums(stages: Iterable[str]) -> torch.nn.ModuleDict:
    """``{stage}_nll`` and ``{stage}_words`` sums of each stage. ``nan_strategy="disable"``:
    the default ("warn"; "ignore" alike) tests ``isnan(x).any()`` in every update, a host sync
    per step; a NaN loss stops the run anyway (``check_finite_loss``). (Not for weighted
    means: there it drops the weights, ``lightning_modules/weighted_mean.py``.)"""
    return torch.nn.ModuleDict(
        {
            f"{s}_{part}": WordSum(nan_strategy="disable")
            for s in stages
            for part in ("nll", "words")
        }
    )


def word_starts(trainer: Any, device: torch.device) -> torch.Tensor | None:
    """The data module's ``[vocab_size]`` bool mask of codes that start a word, on ``device``;
    None where its targets are words (no such mask)."""
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    mask = getattr(datamodule, "word_start_mask", None)
    return None if mask is None else mask.to(device)


def update_word_sums(
    sums: torch.nn.ModuleDict,
    stage: str,
    starts: torch.Tensor,
    nll: torch.Tensor,
    targets: torch.Tensor,
) -> None:
    """Add a batch's per-token ``nll`` ``[N]`` and the words its ``targets`` ``[N]`` start."""
    valid = targets != IGNORE_INDEX
    sums[f"{stage}_nll"].update(nll.sum())
    sums[f"{stage}_words"].update((starts[targets.clamp(min=0)] & valid).sum())


def word_perplexity(sums: torch.nn.ModuleDict, stage: str) -> torch.Tensor:
    """The stage's word perplexity so far; its sums are reset."""
    nll, words = (sums[f"{stage}_{part}"] for part in ("nll", "words"))
    word_nll = nll.compute() / words.compute().clamp(min=1)
    nll.reset()
    words.reset()
    return word_nll.exp()
