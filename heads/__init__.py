"""Output layers behind one contract (see heads/base.py and docs/design.md)."""

from heads.adaptive import AdaptiveSoftmaxHead
from heads.base import IGNORE_INDEX, Head, HeadOutput, HeadSetup
from heads.ds.softmax import DSSoftmaxHead
from heads.errors import HeadConfigError, UserError
from heads.mixtape import MixtapeHead
from heads.mos import MoSHead
from heads.softmax import SoftmaxHead

__all__ = [
    "AdaptiveSoftmaxHead",
    "DSSoftmaxHead",
    "IGNORE_INDEX",
    "Head",
    "HeadConfigError",
    "HeadOutput",
    "HeadSetup",
    "MixtapeHead",
    "MoSHead",
    "SoftmaxHead",
    "UserError",
]
