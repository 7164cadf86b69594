"""LightningDataModules wrapping HuggingFace ``datasets``."""

from datamodules.language_modeling import LanguageModelingDataModule

__all__ = ["LanguageModelingDataModule"]
