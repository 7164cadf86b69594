"""UnknownWords: the data module's <unk> counts per split go to the run's loggers once, when
fitting starts."""

import lightning as L
import pytest
from lightning.pytorch.loggers import Logger

from app.callbacks import UnknownWords
from datamodules import LanguageModelingDataModule
from heads import SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone
from tests.datamodules.test_language_modeling import unk_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[dict, int]] = []

    name, version = "recorder", 0

    def log_metrics(self, metrics, step=None):
        self.calls.append((dict(metrics), step))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_unknown_shares_are_logged_once_at_fit_start(tmp_path):
    data = LanguageModelingDataModule(path=unk_corpus(tmp_path / "text"), max_vocab_size=5,
                                      batch_size=2, bptt=3, eval_batch_size=2,
                                      cache_dir=str(tmp_path / "cache"))  # fmt: skip
    model = LanguageModel(LSTMBackbone(data.vocab_size, embedding_size=4, hidden_size=4),
                          SoftmaxHead(4, data.vocab_size))  # fmt: skip
    recorder = Recorder()
    trainer = L.Trainer(max_steps=2, logger=recorder, callbacks=[UnknownWords()],
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, datamodule=data)
    logged = [(m, step) for m, step in recorder.calls if any(k.startswith("data/") for k in m)]
    assert logged == [({
        "data/train_unk_tokens": 5.0, "data/train_unk_share": 5 / 80,
        "data/valid_unk_tokens": 10.0, "data/valid_unk_share": 10 / 30,
    }, 0)]  # fmt: skip
