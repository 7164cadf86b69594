"""Lightning callbacks of the app."""

from app.callbacks.ds_monitor import DSMonitor, TopKAccuracy
from app.callbacks.ds_pruning import DSPruning
from app.callbacks.ds_target_classes import DSTargetClasses
from app.callbacks.epoch_timer import EpochTimer
from app.callbacks.lightrnn_reassignment import LightRNNTableReassignment
from app.callbacks.mitosis import Mitosis
from app.callbacks.nt_asgd import NTASGD
from app.callbacks.prediction_writer import PredictionWriter
from app.callbacks.preemption import PreemptionCheckpoint
from app.callbacks.run_record import RunRecord
from app.callbacks.throughput import TokenThroughputMonitor
from app.callbacks.unknown_words import UnknownWords

__all__ = [
    "DSMonitor",
    "DSPruning",
    "DSTargetClasses",
    "EpochTimer",
    "LightRNNTableReassignment",
    "Mitosis",
    "NTASGD",
    "PredictionWriter",
    "PreemptionCheckpoint",
    "RunRecord",
    "TokenThroughputMonitor",
    "TopKAccuracy",
    "UnknownWords",
]
