"""Vocabularies: ids sorted by decreasing training frequency (docs/design.md, "Data")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from datamodules.vocab.bpe import BPEVocab
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from datamodules.vocab.word import EOS, UNK, WordVocab

__all__ = [
    "EOS",
    "UNK",
    "BPEVocab",
    "HybridLightRNNVocab",
    "WordVocab",
    "VOCABS",
    "Vocab",
    "vocab_from_state",
    "vocab_over",
]

# the kinds of vocabulary a language-modelling data module serves (``data.vocab``)
VOCABS = ("word", "bpe", "hybrid_lightrnn")
Vocab = WordVocab | BPEVocab | HybridLightRNNVocab


def vocab_from_state(state: dict[str, Any]) -> Vocab:
    """A vocabulary back from its ``state_dict`` (its ``type``: word, bpe or hybrid_lightrnn)."""
    kind = state.get("type", "word")
    if kind == "bpe":
        return BPEVocab.from_state_dict(state)
    if kind == "hybrid_lightrnn":
        return HybridLightRNNVocab.from_state_dict(state)
    return WordVocab.from_state_dict(state)


def vocab_over(base: WordVocab | BPEVocab, kind: str, options: Mapping[str, Any]) -> Vocab:
    """The vocabulary of ``kind`` over a cached ``base`` vocabulary: ``base`` itself (word,
    bpe), or the Hybrid-LightRNN codes of its words, from the data options ``lightrnn_frequent``,
    ``lightrnn_rows``, ``lightrnn_cols``, ``lightrnn_init`` and ``lightrnn_seed``."""
    if kind != "hybrid_lightrnn":
        return base
    return HybridLightRNNVocab.from_words(
        base,
        options["lightrnn_frequent"],
        options["lightrnn_rows"],
        options["lightrnn_cols"],
        options["lightrnn_init"],
        options["lightrnn_seed"],
    )
