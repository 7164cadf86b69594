"""Training utilities for every task: timing and throughput, NT-ASGD, checkpoints on
pre-emption, the run record, prediction output, unknown-word counts, failure injection."""

from app.callbacks.training.window_lr import WindowLR

__all__ = ["WindowLR"]
