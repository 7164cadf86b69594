"""Bad input stops with one line naming what to fix (README, "Train, test, predict"), through
cli.py.

Each case runs ``cli.console_main`` as ``python cli.py`` would and checks the line it prints
(exactly one ``error:`` line, no traceback, no usage) and its exit status (2). The table
``COMMAND_LINE`` runs again as real ``python cli.py`` processes in the slow suite, one case per
stage that raises (``IN_A_REAL_PROCESS``). Tiny corpora keep every case to about a second.
"""

import errno
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from app.cli.console import TRACEBACK_ENV
from cli import console_main
from tests.conftest import EXPERIMENTS, REPO
from tests.datamodules.test_text_source import no_network

pytestmark = pytest.mark.usefixtures("cli_argv")

WORDS = "the cat sat on a mat and dog ran to red hat in big old box".split()
QUIET = [
    "--trainer.logger", "false", "--trainer.callbacks", "null",
    "--trainer.enable_checkpointing", "false",
    "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
    "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2",
    "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
]  # fmt: skip
SMALL_LM = [
    "--model.init_args.backbone.init_args.embedding_size", "16",
    "--model.init_args.backbone.init_args.hidden_size", "16",
    "--data.init_args.batch_size", "4", "--data.init_args.eval_batch_size", "2",
    "--data.init_args.bptt", "5",
]  # fmt: skip


