"""``predict`` stops at ``SIGTERM`` before its next batch (Lightning's prediction loop never
reads the flag its handler sets: a predict over a long file went on to its end), saying how
many of the input's lines were written, for both tasks."""

import json
import logging

import lightning as L
import pytest
from lightning.pytorch.utilities.exceptions import SIGTERMException

from app.callbacks import PredictionWriter
from tests.datamodules.test_translation_predict_order import _mixed_sentences, _setting
from tests.lightning_modules.test_lm_predict_batches import MIXED, _data, _model


class _TermAfter(L.Callback):
    """What Lightning's SIGTERM handler does (``received_sigterm``), after batch ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_predict_batch_end(self, trainer, *args, **kwargs) -> None:
        if trainer.predict_loop.batch_progress.current.completed + 1 >= self.n:
            trainer._signal_connector.received_sigterm = True


def _run(model, data, capsys, caplog) -> tuple[list[dict], list[str]]:
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PredictionWriter(), _TermAfter(2)])  # fmt: skip
    with caplog.at_level(logging.WARNING), pytest.raises(SIGTERMException):
        trainer.predict(model, data, return_predictions=False)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    said = [r.getMessage() for r in caplog.records if "stopped by SIGTERM" in r.getMessage()]
    return printed, said


def test_lm_predict_stops_at_sigterm_and_says_what_was_written(tmp_path, capsys, caplog):
    data = _data(tmp_path, "word", batch_size=2, prompts=MIXED)
    data.hparams.predict_window = 8
    printed, said = _run(_model("lstm", data.vocab_size), data, capsys, caplog)
    # window 1 (lengths 1 9 2 1 12 3 1 7) sorted: batches [0 3] [6 2]: lines 0 written, 2 3 6 held
    assert [r["prompt"] for r in printed] == MIXED[:1]
    assert said == [
        "warning: predict stopped by SIGTERM: the input's first 1 lines were written; 3 later "
        "results held back were not"
    ]


def test_translation_predict_stops_at_sigterm(tmp_path, capsys, caplog):
    sentences = _mixed_sentences(60)
    model, data = _setting(tmp_path, sentences, beam=1, window=20)
    printed, said = _run(model, data, capsys, caplog)
    assert len(printed) < len(sentences) and len(said) == 1
    assert [r["source"] for r in printed] == sentences[: len(printed)]
    assert f"first {len(printed)} lines were written" in said[0]
