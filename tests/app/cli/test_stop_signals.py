"""A signal while the data is prepared (before the training loop, whose own stop saves a
checkpoint): one line and 128 + the signal, through ``cli.py``'s entry point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app.cli.console import INTERRUPTED

ROOT = Path(__file__).resolve().parents[3]

# cli.console_main with a fit whose prepare_data (inside Trainer.fit, as a corpus's
# tokenising is) receives the signal
_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel
    import cli

    # as in a terminal: a job started in the background inherits SIGINT ignored, and Python
    # then installs no handler of its own (the test would measure how it was launched)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    class Preparing(BoringDataModule):
        def prepare_data(self):
            os.kill(os.getpid(), signal.{name})
            time.sleep(10)  # (the handler raises before this ends)
            print("NOT STOPPED")

    def main(argv=None):
        trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(BoringModel(), datamodule=Preparing())

    cli.main = main
    sys.exit(cli.console_main([]))
    """
)


@pytest.mark.parametrize(
    ("name", "said"),
    [("SIGTERM", "terminated (SIGTERM)"), ("SIGINT", "interrupted (Ctrl+C)")],
)
def test_a_signal_while_the_data_is_prepared_is_one_line(name: str, said: str) -> None:
    """SIGTERM ended the process silently (no line); Ctrl+C inside Trainer.fit was Lightning's
    "Detected KeyboardInterrupt" and exit status 1 instead of 130."""
    env = {k: v for k, v in os.environ.items() if k != "OUTPUT_HEADS_TRACEBACK"}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(name=name)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    signum = getattr(signal, name)
    assert done.returncode == 128 + signum, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == f"{said}: {INTERRUPTED}", done.stderr
    assert "KeyboardInterrupt" not in done.stderr and "NOT STOPPED" not in done.stdout


def test_sigterm_in_an_evaluation_is_one_line_and_status_143(capsys, monkeypatch):
    """Lightning stops validate, test and predict on SIGTERM with a SystemExit of status 0: a
    killed ``predict > out.jsonl`` read as a success, without a word. A fit's stop
    (PreemptionCheckpoint: its status and line) is left alone."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from app.cli.console import EVALUATION_STOPPED, TRACEBACK_ENV, exit_status

    monkeypatch.delenv(TRACEBACK_ENV, raising=False)

    def evaluating() -> int:
        raise SIGTERMException

    assert exit_status(evaluating) == 143
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"terminated (SIGTERM): {EVALUATION_STOPPED}"]

    def fitting() -> int:
        raise SIGTERMException(143)

    with pytest.raises(SIGTERMException) as stopped:
        exit_status(fitting)
    assert stopped.value.code == 143 and capsys.readouterr().err == ""
