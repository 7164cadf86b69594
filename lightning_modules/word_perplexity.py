"""Word-level perplexity over code targets (BPE pieces, Hybrid-LightRNN codes): the summed code
NLL over the number of words, a word counted at each target code that starts one (the data
module's ``word_start_mask``). Per-code perplexities of different vocabularies do not compare;
per-word ones do. The sums are kept apart per stage (a window may hold code NLLs but no word
start) and read back only when an epoch ends.

Over Hybrid-LightRNN codes the code model (MoS-BPE/LightRNN Eq. 4) also puts mass on code
sequences that spell no word (a column first; after a row, a non-column or an empty cell), so
its word probabilities sum to less than 1 and ``word_ppl`` is an upper bound: the paper's
figure, what a reproduction compares. Evaluation also sums the NLL of the same model restricted
to valid code sequences (:func:`renormalised_nll`): each code's distribution renormalised over
the codes the grammar allows after the previous one,

    P~(frequent f | c) = P(f | c) / S(c)
    P~((r, x) | c)     = P(r | c) / S(c) * P(x | c, r) / S_r(c, r)

with ``S(c)`` the mass of the codes that may start a word (frequent words' codes and the rows
holding a word) and ``S_r`` the mass of row r's occupied columns. These sum to 1 over the words
(the test writes the sum out on a tiny table), each word's is at least its unrenormalised
probability (so ``word_ppl_renorm <= word_ppl``), and it is the distribution the grammar-masked
sampler draws from. It needs no model step beyond the data's (renormalising each word by its
own total ``sum_w P(w | c)`` instead would read the column distribution after every row: d1
more steps a word). Logged as ``{stage}/word_ppl_renorm`` for validation and test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torchmetrics import SumMetric

from datamodules.vocab.code_grammar import CodeGrammar
from heads import IGNORE_INDEX
from lightning_modules.weighted_mean import FloatSums

# The stages whose renormalised word NLL is summed: evaluation only (a training step would pay
# a second full pass of its head for a figure its loss does not use).
RENORMALISED_STAGES = ("val", "test")
# Elements of one [rows, codes] chunk of log-probabilities while renormalising: 16 MiB of
# float32 whatever the batch (a translation batch of 4k target codes over 3k codes is 3 chunks).
_CHUNK_ELEMENTS = 1 << 22


class WordSum(FloatSums, SumMetric):
    """torchmetrics' ``SumMetric`` summed in float32, or float64 under ``64-true``
    (:class:`~lightning_modules.weighted_mean.FloatSums`): under ``bf16-true`` its sum was
    bfloat16, where an epoch's code NLLs stop adding up, and under ``64-true`` float32."""

    def update(self, value: torch.Tensor | float) -> None:
        if isinstance(value, torch.Tensor):
            self.promote_for(value)
        super().update(value)


def word_sums(stages: Iterable[str]) -> torch.nn.ModuleDict:
    """``{stage}_nll`` and ``{stage}_words`` sums of each stage, and ``{stage}_renorm`` (the
    renormalised code NLL, :func:`update_renormalised_sums`) of the evaluation stages among
    them. ``nan_strategy="disable"``: the default ("warn"; "ignore" alike) tests
    ``isnan(x).any()`` in every update, a host sync per step; a NaN loss stops the run anyway
    (``check_finite_loss``). (Not for weighted means: there it drops the weights,
    ``lightning_modules/weighted_mean.py``.)"""
    stages = list(stages)
    parts = {f"{s}_{part}" for s in stages for part in ("nll", "words")}
    parts |= {f"{s}_renorm" for s in stages if s in RENORMALISED_STAGES}
    return torch.nn.ModuleDict({name: WordSum(nan_strategy="disable") for name in sorted(parts)})


def word_starts(trainer: Any, device: torch.device) -> torch.Tensor | None:
    """The data module's ``[vocab_size]`` bool mask of codes that start a word, on ``device``;
    None where its targets are words (no such mask)."""
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    mask = getattr(datamodule, "word_start_mask", None)
    return None if mask is None else mask.to(device)


