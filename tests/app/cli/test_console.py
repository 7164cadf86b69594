"""The entry points' exit path (app/cli/console.py)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from app.cli.console import (
    APP_LOGGERS,
    INTERRUPTED,
    TRACEBACK_ENV,
    exit_status,
    quiet_lightning,
    show_app_log,
)
from heads.errors import UserError


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "user-error"])
def test_exit_destroys_the_gloo_group(fails: bool) -> None:
    """A Gloo group left to interpreter finalisation can abort the process (exit -6 instead of
    2 in a DDP run that met a NaN): the exit path destroys it while Python is whole."""

    def run() -> int:
        # a world of one meets at a store in this process: a port probed free and bound later
        # can be taken in between (EADDRINUSE on a busy machine)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.is_initialized()
        if fails:
            raise UserError("bad config")
        return 0

    assert exit_status(run) == (2 if fails else 0)
    assert not dist.is_initialized()


def test_exit_without_a_group_is_untouched() -> None:
    assert exit_status(lambda: 3) == 3
    assert not dist.is_initialized()


def test_ctrl_c_outside_the_training_loop_is_one_line_and_status_130(capsys, monkeypatch):
    """E.g. while a large corpus is being prepared (the training loop has its own: a checkpoint)."""
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)

    def preparing() -> int:
        raise KeyboardInterrupt

    assert exit_status(preparing) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"interrupted (Ctrl+C): {INTERRUPTED}"]
    monkeypatch.setenv(TRACEBACK_ENV, "1")  # the traceback, on request
    with pytest.raises(KeyboardInterrupt):
        exit_status(preparing)


def test_lightning_s_advertisement_and_mixed_precision_summary_warning_are_quiet(caplog):
    quiet_lightning()
    quiet_lightning()  # idempotent: one filter
    assert len(logging.getLogger("lightning.pytorch.utilities.rank_zero").filters) == 1
    with caplog.at_level(logging.INFO):
        rank_zero_info("💡 Tip: For seamless cloud logging, try installing ...")
        rank_zero_info("GPU available: False, used: False")
    assert [r.getMessage() for r in caplog.records] == ["GPU available: False, used: False"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_lightning()  # its filter on top of "always"
        for precision in ("bf16-mixed", "16-mixed", "transformer-engine"):
            message = f"Precision {precision} is not supported by the model summary. ..."
            warnings.warn(message, stacklevel=1)
    assert [str(w.message)[:30] for w in caught] == ["Precision transformer-engine i"]


def test_the_heads_and_tasks_decisions_are_printed_like_the_data_s(monkeypatch):
    """The CLI prints the INFO lines of every layer below it (the adaptive softmax's cut-offs
    were logged but never shown): a handler of its own where the root logger has none."""
    for name in APP_LOGGERS:  # as a fresh process: no handler, propagating
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", [])
        monkeypatch.setattr(logger, "propagate", True)
        monkeypatch.setattr(logger, "level", logging.NOTSET)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # pytest's capture removed
    show_app_log()
    for name in ("datamodules.cache", "heads.adaptive", "lightning_modules.head_task"):
        logger = logging.getLogger(name)
        assert logger.isEnabledFor(logging.INFO) and not logger.isEnabledFor(logging.DEBUG)
        assert any(isinstance(h, logging.StreamHandler) for h in logger.parent.handlers)
