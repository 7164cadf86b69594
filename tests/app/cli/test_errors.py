"""``app/cli/errors.py`` on its own: jsonargparse's blocks into one line, config checks."""

from pathlib import Path

import pytest

from app.cli.errors import CommandLineError, check_config_files, check_linked_options, one_line

UNION_BLOCK = """Parser key "data":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning.pytorch.core.datamodule.LightningDataModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'datamodules.LanguageModelingDataModule':
        Parser key "bptt":
          Expected a <class 'int'>. Got value: thirty
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='bptt', val='thirty')"""


def test_a_nested_union_block_is_the_key_the_reason_and_the_value():
    assert one_line(UNION_BLOCK) == "data.init_args.bptt: expected an int (given 'thirty')"


def test_a_mapping_without_spaces_after_its_colons_gets_the_yaml_rule():
    block = UNION_BLOCK.replace("bptt", "files").replace("thirty", "{train:a,valid:b}")
    block = block.replace("Expected a <class 'int'>", "Expected a <class 'dict'>")
    assert one_line(block) == (
        "data.init_args.files: expected a dict; YAML needs a space after each colon, as in "
        "'{train: train}' (given '{train:a,valid:b}')"
    )
    spaced = block.replace("{train:a,valid:b}", "{train: a, valid: [b]}")
    assert one_line(spaced).endswith("expected a dict (given '{train: a, valid: [b]}')")


def test_unknown_options_get_the_closest_known_ones():
    known = ["--trainer.max_epochs", "--trainer.min_epochs", "--trainer", "--data.bptt"]
    line = one_line("unrecognized arguments: --trainer.max_epoch 1", known)
    assert line.startswith(  # the option cut short first, then the closest spellings
        "unknown option --trainer.max_epoch; did you mean --trainer.max_epochs or "
        "--trainer.min_epochs"
    )


def test_yaml_strings_given_as_config_are_not_taken_for_files(tmp_path):
    """``app.cli.lightning_cli.build`` passes saved configs as YAML text, longer than any path."""
    text = "model:\n  init_args:\n    x: " + "y" * 5000 + "\n"
    check_config_files(["--config", text])
    check_linked_options(["--config", text])
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1\n")
    with pytest.raises(CommandLineError, match=r"--config '.*broken.yaml' is not a YAML file"):
        check_config_files(["--config", str(broken)])


def test_a_linked_option_in_a_config_file_is_refused(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  init_args:\n    head:\n      init_args:\n        vocab_size: 9\n")
    with pytest.raises(CommandLineError, match="set by the CLI from data.vocab_size"):
        check_linked_options(["--config", str(config)])


# a model whose scheduler misses a required option: jsonargparse gives the whole model config
# as the value (a path inside it, and longer than any file name)
MODEL = (
    "Namespace(class_path='lightning_modules.LanguageModel', init_args=Namespace(backbone="
    "Namespace(class_path='lightning_modules.backbones.LSTMBackbone', init_args=Namespace("
    + "hidden_size=200, " * 30
    + "__path__=Path_fsr(../backbones/lstm_ptb.yaml, cwd=/repo/configs/lm)))))"
)
MISSING_ARGUMENT = f"""Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'lightning_modules.LanguageModel':
        Parser key "scheduler":
          Does not validate against any of the Union subtypes
          Subtypes: [typing.Callable[[torch.optim.optimizer.Optimizer], typing.Union[torch.optim.lr_scheduler.LRScheduler, lightning.pytorch.cli.ReduceLROnPlateau]], <class 'NoneType'>]
          Errors:
            - Type typing.Callable[[torch.optim.optimizer.Optimizer], typing.Union[torch.optim.lr_scheduler.LRScheduler, lightning.pytorch.cli.ReduceLROnPlateau]] expects a function or a callable class: the following arguments are required: step_size
            - Expected a <class 'NoneType'>
          Given value type: <class 'jsonargparse._namespace.Namespace'>
          Given value: Namespace(class_path='torch.optim.lr_scheduler.StepLR', __path__=Path_fsr(../optimizers/plateau.yaml, cwd=/repo/configs/lm), init_args=Namespace(step_size=None, gamma=0.1, last_epoch=-1))
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._namespace.Namespace'>
  Given value: {MODEL}"""  # noqa: E501


def test_a_whole_model_given_is_the_innermost_key_and_its_reason():
    """The model's Namespace was taken for a file name: a 1,500-character line, or an OSError
    (File name too long) from ``Path.exists`` with a traceback."""
    assert one_line(MISSING_ARGUMENT) == (
        "model.init_args.scheduler: torch.optim.lr_scheduler.StepLR requires step_size: give "
        "--model.init_args.scheduler.init_args.step_size"
    )


def test_a_whole_model_given_without_an_inner_key_is_not_quoted_or_taken_for_a_file():
    block = f"""Parser key "model":
  Does not validate against any of the Union subtypes
  Errors:
    - Expected a <class 'NoneType'>
  Given value: {MODEL}"""
    line = one_line(block)
    assert line.startswith("model: ") and "Namespace(" not in line and len(line) < 200


def head_block(value: str) -> str:
    """jsonargparse's block for ``--model.head <value>``: neither a file nor an import path."""
    return f"""Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning.pytorch.core.module.LightningModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'lightning_modules.LanguageModel':
        Parser key "head":
          - Expected a path but {value} either not accessible or invalid
          - Expected a dot import path string: {value}
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>
  Given value: NestedArg(key='head', val='{value}')"""


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("mixtape", "no such file or class; did you mean configs/heads/mixtape.yaml or "
                    "heads.MixtapeHead? (given 'mixtape')"),
        ("softmx", "no such file or class; did you mean configs/heads/softmax.yaml? "
                   "(given 'softmx')"),
        ("5", "no such file or class (given '5')"),
        ("configs/heads", "no such file or class: a folder, give one of its files "
                          "(given 'configs/heads')"),
    ],
)  # fmt: skip
def test_a_head_that_is_neither_a_file_nor_a_class(value, expected, monkeypatch):
    """It said "Expected a <class 'NoneType'>"; a fragment's short name gets its file."""
    monkeypatch.chdir(Path(__file__).resolve().parents[3])  # configs/ as a user types it
    assert one_line(head_block(value)) == f"model.init_args.head: {expected}"


