"""Lightning's progress bar without a host-device sync per batch.

Lightning converts every metric logged with ``prog_bar=True`` to a Python number after each
batch, to show it: each conversion reads a device tensor back to the host (``Tensor.item``),
on a GPU a sync, which holds the host until the device has run the whole step, so the host
cannot queue the next step while the device runs this one. A small step (a PTB batch) is
launch-bound, and that overlap is most of its speed. So the tasks log their per-batch
``train/loss`` without ``prog_bar``, and the bars here show it (and whatever else is named in
``shown``) from the trainer's callback metrics at the logging interval
(``Trainer.log_every_n_steps``, where the loggers read it anyway) and at an epoch's end; their
counts move every batch as Lightning's do. :func:`interval_progress_bar` picks the kind Lightning
would (Rich where installed, else TQDM); the app's CLI uses it unless the trainer is given
another progress bar or none.

The bars draw on stderr, not on Lightning's stdout (the Rich one keeps stdout where it is a
terminal): stdout is the run's output (``predict``'s JSON lines, ``python cli.py predict ... >
translations.jsonl``), and a bar there ended up in the file.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress import rich_progress
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.loggers.utilities import _version

from app.callbacks.training.logging_steps import logs_this_batch


class IntervalMetrics:
    """The bars' shared part: ``get_metrics`` adds the ``shown`` callback metrics, read back
    only after the training batches whose metrics Lightning logs (:func:`logs_this_batch`)
    and an epoch's last, and outside a training batch (an epoch's or a validation's end), else
    their last values."""

    def __init__(self, *args: Any, shown: Sequence[str] = ("train/loss",), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shown = tuple(shown)
        self._values: dict[str, float] = {}
        self._read = True

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        if isinstance(metrics.get("v_num"), int):  # the run's folder, not "0.000" (Rich)
            metrics["v_num"] = str(metrics["v_num"])
        elif isinstance(metrics.get("v_num"), str):  # a version given by name: a resumed run's
            # Lightning shows its last 4 characters ("version_10" as "n_10"): its number
            named = re.fullmatch(r"version_(\d+)", str(_version(trainer.loggers)))
            metrics["v_num"] = named.group(1) if named else metrics["v_num"]
        for name, value in metrics.items():  # counts (`*/num_*`: ds/num_experts) as "4"
            if name.rpartition("/")[2].startswith("num_") and isinstance(value, float):
                metrics[name] = str(round(value)) if value.is_integer() else value
        if self._read:  # a read-back each
            for name in self.shown:
                value = trainer.callback_metrics.get(name)
                if value is not None:
                    self._values[name] = float(value)
        return {**metrics, **self._values}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:  # fmt: skip
        self._read = logs_this_batch(trainer) or batch_idx + 1 == trainer.num_training_batches
        try:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        finally:
            self._read = True


def _made_on_stderr(init: Callable[[Any], Tqdm]) -> Callable[[Any], Tqdm]:
    """A TQDM bar maker whose bar writes to stderr: Lightning's name ``sys.stdout`` as their
    file when they are made, so each is made while stdout is stderr."""

    @functools.wraps(init)
    def made(self: Any) -> Tqdm:
        with contextlib.redirect_stdout(sys.stderr):
            return init(self)

    return made


class IntervalTQDMProgressBar(IntervalMetrics, TQDMProgressBar):
    """Lightning's TQDM bar, its metrics read at the logging interval, on stderr."""

    init_sanity_tqdm = _made_on_stderr(TQDMProgressBar.init_sanity_tqdm)
    init_train_tqdm = _made_on_stderr(TQDMProgressBar.init_train_tqdm)
    init_predict_tqdm = _made_on_stderr(TQDMProgressBar.init_predict_tqdm)
    init_validation_tqdm = _made_on_stderr(TQDMProgressBar.init_validation_tqdm)
    init_test_tqdm = _made_on_stderr(TQDMProgressBar.init_test_tqdm)


class IntervalRichProgressBar(IntervalMetrics, RichProgressBar):
    """Lightning's Rich bar, its metrics read at the logging interval, on stderr."""

    def _init_progress(self, trainer: L.Trainer) -> None:
        if _is_terminal(sys.stdout):  # output and bar share it, as Lightning draws them
            super()._init_progress(trainer)
            return
        # Lightning draws on Rich's global console (stdout), and routes what is printed to
        # stdout meanwhile through it: this bar draws on a console of its own on stderr and
        # leaves stdout alone (and the global console, for Lightning's result tables)
        console = rich_progress.Console(**{"stderr": True, **self._console_kwargs})
        progress = functools.partial(rich_progress.CustomProgress, redirect_stdout=False)
        with mock.patch.multiple(
            rich_progress,
            get_console=lambda: console,
            reconfigure=lambda **_: None,
            CustomProgress=progress,
        ):
            super()._init_progress(trainer)


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def interval_progress_bar() -> ProgressBar:
    """The bar Lightning would show by default (Rich where installed, else TQDM), its metrics
    read at the logging interval."""
    if importlib.util.find_spec("rich") is not None:
        return IntervalRichProgressBar()
    return IntervalTQDMProgressBar()


@contextlib.contextmanager
def side_progress(trainer: L.Trainer, description: str, total: int) -> Iterator[Callable[[], None]]:
    """A bar for work a callback does between the loops (a pass over the training data), shown
    by the trainer's own progress bar: a task of its Rich display (printing beside a live Rich
    display would garble it), or a TQDM bar under the main one. Yields ``advance()``, one step;
    with no enabled bar (``enable_progress_bar: false``, DDP ranks other than 0) it does nothing."""
    bar = trainer.progress_bar_callback
    if isinstance(bar, RichProgressBar) and bar.is_enabled and bar.progress is not None:
        progress = bar.progress
        task = progress.add_task(description, total=total)
        try:
            yield lambda: progress.update(task, advance=1)
        finally:
            progress.remove_task(task)
    elif isinstance(bar, TQDMProgressBar) and bar.is_enabled:
        position = 2 * bar.process_position + 1
        tqdm_bar = Tqdm(desc=description, total=total, position=position, leave=False,
                        dynamic_ncols=True, file=sys.stderr)  # fmt: skip
        try:
            yield lambda: tqdm_bar.update(1)
        finally:
            tqdm_bar.close()
    else:
        yield lambda: None
