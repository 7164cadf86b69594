"""Vocabularies: ids sorted by decreasing training frequency (DESIGN.md, "Vocabularies")."""

from __future__ import annotations

from typing import Any

from datamodules.vocab.bpe import BPEVocab
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from datamodules.vocab.word import EOS, UNK, WordVocab

__all__ = ["EOS", "UNK", "BPEVocab", "HybridLightRNNVocab", "WordVocab", "vocab_from_state"]


def vocab_from_state(state: dict[str, Any]) -> WordVocab | BPEVocab | HybridLightRNNVocab:
    """A vocabulary back from its ``state_dict`` (its ``type``: word, bpe or hybrid_lightrnn)."""
    kind = state.get("type", "word")
    if kind == "bpe":
        return BPEVocab.from_state_dict(state)
    if kind == "hybrid_lightrnn":
        return HybridLightRNNVocab.from_state_dict(state)
    return WordVocab.from_state_dict(state)
