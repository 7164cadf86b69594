"""Lightning callbacks of the app."""

from app.callbacks.ds_monitor import DSMonitor, TopKAccuracy
from app.callbacks.ds_pruning import DSPruning
from app.callbacks.ds_target_classes import DSTargetClasses
from app.callbacks.epoch_timer import EpochTimer
from app.callbacks.lightrnn_reassignment import LightRNNTableReassignment
from app.callbacks.mitosis import Mitosis
from app.callbacks.nt_asgd import NTASGD
from app.callbacks.prediction_writer import PredictionWriter
from app.callbacks.throughput import TokenThroughputMonitor

__all__ = [
    "DSMonitor",
    "DSPruning",
    "DSTargetClasses",
    "EpochTimer",
    "LightRNNTableReassignment",
    "Mitosis",
    "NTASGD",
    "PredictionWriter",
    "TokenThroughputMonitor",
    "TopKAccuracy",
]
