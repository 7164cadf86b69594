"""The study grid schema: what a grid file may say, and the one clear error when it cannot."""

import pytest
import yaml

from app.study.grid import StudyConfigError, cli_value, load_grid, override_args, parse_grid

VALID = {
    "name": "g",
    "base": "configs/lm/ptb.yaml",
    "heads": {"softmax": "configs/heads/softmax.yaml",
              "mixtape": {"head": "configs/heads/mixtape.yaml",
                          "overrides": {"model.init_args.head.init_args.gate_noise": 0.0}}},
    "seeds": [1, 2],
    "overrides": {"trainer.limit_train_batches": 5},
    "budget": {"max_epochs": 3},
}  # fmt: skip


def test_runs_cross_heads_variants_and_seeds_with_merged_overrides():
    grid = parse_grid({**VALID, "variants": {"bf16": {"trainer.precision": "bf16-mixed"}}})
    runs = grid.runs()
    assert [(r.label, r.seed) for r in runs] == [
        ("softmax+bf16", 1), ("softmax+bf16", 2), ("mixtape+bf16", 1), ("mixtape+bf16", 2)
    ]  # fmt: skip
    assert str(runs[2].relative_dir) == "mixtape__bf16/seed1"
    assert grid.run_overrides(runs[2]) == {
        "trainer.limit_train_batches": 5,
        "trainer.max_epochs": 3,
        "trainer.precision": "bf16-mixed",
        "model.init_args.head.init_args.gate_noise": 0.0,
    }
    assert grid.metric == "test/ppl" and grid.mode == "min" and grid.curve_metric == "val/ppl"
    assert grid.baseline == "softmax" and grid.run_base(runs[0]) == [VALID["base"]]


def test_bleu_is_maximised_and_a_head_may_bring_its_own_base():
    content = {k: v for k, v in VALID.items() if k != "base"}
    content["heads"] = {"mos": {"base": "configs/lm/awd_ptb_mos.yaml"}}
    grid = parse_grid({**content, "metric": "test/bleu"})
    assert grid.mode == "max" and grid.curve_metric == "val/bleu"
    assert grid.run_base(grid.runs()[0]) == ["configs/lm/awd_ptb_mos.yaml"]
    assert grid.runs()[0].head.fragment is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"name": "a b"}, "name must match"),
        ({"colour": 1}, r"unknown keys \['colour'\]"),
        ({"seeds": [1, 1]}, "distinct integers"),
        ({"seeds": []}, "distinct integers"),
        ({"heads": {"softmax": "configs/heads/nope.yaml"}}, "does not exist"),
        ({"heads": {"a+b": "configs/heads/softmax.yaml"}}, "head label"),
        ({"base": "configs/lm/ptb_softmax.txt"}, "YAML config path"),
        ({"metric": "val/ppl"}, "must be a test metric"),
        ({"baseline": "mos"}, "is not one of the heads"),
        ({"rank": {"contexts": 1}}, "rank must be"),
        ({"overrides": ["--trainer.max_epochs", "1"]}, "overrides must be a mapping"),
        ({"instability_threshold": 0}, "instability_threshold"),
        ({"reference": {"values": {"softmax": 59}}}, "reference must be"),
        # wrong types and unknown keys inside a value, found by the jsonargparse schema
        ({"rank": {"split": "train"}}, "rank must be"),
        ({"heads": {"a": {"head": "configs/heads/softmax.yaml", "colour": 1}}}, "heads must be"),
        ({"heads": {"a": {"overrides": {}}}}, r"heads.a must be a fragment path"),
        ({"seeds": [True]}, "distinct integers"),
        ({"variants": {"v": [1]}}, "variants must be a mapping"),
        ({"finetune": {"configs": 3}}, "finetune takes configs"),
        ({"mode": "best"}, "mode must be min or max"),
    ],
)
def test_bad_grids_get_one_clear_error(change, message):
    with pytest.raises(StudyConfigError, match=message):
        parse_grid({**VALID, **change}, "grid.yaml")


def test_the_grid_is_read_not_rewritten():
    """Option values stay as written (the CLI reads them), and the content is left as it was."""
    import copy

    content = copy.deepcopy({**VALID, "overrides": {"trainer.max_time": "00:01:00:00",
                                                    "model.init_args.lr": "1e-3"}})  # fmt: skip
    grid = parse_grid(content)
    assert content == {**VALID, "overrides": {"trainer.max_time": "00:01:00:00",
                                              "model.init_args.lr": "1e-3"}}  # fmt: skip
    assert grid.overrides == content["overrides"] and grid.raw == content
    assert grid.heads[1].overrides == {"model.init_args.head.init_args.gate_noise": 0.0}


def test_missing_base_is_named():
    with pytest.raises(StudyConfigError, match="missing 'base'"):
        parse_grid({k: v for k, v in VALID.items() if k != "base"})


def test_load_grid_reads_yaml_and_names_a_missing_file(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(VALID))
    assert load_grid(path).name == "g"
    with pytest.raises(StudyConfigError, match="does not exist"):
        load_grid(tmp_path / "nope.yaml")


def test_override_values_read_back_as_the_same_yaml():
    values = {"a": True, "b": None, "c": 0.5, "d": [1, 2], "e": {"x": 1}, "f": "00:01:00:00"}
    args = override_args(values)
    assert args[::2] == [f"--{k}" for k in values]
    assert [yaml.safe_load(v) for v in args[1::2]][:5] == [True, None, 0.5, [1, 2], {"x": 1}]
    assert cli_value("00:01:00:00") == "00:01:00:00"


def test_a_key_given_twice_is_refused_not_silently_dropped(tmp_path):
    """PyYAML keeps the second of two equal keys: a head label pasted twice ran one head."""
    path = tmp_path / "g.yaml"
    path.write_text(
        "name: g\nbase: configs/lm/ptb.yaml\nseeds: [1]\nheads:\n"
        "  softmax: configs/heads/softmax.yaml\n  softmax: configs/heads/mixtape.yaml\n"
    )
    with pytest.raises(StudyConfigError, match=r"key 'softmax' is given twice .*line 6") as error:
        load_grid(path)
    assert "\n" not in str(error.value)


def test_two_runs_sharing_a_folder_are_refused():
    """``+`` becomes ``__`` in a folder name: head ``a`` with variant ``b__c`` and head
    ``a__b`` with variant ``c`` would resume and overwrite each other's runs."""
    content = {**VALID, "heads": {"a": "configs/heads/softmax.yaml",
                                  "a__b": "configs/heads/mixtape.yaml"},
               "variants": {"b__c": {}, "c": {}}}  # fmt: skip
    with pytest.raises(StudyConfigError, match=r"'a\+b__c' and 'a__b\+c' would share the folder"):
        parse_grid(content, "grid.yaml")
