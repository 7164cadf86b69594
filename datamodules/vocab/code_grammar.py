"""Which code may follow which in a Hybrid-LightRNN code stream.

A word is one frequent word's code, or a row code then a column code whose cell holds a word
(the table ``A`` of the paper: the off-diagonal blocks and the unused cells are the invalid
pairs). A model puts some probability on invalid continuations; a decoder or sampler that
masks them (:meth:`CodeGrammar.restrict`) produces code sequences that always decode to words,
never to the ``<unk>`` of a broken pair. Built by ``HybridLightRNNVocab.grammar``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CodeGrammar:
    """The allowed next codes, as masks over the ``V`` codes.

    is_row: ``[V]`` bool, the row codes.
    row_of: ``[V]`` long, a row code's row (0 for other codes).
    word_start: ``[V]`` bool, the codes allowed where a word begins (after a frequent word's
        code or a column code, and at the start): frequent words' codes and the rows that
        hold a word.
    columns: ``[rows, V]`` bool, the column codes allowed after each row: its occupied cells.
    """

    is_row: torch.Tensor
    row_of: torch.Tensor
    word_start: torch.Tensor
    columns: torch.Tensor

    def to(self, device: torch.device | str) -> CodeGrammar:
        return CodeGrammar(*(t.to(device) for t in (self.is_row, self.row_of,
                                                    self.word_start, self.columns)))  # fmt: skip

    def allowed_after(self, previous: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` bool: the codes that may follow each code of ``previous`` ``[...]``."""
        after_row = self.columns[self.row_of[previous]]
        return torch.where(self.is_row[previous].unsqueeze(-1), after_row, self.word_start)

    def restrict(
        self,
        log_probs: torch.Tensor,
        previous: torch.Tensor,
        closing: torch.Tensor | None = None,
        fallback: bool = True,
    ) -> torch.Tensor:
        """``log_probs`` ``[..., V]`` with the codes that may not follow ``previous`` at
        ``-inf`` (not renormalised: a kept code keeps the model's probability).

        ``closing`` ``[...]`` bool: rows whose next code is the last before a forced
        ``<eos>`` (a decoder's length limit), which must end a word: no row code there (a row
        then ``<eos>`` would be the ``<unk>`` of a broken pair). ``fallback``: a row whose
        allowed codes all have probability 0 (a DS-Softmax expert without them) gets them all
        at 0 instead, so that a sampler or greedy decoder still has a valid choice; a search
        takes ``False`` and lets such a hypothesis end there (at 0 it would cost nothing)."""
        allowed = self.allowed_after(previous)
        if closing is not None:
            allowed = allowed & ~(closing.unsqueeze(-1) & self.is_row)
        kept = log_probs.masked_fill(~allowed, float("-inf"))
        if not fallback:
            return kept
        hopeless = kept.isneginf().all(-1, keepdim=True)
        return torch.where(hopeless & allowed, torch.zeros_like(kept), kept)
