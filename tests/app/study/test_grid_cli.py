"""Every shipped study grid parses against the CLI: every head and variant of the grid (its
first seed), with the grid's overrides, as the runner calls ``cli.py fit``, and a fine-tuning
stage's configs and overrides over the same run."""

import pytest

from app.cli.lightning_cli import make_cli
from app.study import load_grid
from app.study.grid import override_args
from tests.conftest import REPO

GRIDS = sorted(path.stem for path in (REPO / "configs" / "studies").glob("*.yaml"))


def _fit_args(name: str) -> list[list[str]]:
    grid = load_grid(REPO / "configs" / "studies" / f"{name}.yaml")
    calls = []
    for run in grid.runs():
        if run.seed != grid.seeds[0]:
            continue
        args = [a for config in grid.run_base(run) for a in ("--config", config)]
        if run.head.fragment:
            args += ["--model.head", run.head.fragment]
        args += override_args(grid.run_overrides(run))
        calls.append(args)
        if grid.finetune is not None:  # the saved config of the fit stands for the run above
            stage = [a for config in grid.finetune["configs"] for a in ("--config", config)]
            calls.append(args + stage + override_args(grid.finetune["overrides"]))
    return calls


def test_every_shipped_grid_is_checked():
    assert {"tiny_cpu", "ptb_small_cpu", "ptb_awd_paper", "multi30k_base_gpu"} <= set(GRIDS)


@pytest.mark.parametrize("name", GRIDS)
def test_every_run_parses(name, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    for args in _fit_args(name):
        with pytest.raises(SystemExit) as done:
            make_cli(["fit", *args, "--print_config"])
        assert done.value.code in (0, None), capsys.readouterr().err[-2000:]
        printed = capsys.readouterr().out
        assert "class_path: heads." in printed
