"""Vocabularies: ids sorted by decreasing training frequency (DESIGN.md, "Vocabularies")."""

from app.vocab.bpe import BPEVocab
from app.vocab.hybrid_lightrnn import HybridLightRNNVocab
from app.vocab.word import EOS, UNK, VocabularyMismatchError, WordVocab

__all__ = ["EOS", "UNK", "BPEVocab", "HybridLightRNNVocab", "VocabularyMismatchError", "WordVocab"]
