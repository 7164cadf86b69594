"""A checkpoint evaluated (or resumed) with an edited config: ``cli.py validate|test|predict|fit
--config X --ckpt_path C`` where X gives the backbone or the head other options than C was
trained with (``lightning_modules/module_configs.py``: ``compare_module_configs``, called by
``app/cli/lightning_cli.py`` before anything is built or any data prepared).

A change that makes the weights not fit (another size, layer count, head, head option,
vocabulary kind) or compute something else (a Transformer's head count) is one ``error:`` line
naming the option, the config's value and the checkpoint's; a harmless one (dropout at
evaluation, the evaluation batch size) runs, the options said in one info line."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from lightning_modules.errors import ModelConfigError
from lightning_modules.module_configs import compare_module_configs
from tests.test_bad_input import error_line, fit_checkpoint, tiny_lm, write_lm_corpus

pytestmark = pytest.mark.usefixtures("cli_argv")

WORDS = "one two three four five six seven eight nine ten red blue green".split()
TAIL = (
    ": its weights do not fit this model; give the options it was trained with (its run's "
    "config.yaml), or train anew without --ckpt_path"
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_lm_corpus(tmp_path_factory.mktemp("changed-corpus"), WORDS)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, cli_run, corpus) -> str:
    """A tied SoftmaxHead LM (LSTM, 2 x 16) trained for one step on the tiny corpus."""
    return fit_checkpoint(cli_run, tmp_path_factory.mktemp("changed-ckpt"), *tiny_lm(corpus))


# -- through cli.py: one line per class of mismatch ------------------------------------------
@pytest.mark.parametrize(
    ("subcommand", "options", "named"),
    [
        # a shape-changing backbone option: was "cannot tie SoftmaxHead.weight of shape ..."
        ("validate", ["--model.backbone.hidden_size", "24"],
         "model.backbone.hidden_size is 24 in the config but 16 in the checkpoint"),
        # was a traceback listing the third layer's missing keys
        ("test", ["--model.init_args.backbone.init_args.num_layers", "3"],
         "model.backbone.num_layers is 3 in the config but 2 in the checkpoint"),
        # a head option: was a traceback (head.bias missing)
        ("validate", ["--model.head.bias", "false"],
         "model.head.bias is false in the config but true in the checkpoint"),
        # two options, both named
        ("validate", ["--model.backbone.embedding_size", "24", "--model.backbone.hidden_size",
                      "24"],
         "model.backbone.embedding_size is 24 in the config but 16 in the checkpoint, and "
         "model.backbone.hidden_size is 24 in the config but 16 in the checkpoint"),
        # resuming a fit with another size: refused as well
        ("fit", ["--model.backbone.num_layers", "1"],
         "model.backbone.num_layers is 1 in the config but 2 in the checkpoint"),
    ],
)  # fmt: skip
def test_a_shape_changing_option_is_one_line(
    cli_run, corpus, checkpoint, capsys, subcommand, options, named
):
    code = cli_run(subcommand, *tiny_lm(corpus), "--ckpt_path", checkpoint, *options,
                   console=True)  # fmt: skip
    assert error_line(capsys, code) == f"error: {named} {checkpoint}{TAIL}"


def test_another_head_is_one_line_naming_both(cli_run, corpus, checkpoint, capsys):
    """Was refused only after the data was prepared, in other words."""
    code = cli_run("validate", *tiny_lm(corpus), "--ckpt_path", checkpoint,
                   "--model.head", "configs/heads/mos.yaml", console=True)  # fmt: skip
    assert error_line(capsys, code) == (
        f"error: model.head is heads.MoSHead in the config but heads.SoftmaxHead in the "
        f"checkpoint {checkpoint}{TAIL}"
    )


def test_another_vocabulary_kind_is_refused_before_the_data(cli_run, corpus, checkpoint, capsys):
    """Was refused after a BPE vocabulary was trained and the corpus tokenised."""
    code = cli_run("test", *tiny_lm(corpus), "--ckpt_path", checkpoint,
                   "--data.vocab", "bpe", "--data.bpe_vocab_size", "40", console=True)  # fmt: skip
    assert error_line(capsys, code) == (
        f"error: data.vocab is bpe in the config but word in the checkpoint {checkpoint}: it "
        f"was trained on another vocabulary; give --data.vocab word (and its options as the "
        f"run had them, in its config.yaml), or train anew without --ckpt_path"
    )


def test_a_harmless_change_runs_and_is_said_in_one_line(cli_run, corpus, checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="lightning_modules")
    cli = cli_run("validate", *tiny_lm(corpus), "--ckpt_path", checkpoint,
                  "--model.backbone.hidden_dropout", "0.5",
                  "--data.eval_batch_size", "3")  # fmt: skip
    assert cli.model.head.hidden_size == 16
    assert cli.trainer.callback_metrics["val/ppl"] > 0
    said = [r.getMessage() for r in caplog.records if "the checkpoint's" in r.getMessage()]
    assert said == [
        f"model.backbone.hidden_dropout 0.5 (the checkpoint's 0.2): the config's, which do "
        f"not change the checkpoint's weights (--ckpt_path {checkpoint})"
    ]


def test_the_checkpoints_own_options_say_nothing(cli_run, corpus, checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="lightning_modules")
    cli_run("validate", *tiny_lm(corpus), "--ckpt_path", checkpoint)
    assert not [r for r in caplog.records if "the checkpoint's" in r.getMessage()]


# -- compare_module_configs on its own: the options no CLI test above reaches ------------------
def _configs(backbone: tuple[str, dict], head: tuple[str, dict]) -> dict[str, Any]:
    return {
        "backbone": {"class_path": backbone[0], "init_args": dict(backbone[1])},
        "head": {"class_path": head[0], "init_args": {"vocab_size": 50, "hidden_size": 16,
                                                      **head[1]}},
    }  # fmt: skip


LSTM = ("lightning_modules.backbones.LSTMBackbone",
        {"vocab_size": 50, "embedding_size": 16, "hidden_size": 16})  # fmt: skip
SEQ2SEQ = ("lightning_modules.backbones.Seq2SeqTransformer",
           {"vocab_size": 50, "src_vocab_size": 40, "model_size": 16, "num_heads": 2,
            "feedforward_size": 32, "encoder_layers": 1, "decoder_layers": 1})  # fmt: skip


def _changed(saved: dict, module: str, option: str, value: Any) -> dict:
    run = copy.deepcopy(saved)
    run[module]["init_args"][option] = value
    # the CLI fills vocabulary sizes at instantiation: a parsed config has none yet
    run[module]["init_args"].pop("vocab_size", None)
    return run


@pytest.mark.parametrize(
    ("backbone", "head", "module", "option", "value", "why"),
    [
        # same shapes, another function: a Transformer's attention heads, Mixtape's scale
        (SEQ2SEQ, ("heads.SoftmaxHead", {}), "backbone", "num_heads", 4, "compute"),
        (LSTM, ("heads.MixtapeHead", {"weight_norm_scale": 1.0}), "head",
         "weight_norm_scale", 2.0, "compute"),
        (SEQ2SEQ, ("heads.SoftmaxHead", {}), "backbone", "encoder_layers", 2, "fit"),
        (LSTM, ("heads.MoSHead", {"num_components": 3}), "head", "num_components", 4, "fit"),
        (LSTM, ("heads.AdaptiveSoftmaxHead", {"cutoffs": [10, 30]}), "head", "cutoffs",
         [10, 20], "fit"),
    ],
)  # fmt: skip
def test_options_the_weights_do_not_fit_are_refused(backbone, head, module, option, value, why):
    saved = _configs(backbone, head)
    with pytest.raises(ModelConfigError) as raised:
        compare_module_configs(saved, _changed(saved, module, option, value), "C")
    message = str(raised.value)
    assert message.startswith(f"model.{module}.{option} is ")
    assert ("would fit but compute something else" in message) == (why == "compute")


@pytest.mark.parametrize(
    ("backbone", "head", "module", "option", "value"),
    [
        (SEQ2SEQ, ("heads.SoftmaxHead", {}), "backbone", "dropout", 0.3),
        (LSTM, ("heads.MixtapeHead", {}), "head", "gate_noise", 0.5),
        (LSTM, ("heads.MoSHead", {"num_components": 3}), "head", "embedding_size", 16),
        (LSTM, ("heads.SoftmaxHead", {}), "head", "zipf_bias_init", False),
    ],
)  # fmt: skip
def test_harmless_options_are_returned(backbone, head, module, option, value):
    saved = _configs(backbone, head)
    harmless = compare_module_configs(saved, _changed(saved, module, option, value), "C")
    assert len(harmless) == 1 and harmless[0].startswith(f"model.{module}.{option} ")


def test_an_auto_adaptive_head_takes_the_checkpoints_cutoffs():
    """``cutoffs: auto`` adopts a checkpoint's cut-offs on load: not a mismatch."""
    saved = _configs(LSTM, ("heads.AdaptiveSoftmaxHead", {"cutoffs": [10, 30]}))
    assert compare_module_configs(saved, _changed(saved, "head", "cutoffs", "auto"), "C") == []


def test_an_option_the_checkpoint_does_not_state_has_its_default():
    """A checkpoint from before an option existed: the class default, not a mismatch."""
    saved = _configs(LSTM, ("heads.SoftmaxHead", {}))
    run = _changed(saved, "backbone", "dropout_kind", "locked")  # LSTMBackbone's default
    assert compare_module_configs(saved, run, "C") == []
