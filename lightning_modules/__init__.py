"""LightningModules: a backbone plus a pluggable head."""

from lightning_modules.classifier import Classifier
from lightning_modules.language_model import LanguageModel
from lightning_modules.translation import Translation

__all__ = ["Classifier", "LanguageModel", "Translation"]
