"""Vocabularies: ids sorted by decreasing training frequency (DESIGN.md, "Vocabularies")."""

from datamodules.vocab.bpe import BPEVocab
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from datamodules.vocab.word import EOS, UNK, WordVocab

__all__ = ["EOS", "UNK", "BPEVocab", "HybridLightRNNVocab", "WordVocab"]