def code_grammar(trainer: Any, device: torch.device) -> CodeGrammar | None:
    """The grammar of the data module's coded targets (a language model's ``vocab``, a
    translation's ``target_vocab``) under its installed table, on ``device``; None where the
    targets have none (words, BPE). Cheap to call every step: the vocabulary keeps it until its
    table changes."""
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    vocab = getattr(datamodule, "target_vocab", None)
    vocab = getattr(datamodule, "vocab", None) if vocab is None else vocab
    grammar = getattr(vocab, "grammar", None)
    return grammar(device) if callable(grammar) else None


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


def renormalised_nll(
    log_probs: torch.Tensor,
    previous: torch.Tensor,
    targets: torch.Tensor,
    grammar: CodeGrammar,
) -> torch.Tensor:
    """``-log P~(target | context)`` ``[N]`` (0 where ``targets`` is ignored): the code's
    log-probability ``log_probs`` ``[N, V]`` renormalised over the codes ``grammar`` allows
    after ``previous`` ``[N]`` (the input code at each position). Summed over a word's codes it
    is ``-log`` of the word's renormalised probability (the module docstring)."""
    allowed = grammar.allowed_after(previous)
    log_valid_mass = log_probs.masked_fill(~allowed, float("-inf")).logsumexp(-1)
    own = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(targets != IGNORE_INDEX, log_valid_mass - own, torch.zeros_like(own))


def update_renormalised_sums(
    sums: torch.nn.ModuleDict,
    stage: str,
    log_prob: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    previous: torch.Tensor,
    targets: torch.Tensor,
    grammar: CodeGrammar,
) -> None:
    """Add a batch's renormalised code NLL (:func:`renormalised_nll`) to ``{stage}_renorm``.

    ``log_prob``: the head's distribution (``Head.training_log_prob``: the one its loss, hence
    ``word_ppl``, scores), run here on ``hidden`` ``[N, d]`` in row chunks of at most 16 MiB of
    log-probabilities, under ``no_grad``. Every row is scored and the ignored ones zeroed
    (selecting the kept rows would read their count back to the host); the sum stays on the
    device until the epoch's end."""
    if stage not in RENORMALISED_STAGES:
        return
    rows = max(1, _CHUNK_ELEMENTS // max(grammar.is_row.numel(), 1))
    total = None
    with torch.no_grad():
        for start in range(0, hidden.size(0), rows):
            stop = start + rows
            log_probs = log_prob(hidden[start:stop])
            if log_probs.dtype != torch.float64:
                log_probs = log_probs.float()  # a bf16 head's log-probs summed in float32
            part = renormalised_nll(log_probs, previous[start:stop], targets[start:stop], grammar)
            total = part.sum() if total is None else total + part.sum()
    if total is not None:
        sums[f"{stage}_renorm"].update(total)


def word_perplexity(sums: torch.nn.ModuleDict, stage: str) -> torch.Tensor:
    """The stage's word perplexity so far; its sums are reset."""
    nll, words = (sums[f"{stage}_{part}"] for part in ("nll", "words"))
    word_nll = nll.compute() / words.compute().clamp(min=1)
    nll.reset()
    words.reset()
    return word_nll.exp()


def word_perplexities(
    sums: torch.nn.ModuleDict, stage: str, renormalised: bool
) -> dict[str, torch.Tensor]:
    """``{"word_ppl": ...}`` of the stage and, where ``renormalised`` (the targets have a code
    grammar, :func:`code_grammar`, and the stage sums renormalised NLLs), ``"word_ppl_renorm"``;
    both over the same word count, the sums reset. ``renormalised`` is the task's to say, alike
    on every rank: reading a sum is a collective under DDP, so a rank that saw no batch must
    read it too (deciding by its own updates would leave the others waiting)."""
    out: dict[str, torch.Tensor] = {}
    renorm = sums[f"{stage}_renorm"] if f"{stage}_renorm" in sums else None
    if renorm is not None and renormalised:
        words = sums[f"{stage}_words"].compute().clamp(min=1)
        out["word_ppl_renorm"] = (renorm.compute() / words).exp()
    if renorm is not None:
        renorm.reset()
    out["word_ppl"] = word_perplexity(sums, stage)
    return out
