"""LightningDataModules wrapping HuggingFace ``datasets``."""

from datamodules.language_modeling import LanguageModelingDataModule
from datamodules.markov_chain import MarkovChainDataModule
from datamodules.synthetic_hierarchy import SyntheticHierarchyDataModule
from datamodules.translation import TranslationDataModule

__all__ = [
    "LanguageModelingDataModule",
    "MarkovChainDataModule",
    "SyntheticHierarchyDataModule",
    "TranslationDataModule",
]
