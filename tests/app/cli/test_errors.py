"""``app/cli/errors.py`` on its own: jsonargparse's blocks into one line, config checks."""

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
