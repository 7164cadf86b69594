"""A DS-Softmax checkpoint evaluated or resumed with an edited config (``--ckpt_path`` with
``lightning_modules/module_configs.py``'s ``compare_module_configs``).

After mitosis (and pruning) the checkpoint's head has another structure than a fresh
``DSSoftmaxHead`` of its config: loading resizes the head to it. So ``num_experts`` (the size
a fresh head starts from) and the SVD-softmax inference options may differ; an option that
changes the rows (``bias``) is one line naming it, before the data is prepared. The DS head
did not build on the meta device the comparison builds on, so every DS option went
unchecked: ``--model.head.bias false`` stopped after the data with ``error: weight must be
[R, 16], got torch.Size([288, 17])``."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from heads import DSSoftmaxHead
from lightning_modules.errors import ModelConfigError
from lightning_modules.module_configs import compare_module_configs
from tests.test_bad_input import error_line, tiny_lm, write_lm_corpus

pytestmark = pytest.mark.usefixtures("cli_argv")

WORDS = "one two three four five six seven eight nine ten red blue green".split()
DS_HEAD = ["--model.head", "heads.DSSoftmaxHead", "--model.head.num_experts", "2",
           "--model.head.bias", "true", "--model.tie_weights", "false"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_lm_corpus(tmp_path_factory.mktemp("ds-changed-corpus"), WORDS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, cli_run, corpus) -> str:
    """A DS LM (LSTM 2 x 16, 2 experts) split once by mitosis: 4 experts in its state."""
    out = tmp_path_factory.mktemp("ds-changed-ckpt")
    assert cli_run("fit", *tiny_lm(corpus), *DS_HEAD, "--trainer.max_epochs", "2",
                   "--trainer.enable_checkpointing", "true",
                   "--trainer.callbacks+", "lightning.pytorch.callbacks.ModelCheckpoint",
                   "--trainer.callbacks.dirpath", str(out),
                   "--trainer.callbacks+", "app.callbacks.Mitosis",
                   "--trainer.callbacks.every_n_epochs", "1",
                   console=True) == 0  # fmt: skip
    path = next(out.glob("*.ckpt"))
    saved = torch.load(path, map_location="cpu", weights_only=False)
    assert saved["state_dict"]["head.gate"].shape[0] > 2  # the structure the config lacks
    return str(path)


def _val_ppl(cli_run, corpus: str, checkpoint: str, *options: str) -> float:
    cli = cli_run("validate", *tiny_lm(corpus), *DS_HEAD, "--ckpt_path", checkpoint, *options)
    return float(cli.trainer.callback_metrics["val/ppl"])


def test_an_option_that_changes_the_rows_is_one_line_before_the_data(
    cli_run, corpus, checkpoint, capsys
):
    code = cli_run("validate", *tiny_lm(corpus), *DS_HEAD, "--ckpt_path", checkpoint,
                   "--model.head.bias", "false", console=True)  # fmt: skip
    assert error_line(capsys, code) == (
        f"error: model.head.bias is false in the config but true in the checkpoint "
        f"{checkpoint}: its weights do not fit this model; give the options it was trained "
        f"with (its run's config.yaml), or train anew without --ckpt_path"
    )


def test_num_experts_and_svd_options_load_the_checkpoints_structure(
    cli_run, corpus, checkpoint, caplog
):
    """Another ``num_experts`` still loads the split head: the same perplexity, said in one
    info line with the SVD-softmax options (an inference choice)."""
    own = _val_ppl(cli_run, corpus, checkpoint)
    caplog.set_level(logging.INFO, logger="lightning_modules")
    edited = _val_ppl(cli_run, corpus, checkpoint, "--model.head.num_experts", "3",
                      "--model.head.svd_rank", "4")  # fmt: skip
    assert edited == pytest.approx(own, rel=1e-6)
    said = [r.getMessage() for r in caplog.records if "the checkpoint's" in r.getMessage()]
    assert said == [
        f"model.head.num_experts 3 (the checkpoint's 2, its structure loaded), "
        f"model.head.svd_rank 4 (the checkpoint's 0): the config's, which do not change the "
        f"checkpoint's weights (--ckpt_path {checkpoint})"
    ]


# -- compare_module_configs on its own -------------------------------------------------------
def _configs(**head: object) -> dict:
    return {
        "backbone": {"class_path": "lightning_modules.backbones.LSTMBackbone",
                     "init_args": {"vocab_size": 50, "embedding_size": 16, "hidden_size": 16}},
        "head": {"class_path": "heads.DSSoftmaxHead",
                 "init_args": {"vocab_size": 50, "hidden_size": 16, "num_experts": 2,
                               "bias": True, **head}},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("option", "value", "why"),
    [("bias", False, "do not fit"), ("hidden_size", 12, None)],
)
def test_a_ds_option_of_the_rows_is_refused(option, value, why):
    """``hidden_size`` is linked from the backbone (named there, not here)."""
    saved = _configs()
    run = copy.deepcopy(saved)
    run["head"]["init_args"][option] = value
    if why is None:
        assert compare_module_configs(saved, run, "C") == []
        return
    with pytest.raises(ModelConfigError, match=f"^model.head.{option} is .*{why}"):
        compare_module_configs(saved, run, "C")


@pytest.mark.parametrize(
    ("option", "value"),
    [("num_experts", 8), ("lambda_lasso", 0.1), ("init_std", 0.5), ("svd_rank", 16),
     ("svd_candidates", 0.1), ("svd_min_classes", 300)],
)  # fmt: skip
def test_ds_options_that_keep_the_weights_are_harmless(option, value):
    saved = _configs()
    run = copy.deepcopy(saved)
    run["head"]["init_args"][option] = value
    harmless = compare_module_configs(saved, run, "C")
    assert len(harmless) == 1 and harmless[0].startswith(f"model.head.{option} ")


def test_a_ds_head_builds_on_the_meta_device():
    """What the comparison builds on: the packed rows' shapes, no values read."""
    with torch.device("meta"):
        head = DSSoftmaxHead(16, 50, num_experts=3, bias=True)
    assert head.weight.shape == (150, 17) and head.row_expert().shape == (150,)
