"""Bad input stops with one line naming what to fix (README, "Bad input"), through cli.py.

Each case runs ``cli.console_main`` as ``python cli.py`` would and checks the exact line it
prints and its exit status (2); the cases that jsonargparse reports itself (unknown keys and
classes) check its message. Tiny corpora keep every case to about a second.
"""

import sys
import tempfile
from pathlib import Path

import pytest

from cli import console_main

ROOT = tempfile.mkdtemp(prefix="bad-input-test-")
WORDS = "the cat sat on a mat and dog ran to red hat in big old box".split()
QUIET = [
    "--trainer.default_root_dir", ROOT, "--trainer.logger", "false",
    "--trainer.callbacks", "null", "--trainer.enable_checkpointing", "false",
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


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["cli.py"])


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
def softmax_checkpoint(tmp_path_factory, corpus) -> str:
    """A SoftmaxHead LM trained for one step on the tiny corpus."""
    out = tmp_path_factory.mktemp("ckpt")
    sys_argv, sys.argv = sys.argv, ["cli.py"]
    try:
        assert lm("fit", corpus, "--trainer.max_steps", "1",
                  "--trainer.enable_checkpointing", "true",
                  "--trainer.callbacks", "lightning.pytorch.callbacks.ModelCheckpoint",
                  "--trainer.callbacks.dirpath", str(out)) == 0  # fmt: skip
    finally:
        sys.argv = sys_argv
    return str(next(out.glob("*.ckpt")))


def lm(subcommand: str, path: str, *extra: str, config: str = "ptb_softmax") -> int:
    return console_main([subcommand, "--config", f"configs/lm/{config}.yaml",
                         "--data.init_args.path", path, *QUIET, *SMALL_LM, *extra])  # fmt: skip


def error_line(capsys, code: int) -> str:
    """The one line the CLI printed for the error (checked to be the only ``error:`` line)."""
    assert code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    return errors[0]


# -- data ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/no/such/dir", "shared/data/ptb"])
def test_missing_data_path(capsys, path):
    """A missing folder, absolute or relative, is never tried as a hub name."""
    code = lm("fit", path)
    assert error_line(capsys, code) == (
        f"error: data path {path!r} does not exist or is not a folder; set data.path to a "
        f"local folder, data.hub to a Hugging Face dataset name, or leave both unset for the "
        f"shipped Penn Treebank (as configs/data/ptb*.yaml do)"
    )


def test_empty_corpus(tmp_path, capsys):
    write_lm_corpus(tmp_path, WORDS)
    (tmp_path / "tiny.train.txt").write_text("")
    code = lm("fit", str(tmp_path))
    assert error_line(capsys, code) == f"error: train file '{tmp_path}/tiny.train.txt' is empty"


@pytest.mark.parametrize(
    ("option", "value"), [("bptt", "0"), ("batch_size", "-3"), ("eval_batch_size", "0")]
)
def test_bptt_and_batch_sizes_must_be_positive(corpus, option, value, capsys):
    code = lm("fit", corpus, f"--data.init_args.{option}", value)
    assert error_line(capsys, code) == (
        f"error: data.{option} must be a positive integer, got {value}"
    )


def test_more_streams_than_the_corpus_fills(corpus, capsys):
    code = lm("fit", corpus, "--data.init_args.batch_size", "1000")
    assert error_line(capsys, code) == (
        "error: train split with data.batch_size=1000: 480 tokens are too few for 1000 "
        "streams of at least 2"
    )


def test_unknown_vocabulary_type(corpus, capsys):
    code = lm("fit", corpus, "--data.init_args.vocab", "chars")
    assert error_line(capsys, code) == (
        "error: data.vocab must be one of word, bpe, hybrid_lightrnn, got 'chars'"
    )


def test_lightrnn_without_frequent_words(corpus, capsys):
    code = lm("fit", corpus, "--data.init_args.vocab", "hybrid_lightrnn",
              "--data.init_args.lightrnn_frequent", "0")  # fmt: skip
    assert error_line(capsys, code) == (
        "error: data.vocab=hybrid_lightrnn (data.lightrnn_*): "
        "Hybrid-LightRNN num_frequent must be a positive integer, got 0"
    )


def test_parallel_files_of_different_lengths(tmp_path, capsys):
    for prefix in ("train", "val", "test_2016_flickr"):
        (tmp_path / f"{prefix}.de").write_text("ein Hund\neine Katze\n")
        (tmp_path / f"{prefix}.en").write_text("a dog\na cat\n")
    (tmp_path / "train.en").write_text("a dog\n")
    code = console_main(["fit", "--config", "configs/mt/multi30k_softmax.yaml", *QUIET,
                         "--data.init_args.path", str(tmp_path)])  # fmt: skip
    assert error_line(capsys, code) == (
        f"error: misaligned parallel train files: '{tmp_path}/train.de' has 2 lines but "
        f"'{tmp_path}/train.en' has 1; line i of one side must translate line i of the other"
    )


def test_predict_without_prompts(corpus, capsys):
    code = lm("predict", corpus)
    assert error_line(capsys, code) == (
        "error: predict needs prompts: set data.predict_prompts, e.g. "
        "--data.predict_prompts '[\"the company said\"]'"
    )


# -- heads and their options against the vocabulary ----------------------------------------
def test_mixtape_components_not_a_power_of_two(corpus, capsys):
    code = lm("fit", corpus, "--model.init_args.head.init_args.num_components", "3",
              config="ptb_mixtape")  # fmt: skip
    assert error_line(capsys, code) == (
        "error: MixtapeHead num_components must be a power of two >= 2 (sigmoid tree, Eq. 3), got 3"
    )


