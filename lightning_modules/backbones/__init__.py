"""Backbones: token ids in, context vectors out (the output layer is a separate head)."""

from lightning_modules.backbones.awd_lstm import AWDLSTMBackbone
from lightning_modules.backbones.base import LMBackbone
from lightning_modules.backbones.lstm import LSTMBackbone
from lightning_modules.backbones.mlp import MLPBackbone
from lightning_modules.backbones.ngram import NGramBackbone
from lightning_modules.backbones.seq2seq import Seq2SeqTransformer
from lightning_modules.backbones.transformer import TransformerBackbone

__all__ = [
    "AWDLSTMBackbone",
    "LMBackbone",
    "LSTMBackbone",
    "MLPBackbone",
    "NGramBackbone",
    "Seq2SeqTransformer",
    "TransformerBackbone",
]
