"""``check`` and ``run`` parse every cell's ``cli.py fit`` command before anything starts: a
bad override in one cell was found only when that cell came up, maybe days into the study."""

import yaml

from app.study import parse_grid, preflight, runner
from app.study.__main__ import main

MIXTAPE = "configs/heads/mixtape.yaml"


def _grid(tmp_path, heads, variants=None):
    grid = tmp_path / "grid.yaml"
    content = {"name": "cells", "base": "configs/lm/ptb.yaml", "seeds": [1, 2, 3], "heads": heads}
    if variants:
        content["variants"] = variants
    grid.write_text(yaml.safe_dump(content, sort_keys=False))
    return grid


BAD = {
    "softmax": "configs/heads/softmax.yaml",
    # a typo'd option, a wrong class path, a value the data module refuses, one the head refuses
    "typo": {"head": MIXTAPE, "overrides": {"trainer.max_epoch": 3}},
    "cls": {"head": MIXTAPE, "overrides": {"model.init_args.optimizer": "torch.optim.Adamm"}},
    "bptt": {"head": MIXTAPE, "overrides": {"data.init_args.bptt": 0}},
    "k3": {"head": MIXTAPE, "overrides": {"model.init_args.head.init_args.num_components": 3}},
}


def test_check_names_each_bad_cell_once_with_the_cli_error_and_exits_2(tmp_path, capsys):
    grid = _grid(tmp_path, BAD)
    assert main(["check", str(grid)]) == 2
    out, err = capsys.readouterr()
    assert "15 runs (5 heads x 1 variants x 3 seeds)" in out
    assert err.splitlines() == [  # one line a cell, not a seed
        "cells typo: error: unknown option --trainer.max_epoch; did you mean "
        "--trainer.max_epochs or --trainer.min_epochs or --trainer.max_steps?",
        "cells cls: error: model.init_args.optimizer: no class 'Adamm' in module 'torch.optim'; "
        "did you mean torch.optim.Adam or torch.optim.RAdam or torch.optim.NAdam? "
        "(given 'torch.optim.Adamm')",
        "cells bptt: error: data.bptt must be a positive integer, got 0",
        "cells k3: error: MixtapeHead num_components must be a power of two >= 2 (sigmoid tree, "
        "Eq. 3), got 3",
    ]


def test_run_refuses_a_grid_with_a_bad_cell_before_starting_anything(tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(runner._STAGES, "call", lambda args, **kw: started.append(args) or 1)
    grid = _grid(tmp_path, {"softmax": "configs/heads/softmax.yaml"},
                 variants={"ok": {}, "bad": {"data.init_args.batch_size": "twenty"}})  # fmt: skip
    out_dir = tmp_path / "runs"
    assert main(["run", str(grid), "--out", str(out_dir)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0] == (
        "cells softmax+bad: error: data.init_args.batch_size: expected an int (given 'twenty')"
    )
    assert "nothing was started" in err[1]
    assert not started and not out_dir.exists()


def test_a_vocabulary_dependent_refusal_is_left_to_the_data(tmp_path):
    """The model is built with stand-in vocabulary sizes: cut-offs above the smaller one are
    the data's to judge, not an error of the cell."""
    args = ["--config", "configs/lm/ptb.yaml", "--model.head", "configs/heads/adaptive_ptb.yaml",
            "--model.tie_weights", "false"]  # fmt: skip
    assert preflight.check_args(args, tmp_path) is None
    unordered = ["--model.init_args.head.init_args.cutoffs", "[3011, 386]"]
    assert preflight.check_args(args + unordered, tmp_path) is None  # (its message names V)
    missing = ["--model.init_args.pretrained_checkpoint", str(tmp_path / "none.ckpt")]
    assert "does not exist" in preflight.check_args(args + missing, tmp_path)


def test_cells_are_parsed_once_per_head_and_variant_with_the_fine_tuning_stage():
    grid = parse_grid({
        "name": "ft", "base": "configs/lm/ptb.yaml", "seeds": [1, 2],
        "heads": {"softmax": "configs/heads/softmax.yaml", "mixtape": MIXTAPE},
        "finetune": {"overrides": {"trainer.max_epochs": 3}},
    })  # fmt: skip
    cells = preflight.cells(grid)
    assert [name for name, _ in cells] == [
        "softmax", "softmax (finetune)", "mixtape", "mixtape (finetune)"
    ]  # fmt: skip
    assert cells[1][1][-2:] == ["--trainer.max_epochs", "3"]
