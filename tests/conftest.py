import lzma
import os
import sys
from pathlib import Path

import pytest
import torch

from datamodules.cache import CACHE_ENV
from datamodules.text_source import CORPORA

REPO = Path(__file__).resolve().parents[1]
PTB = CORPORA / "ptb"  # shipped with the project, xz-compressed
MULTI30K = CORPORA / "multi30k"


def shipped_text(path: Path) -> str:
    """A shipped corpus file's text, read plainly with the standard library (a reference
    independent of the data modules' reader)."""
    with lzma.open(path, "rt", encoding="utf-8", newline="") as handle:
        return handle.read()


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory) -> Path:
    """Prepared corpora go to a folder of this test session, never the user's cache; the
    ``cli.py`` subprocesses (and their DDP ranks) inherit it."""
    root = tmp_path_factory.mktemp("data-cache")
    os.environ[CACHE_ENV] = str(root)
    return root


@pytest.fixture
def cli_argv(monkeypatch):
    """``sys.argv`` as ``python cli.py`` has it, not pytest's (LightningCLI reads it); for
    tests that run the CLI in-process (``pytestmark = pytest.mark.usefixtures("cli_argv")``)."""
    monkeypatch.setattr(sys, "argv", ["cli.py"])


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
