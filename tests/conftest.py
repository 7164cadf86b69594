from pathlib import Path

import pytest

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
