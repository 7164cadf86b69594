"""``--ckpt_path`` with a model option the checkpoint saved (``tie_weights``) set otherwise in a
config FILE, not on the command line (``app/cli/lightning_cli.py``, ``_keep_run_options``): the
checkpoint's value builds the model, as Lightning has it, and an info line says so (it was
dropped without a word; the command line's other value is refused, tested in
``tests/lightning_modules/test_changed_config.py``)."""

from __future__ import annotations

import logging

import pytest

from tests.test_bad_input import fit_checkpoint, tiny_lm, write_lm_corpus

pytestmark = pytest.mark.usefixtures("cli_argv")

WORDS = "one two three four five six seven eight nine ten red blue green".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_lm_corpus(tmp_path_factory.mktemp("file-option-corpus"), WORDS)


@pytest.fixture(scope="module")
def tied(tmp_path_factory, cli_run, corpus) -> str:
    """A tied LM (configs/lm/ptb.yaml ties) trained for one step."""
    return fit_checkpoint(cli_run, tmp_path_factory.mktemp("file-option-ckpt"), *tiny_lm(corpus))


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "the checkpoint's, not" in r.getMessage()]


def test_a_config_files_other_value_is_said_and_the_checkpoints_used(
    cli_run, corpus, tied, tmp_path, caplog
):
    untie = tmp_path / "untie.yaml"
    untie.write_text("model:\n  init_args:\n    tie_weights: false\n")
    caplog.set_level(logging.INFO, logger="lightning_modules")
    own = cli_run("validate", *tiny_lm(corpus), "--ckpt_path", tied)
    assert _said(caplog) == []
    edited = cli_run("validate", *tiny_lm(corpus), "--ckpt_path", tied, "--config", str(untie))
    assert edited.model.hparams.tie_weights is True
    assert edited.model.head.weight is edited.model.backbone.embedding.weight
    assert float(edited.trainer.callback_metrics["val/ppl"]) == pytest.approx(
        float(own.trainer.callback_metrics["val/ppl"]), rel=1e-6
    )
    assert _said(caplog) == [
        f"model.tie_weights true: the checkpoint's, not the config's false (it shapes the "
        f"model's parameters; --ckpt_path {tied})"
    ]
