"""Backbones: token ids in, context vectors out (the output layer is a separate head)."""

from app.backbones.base import LMBackbone
from app.backbones.lstm import LSTMBackbone
from app.backbones.transformer import TransformerBackbone

__all__ = ["LMBackbone", "LSTMBackbone", "TransformerBackbone"]
