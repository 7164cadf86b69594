import lzma
import os
import sys
from pathlib import Path

import pytest
import torch

# Without CUDA, Triton kernels (an optional extra) run under Triton's interpreter: chosen before
# Triton is first imported (Lightning imports it), whose library functions are decorated then
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from datamodules.text_source import CORPORA
from heads.user_cache import CACHE_ENV

REPO = Path(__file__).resolve().parents[1]
# The experiments the tests run, as command-line arguments: a setting (configs/lm, configs/mt)
# with a head fragment where it is not the setting's default softmax.
_LM, _MT, _HEAD = (
    ["--config", "configs/lm/ptb.yaml"],
    ["--config", "configs/mt/multi30k.yaml"],
    "--model.head",
)
EXPERIMENTS = {
    "ptb_softmax": _LM,
    "ptb_mos": [*_LM, _HEAD, "configs/heads/mos.yaml"],
    "ptb_mixtape": [*_LM, _HEAD, "configs/heads/mixtape.yaml"],
    "ptb_adaptive": [
        *_LM,
        _HEAD,
        "configs/heads/adaptive_ptb.yaml",
        "--model.tie_weights",
        "false",
    ],
    "multi30k_softmax": _MT,
    "multi30k_mos": [*_MT, _HEAD, "configs/heads/mos_mt.yaml"],
    "multi30k_mixtape": [*_MT, _HEAD, "configs/heads/mixtape_mt.yaml"],
}
PTB = CORPORA / "ptb"  # shipped with the project, xz-compressed
MULTI30K = CORPORA / "multi30k"


def shipped_text(path: Path) -> str:
    """A shipped corpus file's text, read plainly with the standard library (a reference
    independent of the data modules' reader)."""
    with lzma.open(path, "rt", encoding="utf-8", newline="") as handle:
        return handle.read()


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory) -> Path:
    """Prepared corpora, cost models and built kernels go to a folder of this test session,
    never the user's cache; the ``cli.py`` subprocesses (and their DDP ranks) inherit it. So
    do HF datasets' Arrow builds: a test corpus in the hub's layout (a folder named
    ``wikitext``) must not become the copy that ``--data.hub wikitext`` loads offline."""
    import datasets.config

    root = tmp_path_factory.mktemp("user-cache")
    os.environ[CACHE_ENV] = str(root)
    hf_datasets = root / "hf-datasets"
    os.environ["HF_DATASETS_CACHE"] = str(hf_datasets)
    datasets.config.HF_DATASETS_CACHE = hf_datasets  # read when a dataset is built
    return root


@pytest.fixture
def cli_argv(monkeypatch):
    """``sys.argv`` as ``python cli.py`` has it, not pytest's (LightningCLI reads it); for
    tests that run the CLI in-process (``pytestmark = pytest.mark.usefixtures("cli_argv")``)."""
    monkeypatch.setattr(sys, "argv", ["cli.py"])


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """``cli_run(subcommand, *args, experiment=None, console=False)`` runs ``python cli.py
    subcommand --trainer.default_root_dir ROOT *EXPERIMENTS[experiment] *args`` in-process:
    ``cli.main`` (its ``AppCLI`` returned) or, with ``console``, ``cli.console_main`` (its exit
    status returned, errors printed as one line). ROOT, where a run without a logger would
    write its files, is a temporary folder of the test module, never the repository; ``sys.argv`` is
    ``python cli.py``'s during the run. Module-scoped, so module fixtures can train with it."""
    from cli import console_main, main

    root = str(tmp_path_factory.mktemp("cli-root"))

    def run(subcommand: str, *args: str, experiment: str | None = None, console: bool = False):
        setting = EXPERIMENTS[experiment] if experiment is not None else []
        argv = [subcommand, "--trainer.default_root_dir", root, *setting, *args]
        saved, sys.argv = sys.argv, ["cli.py"]
        try:
            return (console_main if console else main)(argv)
        finally:
            sys.argv = saved

    return run


@pytest.fixture(scope="session")
def ptb_path() -> str:
    return str(PTB)


@pytest.fixture(scope="session")
def ptb_text():
    """Split name -> the shipped PTB text of that split."""
    return {
        split: shipped_text(PTB / f"ptb.{split}.txt.xz") for split in ("train", "valid", "test")
    }


@pytest.fixture(scope="session")
def ptb_data(ptb_path):
    from datamodules import LanguageModelingDataModule

    return LanguageModelingDataModule(path=ptb_path)


def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """Small tensors: one thread is faster, and the test machine's cores are shared (use with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    yield from _single_thread()


@pytest.fixture(scope="module")
def one_thread_per_module():
    """``one_thread`` for a whole module (its module-scoped fixtures train tiny models)."""
    yield from _single_thread()


@pytest.fixture(scope="session")
def wikitext_like(tmp_path_factory) -> str:
    """A scaled-down WikiText-style corpus (2M training tokens, 50k Zipf-distributed word
    types, 20-word lines; ``app/bench/data.py`` makes the 100M one), written once."""
    from app.bench.data import write_synthetic_corpus

    folder = tmp_path_factory.mktemp("wikitext-like")
    write_synthetic_corpus(folder, tokens=2_000_000, types=50_000)
    return str(folder)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: skipped (and said so) on machines without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
