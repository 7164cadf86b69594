"""The study report: mean +- std over seeds, the comparison with the baseline, the plots."""

import math
import statistics

import pytest

from app.study.report import compare, render_markdown, summarize


def run(label, seed, test, curve, status="ok", **extra):
    points = [{"epoch": i, "val/ppl": v, "train_s": 10.0 * (i + 1)} for i, v in enumerate(curve)]
    return {"label": label, "seed": seed, "status": status, "test": {"test/ppl": test},
            "fit": {"curve": points, "parameters": 1000}, "train_s": 10.0 * len(curve),
            **extra}  # fmt: skip


@pytest.fixture
def study():
    return {
        "name": "demo", "description": "synthetic", "metric": "test/ppl", "mode": "min",
        "curve_metric": "val/ppl", "baseline": "softmax", "budget": {"max_epochs": 3},
        "environment": {"cpu_count": 2, "torch": "x", "git_commit": "abc", "gpus": []},
        "runs": [
            run("softmax", 1, 100.0, [150, 120, 110]),
            run("softmax", 2, 102.0, [152, 121, 111]),
            run("softmax", 3, 101.0, [151, 122, 112]),
            run("mixtape", 1, 95.0, [140, 110, 100], rank={"rank": 300}),
            run("mixtape", 2, 96.0, [141, 111, 101], rank={"rank": 310}),
            run("mixtape", 3, 0.0, [141, 200], status="diverged", unstable=True),
            run("mos", 1, 100.5, [150, 121, 111]),
            run("mos", 2, 101.5, [151, 120, 112]),
        ],
    }  # fmt: skip


def test_summary_is_over_finished_seeds(study):
    rows = {r["label"]: r for r in summarize(study)}
    soft, mix = rows["softmax"], rows["mixtape"]
    assert soft["metric"][0] == pytest.approx(101.0)
    assert soft["metric"][1] == pytest.approx(statistics.stdev([100.0, 102.0, 101.0]))
    assert (mix["ok"], mix["runs"], mix["diverged"], mix["unstable"]) == (2, 3, 1, 1)
    assert mix["values"] == [95.0, 96.0] and mix["rank"] == [300, 310]
    assert mix["best_val"][0] == pytest.approx(100.5)
    assert soft["epoch_s"][0] == pytest.approx(10.0)


def test_comparison_says_whether_the_gap_exceeds_one_std(study):
    result = {c["label"]: c for c in compare(study, summarize(study))}
    assert result["mixtape"]["delta"] == pytest.approx(95.5 - 101.0)
    assert result["mixtape"]["better_by_more_than_one_std"]
    assert not result["mos"]["better_by_more_than_one_std"]  # 101.0 vs 101.0
    assert 0 < result["mixtape"]["p_value"] < 0.05


def test_markdown_has_the_table_verdicts_and_plots(study, tmp_path):
    text = render_markdown(study, tmp_path, link_prefix="results/")
    assert "| softmax | 3/3 | 101.00 ± 1.00 |" in text
    assert "| mixtape | 2/3 (1 diverged, 1 unstable) | 95.50 ± 0.71 |" in text
    assert "`mixtape`: -5.50 (std 1.00): lower by more than one std" in text
    assert "`mos`: +0.00" in text and "not lower by more than one std" in text
    assert "300/310" in text
    for name in ("demo_curves.png", "demo_quality_vs_time.png"):
        assert (tmp_path / name).stat().st_size > 1000
        assert f"(results/{name})" in text


def test_single_seed_has_no_std(study):
    study["runs"] = [r for r in study["runs"] if r["seed"] == 1]
    rows = summarize(study)
    assert all(math.isnan(r["metric"][1]) for r in rows)
    assert all(not c["better_by_more_than_one_std"] for c in compare(study, rows))


def test_times_of_older_studies_are_marked_as_including_validation(study, tmp_path):
    # studies written before issue 33 timed epochs with the validation inside them
    text = render_markdown(study, tmp_path)
    assert "train s/epoch (incl. validation)" in text
    assert "Training times include validation" in text
    study["epoch_time_excludes_validation"] = True
    text = render_markdown(study, tmp_path)
    assert "train s/epoch (validation excluded)" in text
    assert "include validation" not in text


def test_new_studies_say_their_times_exclude_validation():
    from app.study.runner import study_document

    grid = type("Grid", (), {k: None for k in (
        "name", "description", "metric", "mode", "curve_metric", "baseline", "budget",
        "overrides", "reference", "instability_threshold", "raw")})()  # fmt: skip
    assert study_document(grid, [], {})["epoch_time_excludes_validation"] is True
