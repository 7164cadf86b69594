"""Lightning callbacks of the app, grouped by feature: `ds/` (DS-Softmax), `lightrnn.py`
(Hybrid-LightRNN table re-assignment), `training/` (utilities for every task)."""

from app.callbacks.ds.mitosis import Mitosis
from app.callbacks.ds.monitor import DSMonitor, TopKAccuracy
from app.callbacks.ds.pruning import DSPruning
from app.callbacks.ds.target_classes import DSTargetClasses
from app.callbacks.lightrnn import LightRNNTableReassignment
from app.callbacks.training.checkpoint import ModelCheckpoint
from app.callbacks.training.epoch_timer import EpochTimer
from app.callbacks.training.nt_asgd import NTASGD
from app.callbacks.training.optimum import DataOptimum
from app.callbacks.training.prediction_writer import PredictionWriter
from app.callbacks.training.preemption import PreemptionCheckpoint
from app.callbacks.training.run_record import RunRecord
from app.callbacks.training.throughput import TokenThroughputMonitor
from app.callbacks.training.unknown_words import UnknownWords
from app.callbacks.training.window_lr import WindowLR

__all__ = [
    "DataOptimum",
    "DSMonitor",
    "DSPruning",
    "DSTargetClasses",
    "EpochTimer",
    "LightRNNTableReassignment",
    "Mitosis",
    "ModelCheckpoint",
    "NTASGD",
    "PredictionWriter",
    "PreemptionCheckpoint",
    "RunRecord",
    "TokenThroughputMonitor",
    "TopKAccuracy",
    "UnknownWords",
    "WindowLR",
]
