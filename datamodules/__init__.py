"""LightningDataModules wrapping HuggingFace ``datasets``."""

from datamodules.language_modeling import LanguageModelingDataModule
from datamodules.synthetic_hierarchy import SyntheticHierarchyDataModule
from datamodules.translation import TranslationDataModule

__all__ = ["LanguageModelingDataModule", "SyntheticHierarchyDataModule", "TranslationDataModule"]
