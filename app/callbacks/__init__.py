"""Lightning callbacks of the app."""

from app.callbacks.epoch_timer import EpochTimer
from app.callbacks.prediction_writer import PredictionWriter
from app.callbacks.throughput import TokenThroughputMonitor

__all__ = ["EpochTimer", "PredictionWriter", "TokenThroughputMonitor"]
