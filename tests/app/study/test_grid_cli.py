"""The study grids of issue 31 parse against the CLI: every head and variant of the grid (its
first seed), with the grid's overrides, as the runner would call ``cli.py fit``."""

import pytest

from app.cli.lightning_cli import make_cli
from app.study import load_grid
from app.study.grid import override_args
from tests.conftest import REPO

GRIDS = ("markov_bottleneck_cpu", "ptb_medium_gpu_10min")


def _fit_args(name: str) -> list[list[str]]:
    grid = load_grid(REPO / "configs" / "studies" / f"{name}.yaml")
    calls = []
    for run in grid.runs():
        if run.seed != grid.seeds[0]:
            continue
        args = [a for config in grid.run_base(run) for a in ("--config", config)]
        if run.head.fragment:
            args += ["--model.head", run.head.fragment]
        calls.append(args + override_args(grid.run_overrides(run)))
    return calls


@pytest.mark.parametrize("name", GRIDS)
def test_every_run_parses(name, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    for args in _fit_args(name):
        with pytest.raises(SystemExit) as done:
            make_cli(["fit", *args, "--print_config"])
        assert done.value.code in (0, None), capsys.readouterr().err[-2000:]
        printed = capsys.readouterr().out
        assert "class_path: heads." in printed
