from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PTB = REPO.parent / "shared" / "data" / "ptb"


@pytest.fixture(scope="session")
def ptb_path() -> str:
    assert PTB.is_dir(), f"the shared PTB data must be beside the repo at {PTB}"
    return str(PTB)


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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need a CUDA device: skipped (and said so) on machines without one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
