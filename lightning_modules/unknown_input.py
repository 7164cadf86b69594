"""How much of ``predict``'s input the vocabulary does not know, said once at the run's end.

A word the vocabulary lacks is read as ``<unk>``: its prediction (a prompt's next words, a
sentence's translation) then rests on less than the user wrote, and nothing in the output says
so. ``predict`` counts those words (Hybrid-LightRNN: words, not codes; BPE: the pieces, each
``<unk_char>`` of a character it never saw among them) and prints one warning line at its end,
on stderr, apart from the JSON lines on stdout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_only

from datamodules.language_modeling import count_unknown

log = logging.getLogger(__name__)


class UnknownInput:
    """Counts of the input's tokens read as ``<unk>`` over one ``predict`` run."""

    def __init__(self, what: str) -> None:
        self.what = what  # "prompt" or "source sentence"
        self.reset()

    def reset(self) -> None:
        self.unknown = self.tokens = self.lines = self.total_lines = 0

    def add(self, vocab: Any, text: str) -> None:
        """Count one input line's tokens under ``vocab`` (the one the model reads)."""
        units = getattr(vocab, "words", vocab)  # Hybrid-LightRNN codes stand for words
        ids = units.encode_line(text, add_eos=False)
        self.add_counts([count_unknown(vocab, ids)], [len(ids)])

    def add_counts(self, unknown: Sequence[int], tokens: Sequence[int]) -> None:
        """Count lines whose tokens the data module has counted as it encoded them (each
        line's tokens read as ``<unk>``, and its tokens): nothing is encoded again."""
        for line_unknown, line_tokens in zip(unknown, tokens, strict=True):
            self.unknown += line_unknown
            self.tokens += line_tokens
            self.lines += line_unknown > 0
            self.total_lines += 1

    def message(self) -> str | None:
        """The warning line's text, None when every token was known."""
        if not self.unknown:
            return None
        share = 100.0 * self.unknown / max(self.tokens, 1)
        return (
            f"predict: {self.unknown:,} of {self.tokens:,} {self.what} tokens ({share:.2f}%), "
            f"in {self.lines:,} of {self.total_lines:,} lines, were read as <unk> (not in the "
            f"vocabulary, or written <unk>)"
        )

    @rank_zero_only
    def report(self) -> None:
        message = self.message()
        if message is not None:
            log.warning(f"warning: {message}")
