"""Vocabularies: ids sorted by decreasing training frequency (DESIGN.md, "Vocabularies")."""

from app.vocab.word import EOS, UNK, VocabularyMismatchError, WordVocab

__all__ = ["EOS", "UNK", "VocabularyMismatchError", "WordVocab"]
