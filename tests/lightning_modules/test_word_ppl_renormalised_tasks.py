"""``{stage}/word_ppl_renorm`` of the language model and translation over Hybrid-LightRNN codes:
logged beside ``word_ppl``, equal to a plain reference over the validation data, at most the
unrenormalised figure, and summed without a host read-back in a validation step."""

import math

import pytest
import torch

from lightning_modules import Translation
from lightning_modules.decoding import DecodeConfig
from tests.app.callbacks.test_lightrnn import (  # noqa: F401  (fixtures)
    corpus,
    make,
    make_translation,
    parallel,
    trainer,
)
from tests.lightning_modules import test_host_sync as host_sync

pytestmark = pytest.mark.usefixtures("one_thread")


def plain_val_word_ppls(data, model) -> tuple[float, float]:
    """The validation split's word perplexity and its renormalised one, position by position
    in float64: each target's probability, and over the codes the table allows after its
    input (a word start: frequent words and rows holding a word; after a row: its occupied
    columns)."""
    vocab = data.vocab
    table, rows, cols = vocab.table(), vocab.row_codes.tolist(), vocab.col_codes.tolist()
    starts = vocab.frequent_codes.tolist() + [rows[r] for r in range(vocab.rows)
                                               if (table[r] >= 0).any()]  # fmt: skip
    model.eval()
    state, unnorm, renorm, words = None, 0.0, 0.0, 0
    with torch.no_grad():
        for inputs, targets in data.val_dataloader():
            hidden, state = model.backbone(inputs, state)
            p = model.head.log_prob(hidden.reshape(-1, hidden.size(-1))).double().exp()
            pairs = zip(inputs.flatten().tolist(), targets.flatten().tolist(), strict=True)
            for row, (prev, target) in enumerate(pairs):
                if prev in rows:
                    r = rows.index(prev)
                    allowed = [cols[c] for c in range(vocab.cols) if table[r, c] >= 0]
                else:
                    allowed = starts
                unnorm -= math.log(p[row, target])
                renorm -= math.log(p[row, target] / p[row, allowed].sum())
                words += target not in cols
    return math.exp(unnorm / words), math.exp(renorm / words)


def test_the_language_model_logs_the_renormalised_word_ppl(corpus):  # noqa: F811
    data, model = make(corpus)
    fit = trainer(1, limit_train_batches=5)
    fit.fit(model, data)
    metrics = fit.validate(model, data, verbose=False)[0]
    word_ppl, renorm = metrics["val/word_ppl"], metrics["val/word_ppl_renorm"]
    assert renorm < word_ppl
    expected_ppl, expected_renorm = plain_val_word_ppls(data, model)
    assert word_ppl == pytest.approx(expected_ppl, rel=1e-4)
    assert renorm == pytest.approx(expected_renorm, rel=1e-4)


def test_translation_logs_the_renormalised_word_ppl(parallel):  # noqa: F811
    data, model = make_translation(parallel)
    fit = trainer(1, limit_train_batches=3)
    fit.fit(model, data)
    metrics = fit.validate(model, data, verbose=False)[0]
    assert 1.0 < metrics["val/word_ppl_renorm"] < metrics["val/word_ppl"]


def test_the_renormalised_sums_read_nothing_back_in_a_step(corpus, monkeypatch):  # noqa: F811
    data, model = make(corpus)
    _fit_without_read_backs(model, data, monkeypatch)


def test_translation_s_renormalised_sums_read_nothing_back_in_a_step(parallel, monkeypatch):  # noqa: F811
    data, model = make_translation(parallel)
    # validation without decoding (a search loop for BLEU, not the step's sums)
    model = Translation(model.backbone, model.head, decode=DecodeConfig(val_beam_size=0))
    _fit_without_read_backs(model, data, monkeypatch)


def _fit_without_read_backs(model, data, monkeypatch) -> None:
    """Fit under the sync sentinel: no step reads back, and the renormalised ppl is logged."""
    sentinel = host_sync.SyncSentinel()
    windows = host_sync.StepWindows(model, sentinel)
    fit = host_sync.trainer()
    with sentinel.installed(monkeypatch):
        fit.fit(model, data)
    host_sync.assert_no_sync(windows, 0)
    assert "val/word_ppl_renorm" in fit.callback_metrics