def write_fragment(path: Path, init_args: str) -> str:
    path.write_text(f"class_path: heads.SoftmaxHead\ninit_args: {{{init_args}}}\n")
    return str(path)


@pytest.mark.parametrize("flag", ["--model.head", "--model.init_args.head"])
@pytest.mark.parametrize("joined", [False, True])
def test_a_linked_option_in_a_head_fragment_is_refused(tmp_path, flag, joined):
    """A fragment given as --model.head ran with the linked sizes in place of its own, without
    a word."""
    head = write_fragment(tmp_path / "myhead.yaml", "hidden_size: 64, vocab_size: 50")
    args = [f"{flag}={head}"] if joined else [flag, head]
    with pytest.raises(CommandLineError, match=r"hidden_size \(in '.*myhead.yaml'\): set by"):
        check_linked_options(["fit", "--config", "configs/lm/ptb.yaml", *args])


def test_a_linked_option_in_a_fragment_named_by_a_config_or_written_out_is_refused(tmp_path):
    write_fragment(tmp_path / "head.yaml", "vocab_size: 50")
    config = tmp_path / "setting.yaml"
    config.write_text("model:\n  init_args:\n    head: head.yaml\n")
    with pytest.raises(CommandLineError, match="head.init_args.vocab_size .*data.vocab_size"):
        check_linked_options(["--config", str(config)])
    backbone = "{class_path: LSTMBackbone, init_args: {vocab_size: 50}}"
    with pytest.raises(CommandLineError, match="backbone.init_args.vocab_size: set by the CLI"):
        check_linked_options(["--model.backbone", backbone])
    check_linked_options(["--model.head", write_fragment(tmp_path / "ok.yaml", "bias: false")])


def test_a_torch_value_error_is_one_line_only_while_the_config_is_built():
    """nn.Dropout's check of a head option (given while jsonargparse builds the head) is the
    user's; the same ValueError in a step is a bug and keeps its traceback."""
    import torch
    from jsonargparse import ArgumentParser

    from app.cli.console import error_line

    class Head(torch.nn.Module):
        def __init__(self, gate_dropout: float = 0.0) -> None:
            super().__init__()
            self.gate_dropout = torch.nn.Dropout(gate_dropout)

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(Head, "head")
    with pytest.raises(Exception) as built:
        parser.instantiate_classes(parser.parse_args(["--head.gate_dropout", "1.5"]))
    assert error_line(built.value) == (
        f"{Head.__module__}.{Head.__qualname__}: dropout probability has to be between 0 and 1, "
        f"but got 1.5"
    )
    with pytest.raises(ValueError) as stepped:
        torch.nn.functional.dropout(torch.ones(2), 1.5)
    assert error_line(stepped.value) is None


def test_a_disk_error_names_the_file_written_and_other_os_errors_keep_their_traceback():
    import errno
    import os

    from app.cli.console import error_line

    def raised(exc: OSError) -> OSError:
        try:
            raise exc
        except OSError as caught:
            return caught

    moved = raised(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/tmp/t", None, "/l/a.ckpt"))
    assert error_line(moved) == (
        "'/l/a.ckpt': No space left on device: free space on its disk or write elsewhere (logs "
        "and checkpoints go under --trainer.logger.init_args.save_dir, the data cache under "
        "$OUTPUT_HEADS_CACHE)"
    )
    read_only = raised(OSError(errno.EROFS, os.strerror(errno.EROFS), "/ro/x"))
    assert error_line(read_only).startswith("'/ro/x': Read-only file system: write elsewhere (")
    assert error_line(raised(FileNotFoundError(errno.ENOENT, "No such file", "/x"))) is None
