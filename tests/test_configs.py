"""Every shipped YAML under configs/ parses against the CLI (``--print_config``), so no config
can rot: experiment files on their own and with every head fragment of their task, the other
fragments plugged into an experiment of their kind.
Study grids (``configs/studies``) are not CLI configs: the runner's own schema validates them."""

from pathlib import Path

import pytest

from app.cli.lightning_cli import make_cli
from app.study import load_grid
from tests.conftest import REPO

CONFIGS = REPO / "configs"
EXPERIMENTS = ("lm", "mt", "ds")
# a fragment folder -> how to plug a file of it into a host experiment
HOSTS = {
    "backbones": None,  # each is used by some experiment (checked below)
    "data": None,
    "callbacks": None,
    "optimizers": None,
    "presets": ("configs/lm/ptb.yaml", "--config"),
}
STUDIES = "studies"  # grids of python -m app.study, not CLI configs


def shipped(folders) -> list[Path]:
    return sorted(p for folder in folders for p in (CONFIGS / folder).glob("*.yaml"))


# a head fragment named *_mt is for translation, *_awd for the AWD-LSTM settings (any LM parses)
SETTINGS = {task: shipped([task]) for task in ("lm", "mt")}


def print_config(args: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        make_cli(["fit", *args, "--print_config"])
    assert done.value.code in (0, None), capsys.readouterr().err[-2000:]
    return capsys.readouterr().out


def test_every_folder_is_known():
    assert {p.name for p in CONFIGS.iterdir() if p.is_dir()} == {
        *EXPERIMENTS,
        *HOSTS,
        "heads",
        STUDIES,
    }


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
    print_config(["--config", host, flag, str(fragment.relative_to(REPO))], capsys)


def head_combinations() -> list[tuple[Path, Path]]:
    heads = shipped(["heads"])
    return [(setting, head) for task, settings in SETTINGS.items() for setting in settings
            for head in heads if head.stem.endswith("_mt") == (task == "mt")]  # fmt: skip


@pytest.mark.parametrize(
    ("setting", "head"),
    head_combinations(),
    ids=lambda p: f"{p.parent.name}/{p.stem}",
)
def test_every_experiment_parses_with_every_head_of_its_task(setting, head, capsys):
    printed = print_config(["--config", str(setting.relative_to(REPO)),
                            "--model.head", str(head.relative_to(REPO))], capsys)  # fmt: skip
    class_path = next(line for line in head.read_text().splitlines() if "class_path" in line)
    assert class_path.strip() in printed


def test_every_head_fragment_has_an_experiment():
    combined = {head for _, head in head_combinations()}
    assert combined == set(shipped(["heads"])) and len(combined) >= 7


def test_every_other_fragment_is_used_by_an_experiment():
    used = {
        (config.parent / line.split(":", 1)[1].strip()).resolve()
        for config in shipped(EXPERIMENTS)
        for line in config.read_text().splitlines()
        if line.strip().split(":", 1)[-1].strip().endswith(".yaml") and "#" not in line
    }
    unused = [p for p in shipped(k for k, v in HOSTS.items() if v is None) if p not in used]
    assert not unused, f"fragments no experiment uses (so no test parses): {unused}"