def write_lm_corpus(folder: Path, words: list[str]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for split, lines in (("train", 60), ("valid", 12), ("test", 12)):
        text = "".join(" ".join(words[(i + j) % len(words)] for j in range(7)) + "\n"
                       for i in range(lines))  # fmt: skip
        (folder / f"tiny.{split}.txt").write_text(text)
    return str(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """20 word types (17 words, <eos>, <unk>... as the vocabulary counts them)."""
    return write_lm_corpus(tmp_path_factory.mktemp("tiny"), WORDS)


@pytest.fixture(scope="module")
def softmax_checkpoint(tmp_path_factory, cli_run, corpus) -> str:
    """A SoftmaxHead LM trained for one step on the tiny corpus."""
    return fit_checkpoint(cli_run, tmp_path_factory.mktemp("ckpt"), *tiny_lm(corpus))


def fit_checkpoint(cli_run, out: Path, *options: str, steps: str = "1") -> str:
    """The checkpoint ``cli.py fit OPTIONS`` leaves in ``out`` after ``steps`` steps."""
    assert cli_run("fit", *options, "--trainer.max_steps", steps,
                   "--trainer.enable_checkpointing", "true",
                   "--trainer.callbacks", "lightning.pytorch.callbacks.ModelCheckpoint",
                   "--trainer.callbacks.dirpath", str(out), console=True) == 0  # fmt: skip
    return str(next(out.glob("*.ckpt")))


def tiny_lm(path: str, experiment: str = "ptb_softmax") -> list[str]:
    """The options of a tiny, quiet LM of ``experiment`` on the corpus at ``path``, trained for
    two steps at most."""
    return [*EXPERIMENTS[experiment], "--data.init_args.path", path, *QUIET, *SMALL_LM]


def error_line(capsys, code: int) -> str:
    """The one line the CLI printed for the error (checked to be the only ``error:`` line)."""
    assert code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


# -- data ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/no/such/dir", "shared/data/ptb"])
def test_missing_data_path(cli_run, capsys, path):
    """A missing folder, absolute or relative, is never tried as a hub name."""
    code = cli_run("fit", *tiny_lm(path), console=True)
    assert error_line(capsys, code) == (
        f"error: data path {path!r} does not exist or is not a folder; set data.path to a "
        f"local folder, data.hub to a Hugging Face dataset name, or leave both unset for the "
        f"shipped Penn Treebank (as configs/data/ptb*.yaml do)"
    )


def test_empty_corpus(cli_run, tmp_path, capsys):
    write_lm_corpus(tmp_path, WORDS)
    (tmp_path / "tiny.train.txt").write_text("")
    code = cli_run("fit", *tiny_lm(str(tmp_path)), console=True)
    assert error_line(capsys, code) == f"error: train file '{tmp_path}/tiny.train.txt' is empty"


def test_parallel_files_of_different_lengths(cli_run, tmp_path, capsys):
    for prefix in ("train", "val", "test_2016_flickr"):
        (tmp_path / f"{prefix}.de").write_text("ein Hund\neine Katze\n")
        (tmp_path / f"{prefix}.en").write_text("a dog\na cat\n")
    (tmp_path / "train.en").write_text("a dog\n")
    code = cli_run("fit", *QUIET, "--data.init_args.path", str(tmp_path),
                   experiment="multi30k_softmax", console=True)  # fmt: skip
    assert error_line(capsys, code) == (
        f"error: misaligned parallel train files: '{tmp_path}/train.de' has 2 lines but "
        f"'{tmp_path}/train.en' has 1; line i of one side must translate line i of the other"
    )


def test_head_hidden_size_differs_from_the_backbone_in_python():
    from heads import SoftmaxHead
    from lightning_modules import LanguageModel
    from lightning_modules.backbones import LSTMBackbone
    from lightning_modules.errors import ModelConfigError

    with pytest.raises(ModelConfigError) as raised:
        LanguageModel(LSTMBackbone(30, 16, 16), SoftmaxHead(24, 30))
    assert str(raised.value) == (
        "head.hidden_size (24) must equal the backbone's output size (16): build the head with "
        "hidden_size=16 (the CLI links it from the backbone)"
    )


def test_checkpoint_from_another_vocabulary(cli_run, softmax_checkpoint, tmp_path, capsys):
    other = write_lm_corpus(tmp_path, [w.upper() for w in WORDS])
    code = cli_run("test", *tiny_lm(other), "--ckpt_path", softmax_checkpoint, console=True)
    line = error_line(capsys, code)
    assert line.startswith("error: the checkpoint was trained with another vocabulary (18 tokens")
    assert f"than the data at path='{other}' gives (18 tokens" in line


def test_checkpoint_from_another_head(cli_run, softmax_checkpoint, corpus, capsys):
    code = cli_run("test", *tiny_lm(corpus, "ptb_mixtape"), "--ckpt_path", softmax_checkpoint,
                   console=True)  # fmt: skip
    # named from the checkpoint's configs before the data is prepared (module_configs.py)
    assert error_line(capsys, code) == (
        f"error: model.head is heads.MixtapeHead in the config but heads.SoftmaxHead in the "
        f"checkpoint {softmax_checkpoint}: its weights do not fit this model; give the options "
        f"it was trained with (its run's config.yaml), or train anew without --ckpt_path"
    )


def test_checkpoint_with_other_head_options(cli_run, softmax_checkpoint, corpus, capsys):
    code = cli_run("test", *tiny_lm(corpus), "--ckpt_path", softmax_checkpoint,
                   "--model.init_args.head.init_args.bias", "false", console=True)  # fmt: skip
    assert error_line(capsys, code) == (
        f"error: model.head.bias is false in the config but true in the checkpoint "
        f"{softmax_checkpoint}: its weights do not fit this model; give the options it was "
        f"trained with (its run's config.yaml), or train anew without --ckpt_path"
    )


def test_tied_head_with_another_embedding_size(cli_run, corpus, capsys):
    code = cli_run("fit", *tiny_lm(corpus), "--model.init_args.head.init_args.embedding_size",
                   "8", console=True)  # fmt: skip
    assert error_line(capsys, code) == (
        "error: cannot tie SoftmaxHead.weight of shape (18, 8) to an embedding of shape "
        "(18, 16): set the head's embedding_size to the backbone's embedding size (16)"
    )


def test_missing_pretrained_checkpoint(cli_run, corpus, capsys):
    code = cli_run("fit", *tiny_lm(corpus), "--model.init_args.pretrained_checkpoint",
                   "/no/such.ckpt", console=True)  # fmt: skip
    assert error_line(capsys, code) == (
        "error: model.pretrained_checkpoint '/no/such.ckpt' does not exist or is not a file"
    )


# -- training ----------------------------------------------------------------------------------
def test_nan_loss_stops_naming_the_step_and_the_head(cli_run, corpus, capsys):
    # an infinite learning rate makes the weights inf and nan after the first Adam step, on any
    # CPU (a merely huge one, 1e30, left the loss finite on some: tanh saturates)
    code = cli_run("fit", *tiny_lm(corpus), "--model.init_args.optimizer.init_args.lr", ".inf",
                   "--trainer.gradient_clip_val", "null", console=True)  # fmt: skip
    assert error_line(capsys, code) == (
        "error: non-finite train loss (nan) at step 1 with SoftmaxHead: lower the learning "
        "rate or check the precision"
    )


# -- the command line: parser, Lightning and PyTorch errors, each one line ------------------
BROKEN = "<broken>"  # stands for the folder of the fixture ``broken`` in COMMAND_LINE


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> str:
    """A folder of broken files: an empty checkpoint, a YAML one, a config that is not YAML."""
    folder = tmp_path_factory.mktemp("broken")
    (folder / "empty.ckpt").write_bytes(b"")
    (folder / "config.ckpt").write_text("model: {lr: 1}\n")
    (folder / "not_yaml.yaml").write_text("trainer: {max_epochs: 1\n  - [\n")
    return str(folder)


# (id, subcommand and options after the tiny LM's, the start of the one line it prints)
COMMAND_LINE = [
    # data
    *[(f"{option}_{value}", ["fit", f"--data.init_args.{option}", value],
       f"data.{option} must be a positive integer, got {value}")
      for option, value in (("bptt", "0"), ("batch_size", "-3"), ("eval_batch_size", "0"))],
    ("more_streams_than_tokens", ["fit", "--data.init_args.batch_size", "1000"],
     "train split with data.batch_size=1000: 480 tokens are too few for 1000 streams of at "
     "least 2"),
    ("unknown_vocabulary", ["fit", "--data.init_args.vocab", "chars"],
     "data.vocab must be one of word, bpe, hybrid_lightrnn, got 'chars'"),
    ("lightrnn_without_frequent", ["fit", "--data.init_args.vocab", "hybrid_lightrnn",
                                   "--data.init_args.lightrnn_frequent", "0"],
     "data.vocab=hybrid_lightrnn (data.lightrnn_*): Hybrid-LightRNN num_frequent must be a "
     "positive integer, got 0"),
    ("predict_without_prompts", ["predict"],
     "predict needs prompts: set data.predict_prompts, e.g. --data.predict_prompts "
     "'[\"the company said\"]'"),
    ("cpu_devices_all", ["fit", "--trainer.accelerator", "cpu", "--trainer.devices", "-1"],
     "trainer.devices: devices selected with CPUAccelerator should be an int > 0."),
    ("float16_weights_with_adam", ["fit", "--trainer.precision", "16-true"],
     "trainer.precision 16-true keeps the weights and Adam's moments in float16, where its eps "
     "(1e-08) and small squared gradients are 0"),
    ("predict_file_missing", ["predict", "--data.init_args.predict_file", "no/prompts.txt"],
     "data.predict_file 'no/prompts.txt' does not exist"),
    # heads and their options against the vocabulary
    ("mixtape_k_not_power_of_two", ["fit", "--model.head", "configs/heads/mixtape.yaml",
                                    "--model.init_args.head.init_args.num_components", "3"],
     "MixtapeHead num_components must be a power of two >= 2 (sigmoid tree, Eq. 3), got 3"),
    ("mixtape_ratio_zero", ["fit", "--model.head", "configs/heads/mixtape.yaml",
                            "--model.init_args.head.init_args.frequent_ratio", "0"],
     "MixtapeHead frequent_ratio r must be in (0, 1], got 0.0"),
    ("mos_zero_components", ["fit", "--model.head", "configs/heads/mos.yaml",
                             "--model.init_args.head.init_args.num_components", "0"],
     "num_components must be a positive integer, got 0"),
    *[(f"adaptive_cutoffs_{name}", ["fit", "--model.head", "heads.AdaptiveSoftmaxHead",
                                    "--model.init_args.head.init_args.div_value", "2",
                                    "--model.init_args.head.init_args.cutoffs", cutoffs],
       "AdaptiveSoftmaxHead cutoffs must be increasing positive integers below the vocabulary "
       f"size 18, got {cutoffs}")
      for name, cutoffs in (("decreasing", "[8, 4]"), ("beyond_vocabulary", "[5, 386]"))],
    # the backbone's and the callbacks' options
    ("zero_layers", ["fit", "--model.init_args.backbone.init_args.num_layers", "0"],
     "model.backbone.num_layers must be at least 1, got 0"),
    ("dropout_one", ["fit", "--model.init_args.backbone.init_args.input_dropout", "1"],
     "model.backbone.input_dropout must be in [0, 1), got 1.0"),
    ("lightrnn_solver_typo", ["fit", "--trainer.callbacks",
                              "app.callbacks.LightRNNTableReassignment",
                              "--trainer.callbacks.init_args.solver", "sinkhorn"],
     "LightRNNTableReassignment solver must be 'auto', 'exact' or 'separable', got 'sinkhorn'"),
    ("compile_mode_typo", ["fit", "--model.init_args.compile", "{mode: max-autotun}"],
     "model.compile {'mode': 'max-autotun'}: Unrecognized mode=max-autotun, should be one of"),
    ("mixtape_gate_dropout_above_one",
     ["fit", "--model.head", "configs/heads/mixtape.yaml",
      "--model.init_args.head.init_args.gate_dropout", "1.5"],
     "gate_dropout must be in [0, 1), got 1.5"),
    ("zero_temperature", ["fit", "--model.init_args.temperature", "0"],
     "model.temperature must be positive, got 0.0"),
    ("missing_checkpoint", ["test", "--ckpt_path", "/no/such.ckpt"],
     "ckpt_path '/no/such.ckpt' does not exist or is not a file"),
    # the command line: parser, Lightning and PyTorch errors
    ("int_word", ["fit", "--trainer.max_epochs", "one"],
     "trainer.max_epochs: expected an int (given 'one')"),
    ("nested_int_word", ["fit", "--data.init_args.bptt", "thirty"],
     "data.init_args.bptt: expected an int (given 'thirty')"),
    ("float_word", ["fit", "--model.init_args.optimizer.init_args.lr", "abc"],
     "model.init_args.optimizer.init_args.lr: expected a float (given 'abc')"),
    ("seed_word", ["fit", "--seed_everything", "abc"],
     "seed_everything: expected a bool or an int (given 'abc')"),
    ("precision_typo", ["fit", "--trainer.precision", "bf61"],
     "trainer.precision: expected one of: "),
    ("no_such_head", ["fit", "--model.head", "heads.MixtapHead"],
     "model.init_args.head: no class 'MixtapHead' in module 'heads'; did you mean "
     "heads.MixtapeHead"),
    ("no_such_head_file", ["fit", "--model.head", "configs/heads/mixtap.yaml"],
     "model.init_args.head: no such file or class; did you mean configs/heads/mixtape.yaml"),
    ("head_option_typo", ["fit", "--model.head", "configs/heads/mos.yaml",
                          "--model.init_args.head.init_args.num_componets", "3"],
     "model.init_args.head.init_args.num_componets: heads.MoSHead has no option "
     "'num_componets'; did you mean num_components? (given '3')"),
    ("backbone_option_typo", ["fit", "--model.init_args.backbone.init_args.hiden_size", "3"],
     "model.init_args.backbone.init_args.hiden_size: lightning_modules.backbones.LSTMBackbone "
     "has no option 'hiden_size'; did you mean hidden_size?"),
    ("data_option_typo", ["fit", "--data.init_args.bptt_length", "5"],
     "data.init_args.bptt_length: datamodules.LanguageModelingDataModule has no option "
     "'bptt_length'; did you mean bptt or bptt_std? (given '5')"),
    ("trainer_option_prefix", ["fit", "--trainer.max_epoch", "1"],
     "unknown option --trainer.max_epoch; did you mean --trainer.max_epochs"),
    ("subcommand_typo", ["fitt"], "unknown subcommand 'fitt'; did you mean fit?"),
    ("missing_config", ["fit", "--config", "configs/lm/ptb_softmx.yaml"],
     "--config: File does not exist: "),
    ("config_not_yaml", ["fit", "--config", f"{BROKEN}/not_yaml.yaml"],
     f"--config '{BROKEN}/not_yaml.yaml' is not a YAML file ("),
    ("linked_hidden_size", ["fit", "--model.init_args.head.init_args.hidden_size", "32"],
     "model.init_args.head.init_args.hidden_size: set by the CLI from the backbone's output "
     "size; leave it out"),
    ("linked_vocab_size", ["fit", "--model.init_args.head.init_args.vocab_size", "32"],
     "model.init_args.head.init_args.vocab_size: set by the CLI from data.vocab_size"),
    *[(f"lightning_{given}", ["fit", f"--{given}", value],
       f"--{given}: the model takes its optimizer and schedule as options: use --model.{ours} ")
      for given, ours, value in (("optimizer", "optimizer", "torch.optim.SGD"),
                                 ("lr_scheduler", "scheduler",
                                  "torch.optim.lr_scheduler.ConstantLR"))],
    ("negative_lr", ["fit", "--model.init_args.optimizer.init_args.lr", "-1"],
     "model.init_args.optimizer: Invalid learning rate: -1.0"),
    ("negative_epochs", ["fit", "--trainer.max_epochs", "-2"],
     "trainer.max_epochs: max_epochs must be a non-negative integer or -1. You passed in -2."),
    ("accelerator_typo", ["fit", "--trainer.accelerator", "tpuu"],
     "trainer.accelerator: You selected an invalid accelerator name: accelerator='tpuu'."),
    ("strategy_typo", ["fit", "--trainer.strategy", "ddpp"],
     "trainer.strategy: You selected an invalid strategy name: strategy='ddpp'."),
    ("negative_generate", ["fit", "--model.init_args.generate_tokens", "-5"],
     "model.generate_tokens must be 0 (none) or more, got -5"),
    ("zero_top_k", ["predict", "--model.init_args.predict_top_k", "0"],
     "model.predict_top_k must be at least 1, got 0"),
    ("best_without_fit", ["test", "--ckpt_path", "best"],
     "ckpt_path 'best' is looked up in the logger's run folders, and this run has no logger: "
     "give the checkpoint file"),
    ("empty_checkpoint", ["test", "--ckpt_path", f"{BROKEN}/empty.ckpt"],
     f"ckpt_path '{BROKEN}/empty.ckpt' is empty (0 bytes), not a checkpoint"),
    ("yaml_as_checkpoint", ["validate", "--ckpt_path", f"{BROKEN}/config.ckpt"],
     f"ckpt_path '{BROKEN}/config.ckpt' is not a checkpoint written by fit"),
    ("log_folder_under_a_file",
     ["fit", "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
      "--trainer.logger.init_args.save_dir", f"{BROKEN}/empty.ckpt/logs"],
     f"trainer.logger.init_args.save_dir '{BROKEN}/empty.ckpt/logs': '{BROKEN}/empty.ckpt' "
     f"is a file, not a folder; give a folder the run can write its logs and checkpoints in"),
    ("path_and_hub", ["fit", "--data.init_args.hub", "someone/corpus"],
     "data.path ("),
    ("name_without_hub", ["fit", "--data.init_args.name", "wikitext-2-v1"],
     "data.name and data.revision need data.hub"),
    ("files_typo", ["fit", "--data.init_args.files", "{train: tiny.trian.txt}"],
     "train file "),
    # a class-typed option given what is neither a file nor a class
    ("head_short_name", ["fit", "--model.head", "mixtape"],
     "model.init_args.head: no such file or class; did you mean configs/heads/mixtape.yaml or "
     "heads.MixtapeHead? (given 'mixtape')"),
    ("head_number", ["fit", "--model.head", "5"],
     "model.init_args.head: no such file or class (given '5')"),
    ("head_folder", ["fit", "--model.head", "configs/heads"],
     "model.init_args.head: no such file or class: a folder, give one of its files"),
    ("scheduler_without_its_required_option",
     ["fit", "--model.scheduler", "torch.optim.lr_scheduler.StepLR"],
     "model.init_args.scheduler: torch.optim.lr_scheduler.StepLR requires step_size: give "
     "--model.init_args.scheduler.init_args.step_size"),
    ("data_of_another_task", ["fit", "--data", "configs/data/multi30k.yaml"],
     "data: TranslationDataModule is not data for LanguageModel, which reads "
     "LanguageModelingDataModule or MarkovChainDataModule"),
    # sizes and counts below one
    *[(f"backbone_{option}_{value}",
       ["fit", f"--model.init_args.backbone.init_args.{option}", value],
       f"model.backbone.{option} must be a positive integer, got {value}")
      for option, value in (("hidden_size", "0"), ("embedding_size", "-1"),
                            ("output_size", "0"))],
    *[(f"trainer_{option}_0", ["fit", f"--trainer.{option}", "0"],
       f"trainer.{option} must be a positive ")
      for option in ("accumulate_grad_batches", "val_check_interval",
                     "check_val_every_n_epoch")],
]  # fmt: skip
if not torch.cuda.is_available():
    COMMAND_LINE.append(
        ("gpu_without_one", ["fit", "--trainer.accelerator", "gpu"],
         "trainer.accelerator: no GPU is usable on this machine; use --trainer.accelerator cpu")
    )  # fmt: skip


# One case per stage where a mistake is caught, each a real process (about 12 s of CPU to start
# on 2 cores: all 56 cases took 15 minutes of CI; every case runs in-process above): the config
# files and linked options read before the parser, the parser, the data's and the heads' and
# the Trainer's checks, the data's setup, the optimizer at fit's start, checkpoints, predict,
# the log folder, and the precision check.
IN_A_REAL_PROCESS = (
    "config_not_yaml", "linked_vocab_size", "subcommand_typo", "int_word", "head_option_typo",
    "lightning_optimizer", "bptt_0", "more_streams_than_tokens", "mixtape_k_not_power_of_two",
    "accelerator_typo", "negative_lr", "compile_mode_typo", "float16_weights_with_adam",
    "empty_checkpoint", "predict_without_prompts", "log_folder_under_a_file",
)  # fmt: skip


def in_broken(args: list[str], expected: str, broken: str) -> tuple[list[str], str]:
    """A COMMAND_LINE case with BROKEN replaced by the folder ``broken``."""
    return [a.replace(BROKEN, broken) for a in args], expected.replace(BROKEN, broken)


def one_error_line(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err[-2000:]
    assert "Traceback" not in err and "usage:" not in err, err[-2000:]
    return errors[0]


@pytest.mark.parametrize(("args", "expected"), [c[1:] for c in COMMAND_LINE],
                         ids=[c[0] for c in COMMAND_LINE])  # fmt: skip
def test_command_line_mistakes_are_one_line(cli_run, corpus, broken, capsys, args, expected):
    args, expected = in_broken(args, expected, broken)
    code = cli_run(args[0], *tiny_lm(corpus), *args[1:], console=True)
    assert code == 2
    assert one_error_line(capsys.readouterr().err).startswith(f"error: {expected}")


def test_a_truncated_checkpoint_is_named(cli_run, softmax_checkpoint, corpus, tmp_path, capsys):
    whole = Path(softmax_checkpoint).read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(whole[: len(whole) // 2])
    code = cli_run("test", *tiny_lm(corpus), "--ckpt_path", str(cut), console=True)
    assert error_line(capsys, code) == (
        f"error: ckpt_path '{cut}' is not a checkpoint written by fit (not a PyTorch archive, "
        f"or a truncated one)"
    )


def test_no_subcommand_is_one_line(capsys):
    assert console_main([]) == 2
    assert "subcommand" in one_error_line(capsys.readouterr().err)


def test_an_unreachable_hub_is_one_line(cli_run, capsys, monkeypatch):
    no_network(monkeypatch)
    code = cli_run("fit", "--data.init_args.hub", "someone/never-cached", *QUIET, *SMALL_LM,
                   experiment="ptb_softmax", console=True)  # fmt: skip
    line = error_line(capsys, code)
    assert line.startswith("error: cannot load hub dataset 'someone/never-cached'")
    assert "Point data.path at a local folder" in line


@pytest.mark.parametrize("subcommand", ["predict", "test", "validate"])
def test_evaluating_without_a_checkpoint_says_the_model_is_untrained(
    cli_run, corpus, capsys, subcommand
):
    """``test`` and ``validate`` printed an untrained model's perplexity without a word."""
    code = cli_run(subcommand, *tiny_lm(corpus), "--data.init_args.predict_prompts",
                   '["the cat"]', console=True)  # fmt: skip
    assert code == 0
    assert f"warning: {subcommand} without --ckpt_path: the model is untrained" in (
        capsys.readouterr().err.splitlines()
    )


def test_evaluating_a_pretrained_checkpoint_is_not_called_untrained(
    cli_run, softmax_checkpoint, corpus, capsys
):
    code = cli_run("test", *tiny_lm(corpus), "--model.init_args.pretrained_checkpoint",
                   softmax_checkpoint, console=True)  # fmt: skip
    assert code == 0
    assert "untrained" not in capsys.readouterr().err


def test_fit_without_a_setting_names_one(capsys):
    """It said "the following arguments are required: fit.model"."""
    code = console_main(["fit", "--config", "configs/presets/bf16.yaml"])
    assert error_line(capsys, code) == (
        "error: fit has no model: give a setting first, e.g. --config configs/lm/ptb.yaml "
        "(configs/lm, configs/mt and configs/ds hold them; presets stack after one)"
    )


def test_a_full_disk_when_a_checkpoint_is_written_is_one_line(
    cli_run, corpus, tmp_path, capsys, monkeypatch
):
    """The disk filling up mid-run ended in an OSError traceback from fsspec."""
    from lightning.fabric.plugins.io import torch_io

    def full(checkpoint, path):  # a checkpoint moved into place from a temporary file
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/tmp/tmpx", None, str(path))

    monkeypatch.setattr(torch_io, "_atomic_save", full)
    code = cli_run("fit", *tiny_lm(corpus), "--trainer.max_steps", "1",
                   "--trainer.enable_checkpointing", "true",
                   "--trainer.callbacks", "lightning.pytorch.callbacks.ModelCheckpoint",
                   "--trainer.callbacks.dirpath", str(tmp_path), console=True)  # fmt: skip
    line = error_line(capsys, code)
    assert re.fullmatch(
        rf"error: '{re.escape(str(tmp_path))}/[^']+\.ckpt': No space left on device: free space "
        r"on its disk or write elsewhere \(logs and checkpoints go under "
        r"--trainer\.logger\.init_args\.save_dir, the data cache under \$OUTPUT_HEADS_CACHE\)",
        line,
    ), line


def test_the_traceback_is_one_switch_away(cli_run, corpus, monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(Exception, match="Invalid learning rate"):
        cli_run("fit", *tiny_lm(corpus), "--model.init_args.optimizer.init_args.lr", "-1",
                console=True)  # fmt: skip


@pytest.mark.slow
def test_every_command_line_mistake_in_a_real_process(corpus, broken, tmp_path):
    """Cases of every stage as ``python cli.py`` processes: exit status 2, one line, no
    traceback."""
    cases = [c for c in COMMAND_LINE if c[0] in IN_A_REAL_PROCESS]
    assert len(cases) == len(IN_A_REAL_PROCESS), "a case named in IN_A_REAL_PROCESS is gone"
    for name, *case in cases:
        args, expected = in_broken(*case, broken)
        command = [sys.executable, "cli.py", args[0], "--trainer.default_root_dir", str(tmp_path),
                   *tiny_lm(corpus), *args[1:]]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, (name, done.stderr[-2000:])
        assert one_error_line(done.stderr).startswith(f"error: {expected}"), name


def test_a_checkpoint_of_another_task_names_both(
    cli_run, softmax_checkpoint, corpus, tmp_path, capsys
):
    """It printed the model's whole config as a file that does not exist (1,500 characters)."""
    checkpoint = torch.load(softmax_checkpoint, weights_only=False)
    checkpoint["hyper_parameters"]["_class_path"] = "lightning_modules.Translation"
    other = tmp_path / "translation.ckpt"
    torch.save(checkpoint, other)
    code = cli_run("test", *tiny_lm(corpus), "--ckpt_path", str(other), console=True)
    assert error_line(capsys, code) == (
        f"error: ckpt_path '{other}' is a Translation checkpoint (lightning_modules.Translation), "
        f"and this run's model is a LanguageModel (lightning_modules.LanguageModel): give a "
        f"LanguageModel checkpoint, or the config the checkpoint was trained with"
    )


def test_language_model_data_for_translation_is_one_line(cli_run, corpus, capsys):
    """A TypeError in the encoder's embedding (no source vocabulary) before."""
    code = cli_run("fit", *QUIET, "--data", "configs/data/ptb.yaml", "--data.init_args.path",
                   corpus, experiment="multi30k_softmax", console=True)  # fmt: skip
    assert error_line(capsys, code) == (
        "error: data: LanguageModelingDataModule is not data for Translation, which reads "
        "TranslationDataModule: give --data a config of the model's task (or --config the "
        "setting of the data's)"
    )


def test_a_parameter_shaping_option_other_than_the_checkpoints_is_refused(
    cli_run, softmax_checkpoint, corpus, capsys
):
    """Lightning put the checkpoint's tie_weights over the command line's without a word."""
    code = cli_run("test", *tiny_lm(corpus), "--ckpt_path", softmax_checkpoint,
                   "--model.init_args.tie_weights", "false", console=True)  # fmt: skip
    assert error_line(capsys, code) == (
        "error: model.tie_weights: the checkpoint was trained with tie_weights true, and it "
        "shapes the model's parameters: leave --model.tie_weights false out, or train anew "
        "without --ckpt_path"
    )


# -- silently wrong no more: refused, or said in a line -------------------------------------
def test_fit_from_a_checkpoint_freezes_the_backbone_the_command_line_freezes(
    cli_run, softmax_checkpoint, corpus, capsys
):
    """The checkpoint's freeze_backbone (false) replaced the command line's: the backbone
    trained on, without a word. Now the run's value, said in a warning line."""
    saved = torch.load(softmax_checkpoint, weights_only=False)["state_dict"]
    cli = cli_run("fit", *tiny_lm(corpus), "--ckpt_path", softmax_checkpoint,
                  "--model.freeze_backbone", "true", "--trainer.max_steps", "2",
                  "--trainer.max_epochs", "2")  # fmt: skip
    assert cli.trainer.global_step == 2 and cli.model.hparams.freeze_backbone is True
    for name, value in cli.model.backbone.state_dict().items():
        assert torch.equal(value, saved[f"backbone.{name}"]), name
    assert not torch.equal(cli.model.head.bias, saved["head.bias"])  # a step was trained
    assert (
        "warning: model.freeze_backbone: true, the run's, not the checkpoint's false (an option "
        "a run from a checkpoint may change)"
    ) in capsys.readouterr().err.splitlines()


def test_a_fit_without_a_logger_leaves_the_working_folders_config_alone(
    corpus, tmp_path, monkeypatch, capsys
):
    """Its config was saved as ./config.yaml over the user's own, their --config file too."""
    monkeypatch.chdir(tmp_path)
    mine = "# my experiment: keep this comment\ntrainer:\n  max_epochs: 1\n"
    (tmp_path / "config.yaml").write_text(mine)
    code = console_main(["fit", "--config", str(REPO / "configs/lm/ptb.yaml"), "--config",
                         "config.yaml", "--data.init_args.path", corpus, *QUIET,
                         *SMALL_LM])  # fmt: skip
    assert code == 0, capsys.readouterr().err[-2000:]
    assert (tmp_path / "config.yaml").read_text() == mine
    assert list(tmp_path.iterdir()) == [tmp_path / "config.yaml"]


def test_more_ds_experts_than_classes_is_refused(cli_run, corpus, capsys):
    code = cli_run("fit", *tiny_lm(corpus), "--model.head", "heads.DSSoftmaxHead",
                   "--model.init_args.head.init_args.num_experts", "64", console=True)  # fmt: skip
    assert re.fullmatch(
        r"error: num_experts \(64\) exceeds the \d+ classes: experts specialise on classes, "
        r"more can only duplicate each other; use at most \d+",
        error_line(capsys, code),
    )


BPE_OTHER_SIZE = {  # asked: the warning, the size it gives as its group 1
    "50000": r"data.bpe_vocab_size asked 50000 tokens but the training text gives only (\d+) "
             r"\(every word is one piece by then\): the BPE vocabulary has \1",
    "5": r"data.bpe_vocab_size asked 5 tokens but the training text's characters and the "
         r"special tokens alone are (\d+): the BPE vocabulary has \1 \(no merge learnt\)",
}  # fmt: skip


@pytest.mark.parametrize("asked", BPE_OTHER_SIZE)
def test_a_bpe_of_another_size_than_asked_is_a_warning(cli_run, corpus, tmp_path, caplog, asked):
    """Smaller: every word type is one piece already; larger: every character stays a piece
    (the 16 letters, <unk>, <eos> and the word-start mark)."""
    caplog.set_level(logging.INFO, logger="datamodules")
    code = cli_run("fit", *tiny_lm(corpus), "--data.init_args.vocab", "bpe",
                   "--data.init_args.bpe_vocab_size", asked, "--data.init_args.cache_dir",
                   str(tmp_path), "--trainer.max_steps", "1", console=True)  # fmt: skip
    assert code == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    found = re.fullmatch(BPE_OTHER_SIZE[asked], warnings[0])
    assert found
    trained = [r.getMessage() for r in caplog.records if "BPE of" in r.getMessage()]
    assert trained and trained[0].startswith(f"BPE of {found.group(1)} tokens trained")
    if asked == "5":
        assert int(found.group(1)) > len(set("".join(WORDS)))


@pytest.mark.parametrize("vocab", ["word", "hybrid_lightrnn"])
def test_a_prompt_of_unknown_words_is_a_warning(cli_run, corpus, caplog, vocab):
    """Over Hybrid-LightRNN codes too, where <unk> is a word that has one or two codes."""
    caplog.set_level(logging.INFO, logger="datamodules")
    code = cli_run("predict", *tiny_lm(corpus), "--data.init_args.predict_prompts",
                   '["zebra quokka", "the cat"]', "--data.init_args.vocab", vocab,
                   "--data.init_args.lightrnn_frequent", "3", console=True)  # fmt: skip
    assert code == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "prompt 'zebra quokka': no word of it is in the vocabulary (all <unk>)",
        "warning: predict: 2 of 4 prompt tokens (50.00%), in 1 of 2 lines, were read as <unk> "
        "(not in the vocabulary, or written <unk>)",
    ]


def test_a_file_of_unknown_prompts_names_five_and_counts_them_all(cli_run, corpus, caplog):
    """Thousands of prompts of unknown words (a PTB file of literal ``<unk>``) would flood
    stderr with a line each: five are named, predict's closing line counts them all."""
    caplog.set_level(logging.INFO, logger="datamodules")
    prompts = json.dumps([f"zebra{i}" for i in range(7)])
    code = cli_run("predict", *tiny_lm(corpus), "--data.init_args.predict_prompts", prompts,
                   console=True)  # fmt: skip
    assert code == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    named = [f"prompt 'zebra{i}': no word of it is in the vocabulary (all <unk>)" for i in range(5)]
    named[-1] += " (further ones not named)"
    assert warnings == [
        *named,
        "warning: predict: 7 of 7 prompt tokens (100.00%), in 7 of 7 lines, were read as <unk> "
        "(not in the vocabulary, or written <unk>)",
    ]


@pytest.mark.slow
def test_under_ddp_one_process_prints_the_error(corpus, tmp_path):
    """Both ranks meet the NaN loss; the line is printed once, and the run exits 2."""
    command = [sys.executable, "cli.py", "fit", "--trainer.default_root_dir", str(tmp_path),
               *tiny_lm(corpus),
               "--config", "configs/presets/ddp_cpu.yaml",
               "--model.init_args.optimizer.init_args.lr", ".inf",
               "--trainer.gradient_clip_val", "null"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert one_error_line(done.stderr).startswith("error: non-finite train loss (nan) at step 1")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--trainer.val_check_interval", "50"],  # QUIET: limit_train_batches 2
         "error: trainer.val_check_interval 50 is more training batches than an epoch has "
         "(trainer.limit_train_batches 2): give a fraction of an epoch, e.g. "
         "--trainer.val_check_interval 1.0"),
        (["--trainer.val_check_interval", "50", "--trainer.overfit_batches", "3"],
         "error: trainer.val_check_interval 50 is more training batches than an epoch has "
         "(trainer.overfit_batches 3)"),
        (["--model.scheduler_interval", "step"],  # the setting's ReduceLROnPlateau
         "error: model.scheduler_interval step: ReduceLROnPlateau steps on a validation's "
         "val/loss"),
    ],
    ids=["val_check_interval_over_the_epoch", "over_overfit_batches", "plateau_per_step"],
)  # fmt: skip
def test_fit_options_lightning_refuses_late_are_refused_before_the_data(
    cli_run, corpus, capsys, monkeypatch, args, expected
):
    """Lightning (and configure_optimizers) refused these only after the data was prepared: a
    large corpus tokenised first."""
    from datamodules import LanguageModelingDataModule

    def prepared(self):
        raise AssertionError("the data was prepared before the refusal")

    monkeypatch.setattr(LanguageModelingDataModule, "prepare_data", prepared)
    code = cli_run("fit", *tiny_lm(corpus), *args, console=True)
    assert error_line(capsys, code).startswith(expected)


def test_an_interval_over_the_epoch_counts_across_epochs_without_check_val_every_n_epoch(
    cli_run, corpus
):
    """Lightning's own meaning of check_val_every_n_epoch null: not refused."""
    across = ["--trainer.check_val_every_n_epoch", "null", "--trainer.max_epochs", "2"]
    cli = cli_run("fit", *tiny_lm(corpus), "--trainer.val_check_interval", "3", *across)
    assert cli.trainer.global_step == 4 and cli.trainer.val_check_batch == 3
