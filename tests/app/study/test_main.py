"""``python -m app.study``: what its commands print and the exit status they give."""

import yaml

from app.study import runner
from app.study.__main__ import main


def test_a_study_stopped_by_a_signal_says_how_to_continue_and_exits_with_it(
    tmp_path, monkeypatch, capsys
):
    grid = tmp_path / "stopped.yaml"
    heads = {"softmax": "configs/heads/softmax.yaml"}
    grid.write_text(yaml.safe_dump(
        {"name": "stopped", "base": "configs/lm/ptb.yaml", "seeds": [1], "heads": heads}
    ))  # fmt: skip
    monkeypatch.setattr(runner._STAGES, "call", lambda args, **kwargs: 143)  # SIGTERM
    assert main(["run", str(grid), "--out", str(tmp_path / "runs")]) == 143
    out, err = capsys.readouterr()
    assert "[1/1] softmax seed 1: INTERRUPTED (fit stopped by a signal (exit status 143))" in out
    assert err.strip() == (
        "interrupted: study 'stopped' stopped with 1 of 1 runs to do: run the same command "
        "again to continue (finished runs are skipped, a cut-short fit resumes from its "
        "last.ckpt)"
    )
