"""Every shipped YAML under configs/ parses against the CLI (``--print_config``), so no config
can rot: experiment files on their own, fragments plugged into an experiment of their kind.
Study grids (``configs/studies``) are not CLI configs: the runner's own schema validates them."""

from pathlib import Path

import pytest

from app.lightning_cli import make_cli
from app.study import load_grid
from tests.conftest import REPO

CONFIGS = REPO / "configs"
EXPERIMENTS = ("lm", "mt", "ds")
# a fragment folder -> how to plug a file of it into a host experiment
HOSTS = {
    "heads": ("configs/lm/ptb_softmax.yaml", "--model.head"),
    "backbones": None,  # each is used by some experiment (checked below)
    "data": None,
    "callbacks": None,
    "optimizers": None,
    "presets": ("configs/lm/ptb_softmax.yaml", "--config"),
}
MT_HEADS = "configs/mt/multi30k_softmax.yaml"
STUDIES = "studies"  # grids of python -m app.study, not CLI configs


def shipped(folders) -> list[Path]:
    return sorted(p for folder in folders for p in (CONFIGS / folder).glob("*.yaml"))


def print_config(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        make_cli(["fit", *args, "--print_config"])
    assert done.value.code in (0, None), capsys.readouterr().err[-2000:]
    return capsys.readouterr().out


def test_every_folder_is_known():
    assert {p.name for p in CONFIGS.iterdir() if p.is_dir()} == {*EXPERIMENTS, *HOSTS, STUDIES}


@pytest.mark.parametrize("grid", shipped([STUDIES]), ids=lambda p: f"studies/{p.name}")
def test_study_grid_is_valid(grid):
    loaded = load_grid(grid)
    assert loaded.name == grid.stem and loaded.runs()


@pytest.mark.parametrize("config", shipped(EXPERIMENTS), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_experiment_parses(config, capsys):
    printed = print_config(["--config", str(config.relative_to(REPO))], capsys)
    assert "class_path: heads." in printed and "data:" in printed


@pytest.mark.parametrize(
    "fragment",
    [p for p in shipped(HOSTS) if HOSTS[p.parent.name]],
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_fragment_parses_in_a_host(fragment, capsys):
    host, flag = HOSTS[fragment.parent.name]
    if fragment.stem.endswith("_mt"):
        host = MT_HEADS
    print_config(["--config", host, flag, str(fragment.relative_to(REPO))], capsys)


def test_every_other_fragment_is_used_by_an_experiment():
    used = {
        (config.parent / line.split(":", 1)[1].strip()).resolve()
        for config in shipped(EXPERIMENTS)
        for line in config.read_text().splitlines()
        if line.strip().split(":", 1)[-1].strip().endswith(".yaml") and "#" not in line
    }
    unused = [p for p in shipped(k for k, v in HOSTS.items() if v is None) if p not in used]
    assert not unused, f"fragments no experiment uses (so no test parses): {unused}"
