"""LightningModules: a backbone plus a pluggable head."""

from lightning_modules.language_model import LanguageModel

__all__ = ["LanguageModel"]
