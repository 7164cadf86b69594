"""The runner end to end on CPU: the tiny grid CI runs (configs/studies/tiny_cpu.yaml), two
heads x two seeds through ``cli.py fit`` and ``cli.py test`` in subprocesses, two at a time."""

import json
import os
import re

import pytest
import torch

from app.study import load_grid, parse_grid, render_markdown, run_study
from app.study.runner import _csv_versions


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("studies")
    lines = []
    grid = load_grid("configs/studies/tiny_cpu.yaml")
    document = run_study(grid, out, parallel=2, threads=1, echo=lines.append)
    return grid, out, document, lines


@pytest.mark.slow  # the tiny grid: 6 cli.py processes, ~1 min on 2 cores
def test_every_run_is_fitted_tested_and_collected(study):
    _, out, document, _ = study
    runs = document["runs"]
    assert [(r["label"], r["seed"]) for r in runs] == [
        ("softmax", 1), ("softmax", 2), ("mixtape", 1), ("mixtape", 2)
    ]  # fmt: skip
    for run in runs:
        assert run["status"] == "ok", run.get("error")
        curve = run["fit"]["curve"]
        assert [p["epoch"] for p in curve] == [0, 1]
        assert all(0 < p["val/ppl"] < 20_000 and p["time/train_epoch_s"] > 0 for p in curve)
        assert curve[1]["train_s"] == pytest.approx(sum(p["time/train_epoch_s"] for p in curve))
        assert 0 < run["test"]["test/ppl"] < 20_000 and run["fit"]["global_step"] == 10
        assert run["fit"]["monitor"] == "val/loss"
        # the tested checkpoint is the one with the best validation loss
        result = json.loads((out / "tiny_cpu" / run["label"] / f"seed{run['seed']}" /
                             "result.json").read_text())  # fmt: skip
        tested = torch.load(result["tested_checkpoint"], map_location="cpu", weights_only=False)
        best = min(p["val/loss"] for p in curve)
        assert run["fit"]["best_score"] == pytest.approx(best)
        assert tested["epoch"] == min(curve, key=lambda p: p["val/loss"])["epoch"]
    # the seeds differ, the heads differ
    assert runs[0]["test"]["test/ppl"] != runs[1]["test"]["test/ppl"]
    assert runs[0]["fit"]["parameters"] != runs[2]["fit"]["parameters"]


@pytest.mark.slow
def test_progress_line_per_run_and_strict_json_on_disk(study):
    grid, out, document, lines = study
    assert len(lines) == 4
    line = re.compile(r"\[\d/4\] (softmax|mixtape) seed [12]: test/ppl \d+\.\d\d")
    assert all(line.match(x) for x in lines)

    def no_nan(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    saved = json.loads((out / grid.name / "study.json").read_text(), parse_constant=no_nan)
    assert saved == document
    assert "commands" not in saved["runs"][0] and saved["environment"]["torch"]


@pytest.mark.slow
def test_finished_runs_are_skipped(study):
    grid, out, _, _ = study
    results = sorted((out / grid.name).rglob("result.json"))
    stamps = [os.stat(p).st_mtime_ns for p in results]
    lines = []
    again = run_study(grid, out, echo=lines.append)
    assert all("skipped" in line for line in lines) and len(lines) == 4
    assert [os.stat(p).st_mtime_ns for p in results] == stamps
    assert [r["test"] for r in again["runs"]] == [r["test"] for r in study[2]["runs"]]


@pytest.mark.slow
def test_report_of_the_tiny_grid(study, tmp_path):
    _, _, document, _ = study
    text = render_markdown(document, tmp_path)
    assert re.search(r"\| softmax \| 2/2 \| \d+\.\d\d ± \d+\.\d\d \|", text)
    assert re.search(r"\| mixtape \| 2/2 \| ", text)
    assert (tmp_path / "tiny_cpu_curves.png").is_file()


@pytest.mark.slow
def test_a_failing_run_is_recorded_and_not_retried_unless_asked(tmp_path):
    grid = parse_grid({
        "name": "bad", "base": "configs/lm/ptb.yaml", "seeds": [1],
        "heads": {"mixtape": {"head": "configs/heads/mixtape.yaml",
                              "overrides": {"model.init_args.head.init_args.num_components": 3}}},
    })  # fmt: skip
    lines = []
    document = run_study(grid, tmp_path, echo=lines.append)
    run = document["runs"][0]
    assert run["status"] == "failed" and run["failed_stage"] == "fit"
    assert "power of two" in run["error"] and "FAILED" in lines[0]
    lines.clear()
    run_study(grid, tmp_path, echo=lines.append)
    assert "skipped" in lines[0]


def test_a_resumed_fit_reads_its_csv_attempts_in_order(tmp_path):
    for name in ("fit", "fit.1", "fit.2", "finetune", "fitness"):
        (tmp_path / "csv" / name).mkdir(parents=True)
        (tmp_path / "csv" / name / "metrics.csv").write_text("step\n")
    assert [p.parent.name for p in _csv_versions(tmp_path, "fit")] == ["fit", "fit.1", "fit.2"]