def test_mixtape_frequent_ratio_out_of_range(corpus, capsys):
    code = lm("fit", corpus, "--model.init_args.head.init_args.frequent_ratio", "0",
              config="ptb_mixtape")  # fmt: skip
    assert (
        error_line(capsys, code) == "error: MixtapeHead frequent_ratio r must be in (0, 1], got 0.0"
    )


def test_mos_needs_a_positive_number_of_components(corpus, capsys):
    code = lm("fit", corpus, "--model.init_args.head.init_args.num_components", "0",
              config="ptb_mos")  # fmt: skip
    assert error_line(capsys, code) == "error: num_components must be a positive integer, got 0"


ADAPTIVE = ["--model.init_args.head.init_args.div_value", "2"]


def test_adaptive_cutoffs_not_increasing(corpus, capsys):
    code = lm("fit", corpus, *ADAPTIVE, "--model.init_args.head.init_args.cutoffs", "[8, 4]",
              config="ptb_adaptive")  # fmt: skip
    assert error_line(capsys, code) == (
        "error: AdaptiveSoftmaxHead cutoffs must be increasing positive integers below the "
        "vocabulary size 18, got [8, 4]"
    )


def test_adaptive_cutoffs_beyond_the_vocabulary(corpus, capsys):
    # the PTB config's cut-offs with a vocabulary of 18 words
    code = lm("fit", corpus, *ADAPTIVE, "--model.init_args.head.init_args.cutoffs", "[5, 386]",
              config="ptb_adaptive")  # fmt: skip
    assert error_line(capsys, code) == (
        "error: AdaptiveSoftmaxHead cutoffs must be increasing positive integers below the "
        "vocabulary size 18, got [5, 386]"
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


def test_non_positive_temperature(corpus, capsys):
    code = lm("fit", corpus, "--model.init_args.temperature", "0")
    assert error_line(capsys, code) == "error: model.temperature must be positive, got 0.0"


# -- checkpoints -----------------------------------------------------------------------------
def test_missing_checkpoint_file(corpus, capsys):
    code = lm("test", corpus, "--ckpt_path", "/no/such.ckpt")
    assert (
        error_line(capsys, code)
        == "error: ckpt_path '/no/such.ckpt' does not exist or is not a file"
    )


def test_checkpoint_from_another_vocabulary(softmax_checkpoint, tmp_path, capsys):
    other = write_lm_corpus(tmp_path, [w.upper() for w in WORDS])
    code = lm("test", other, "--ckpt_path", softmax_checkpoint)
    line = error_line(capsys, code)
    assert line.startswith("error: the checkpoint was trained with another vocabulary (18 tokens")
    assert f"than the data at '{other}' gives (18 tokens" in line


def test_checkpoint_from_another_head(softmax_checkpoint, corpus, capsys):
    code = lm("test", corpus, "--ckpt_path", softmax_checkpoint, config="ptb_mixtape")
    assert error_line(capsys, code) == (
        "error: the checkpoint was trained with SoftmaxHead, not MixtapeHead: "
        "set --model.head.class_path heads.softmax.SoftmaxHead (and its options)"
    )


def test_checkpoint_with_other_head_options(softmax_checkpoint, corpus, capsys):
    code = lm("test", corpus, "--ckpt_path", softmax_checkpoint,
              "--model.init_args.head.init_args.bias", "false")  # fmt: skip
    assert error_line(capsys, code) == (
        "error: the checkpoint's head has other parameters than this SoftmaxHead (missing [], "
        "unexpected ['bias']): configure the head it was trained with"
    )


def test_tied_head_with_another_embedding_size(corpus, capsys):
    code = lm("fit", corpus, "--model.init_args.head.init_args.embedding_size", "8")
    assert error_line(capsys, code) == (
        "error: cannot tie SoftmaxHead.weight of shape (18, 8) to an embedding of shape "
        "(18, 16): set the head's embedding_size to the backbone's embedding size (16)"
    )


def test_missing_pretrained_checkpoint(corpus, capsys):
    code = lm("fit", corpus, "--model.init_args.pretrained_checkpoint", "/no/such.ckpt")
    assert error_line(capsys, code) == "error: pretrained_checkpoint '/no/such.ckpt' does not exist"


# -- training ----------------------------------------------------------------------------------
def test_nan_loss_stops_naming_the_step_and_the_head(corpus, capsys):
    # an infinite learning rate makes the weights inf and nan after the first Adam step, on any
    # CPU (a merely huge one, 1e30, left the loss finite on some: tanh saturates)
    code = lm("fit", corpus, "--model.init_args.optimizer.init_args.lr", ".inf",
              "--trainer.gradient_clip_val", "null")  # fmt: skip
    assert error_line(capsys, code) == (
        "error: non-finite train loss (nan) at step 1 with SoftmaxHead: lower the learning "
        "rate or check the precision"
    )


# -- what jsonargparse reports itself (LightningCLI's own messages) ---------------------------
def test_config_key_that_does_not_exist(corpus, capsys):
    with pytest.raises(SystemExit) as exit_:
        lm("fit", corpus, "--data.init_args.bptt_length", "5")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "bptt_length" in err and "error:" in err


def test_head_class_that_does_not_exist(corpus, capsys):
    with pytest.raises(SystemExit) as exit_:
        lm("fit", corpus, "--model.init_args.head.class_path", "heads.NoSuchHead")
    assert exit_.value.code == 2
    assert "heads.NoSuchHead" in capsys.readouterr().err
