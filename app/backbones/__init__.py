"""Backbones: token ids in, context vectors out (the output layer is a separate head)."""

from app.backbones.base import LMBackbone
from app.backbones.lstm import LSTMBackbone
from app.backbones.mlp import MLPBackbone
from app.backbones.seq2seq import Seq2SeqTransformer
from app.backbones.transformer import TransformerBackbone

__all__ = ["LMBackbone", "LSTMBackbone", "MLPBackbone", "Seq2SeqTransformer", "TransformerBackbone"]
