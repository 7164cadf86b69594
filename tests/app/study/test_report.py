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


def _variants_study():
    runs = []
    for variant, shift in (("d4", 0.0), ("d24", -50.0)):
        for head, base in (("softmax", 100.0), ("mos", 90.0)):
            for seed in (1, 2, 3):
                test = base + shift + seed
                runs.append(run(f"{head}+{variant}", seed, test, [test + 10], head=head,
                                variant=variant))  # fmt: skip
    return {"name": "variants", "metric": "test/ppl", "mode": "min", "curve_metric": "val/ppl",
            "baseline": "softmax", "runs": runs}  # fmt: skip


def test_each_variant_is_compared_with_the_baseline_of_its_own_variant(tmp_path):
    study = _variants_study()
    result = {c["label"]: c for c in compare(study, summarize(study))}
    assert set(result) == {"mos+d4", "mos+d24"}
    assert result["mos+d4"]["baseline"] == "softmax+d4"
    assert result["mos+d24"]["baseline"] == "softmax+d24"
    # against its own width: -10 both times (against softmax+d4, mos+d24 would read -60)
    assert [result[k]["delta"] for k in ("mos+d4", "mos+d24")] == pytest.approx([-10.0, -10.0])
    text = render_markdown(study, tmp_path)
    assert "Against `softmax` at the same variant (test/ppl, lower is better):" in text
    assert "- `mos+d24` against `softmax+d24`: -10.00 (std 1.00): lower by more than" in text


def test_one_seed_against_several_is_judged_the_same_either_way_round():
    """max(nan, 10.0) is nan but max(10.0, nan) is 10.0: which group had one seed decided
    whether a gap counted."""
    ok = [run("softmax", s, v, [v]) for s, v in ((1, 100.0), (2, 110.0), (3, 120.0))]
    one = [run("mos", 1, 95.0, [95.0]), run("mos", 2, 0.0, [], status="failed"),
           run("mos", 3, 0.0, [], status="failed")]  # fmt: skip
    study = {"metric": "test/ppl", "mode": "min", "curve_metric": "val/ppl", "runs": ok + one}
    forward = compare({**study, "baseline": "softmax"}, summarize(study))[0]
    backward = compare({**study, "baseline": "mos"}, summarize(study))[0]
    assert forward["spread"] == backward["spread"] == pytest.approx(10.0)
    assert forward["delta"] == -backward["delta"] == pytest.approx(-15.0)
    assert forward["better_by_more_than_one_std"] and not backward["better_by_more_than_one_std"]


def test_one_seed_each_prints_the_mean_alone(study, tmp_path):
    study["runs"] = [r for r in study["runs"] if r["seed"] == 1]
    text = render_markdown(study, tmp_path)
    assert "nan" not in text
    assert "| softmax | 1/1 | 100.00 |" in text
    assert "`mixtape`: -5.00 (no std: one seed each): not lower by more than one std" in text


def test_epochs_are_the_epochs_trained_not_the_validations():
    """With val_check_interval two validations an epoch: 2 epochs of 100 s, not 4 of 50."""
    points = ((0, 4, 50.0), (0, 9, 100.0), (1, 14, 150.0), (1, 19, 200.0))
    curve = [{"epoch": e, "step": s, "val/ppl": 100.0, "train_s": t} for e, s, t in points]
    study = {"metric": "test/ppl", "mode": "min", "curve_metric": "val/ppl", "baseline": "a",
             "runs": [{"label": "a", "seed": 1, "status": "ok", "test": {"test/ppl": 1.0},
                       "fit": {"curve": curve}, "train_s": 200.0}]}  # fmt: skip
    row = summarize(study)[0]
    assert row["epochs"][0] == 2 and row["epoch_s"][0] == pytest.approx(100.0)


def test_per_seed_line_keeps_the_place_of_a_failed_seed(study, tmp_path):
    study["runs"].insert(1, run("softmax", 4, 0.0, [], status="failed"))
    text = render_markdown(study, tmp_path)
    assert "softmax 100.00/-/102.00/101.00, mixtape 95.00/96.00/-, mos" in text


def _paired_t_p(a, b):
    """The paired t-test written out: the seeds' differences' mean over its standard error,
    n - 1 degrees of freedom, two-sided."""
    from scipy.stats import t as student

    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    statistic = statistics.fmean(d) / (statistics.stdev(d) / math.sqrt(n))
    return 2 * student.sf(abs(statistic), n - 1)


def test_seeds_pair_the_runs_the_paired_test_beside_welchs(tmp_path):
    """Every head runs with the same seeds, so a seed's runs share its draws: a head 1 lower
    than softmax at every seed, the seeds 10 apart, is far from chance paired, not by Welch's
    test (the groups as independent)."""
    soft = {1: 100.0, 2: 110.0, 3: 120.0}
    mix = {1: 98.9, 2: 109.0, 3: 119.1}
    runs = [run("softmax", s, v, [v]) for s, v in soft.items()]
    runs += [run("mixtape", s, v, [v]) for s, v in mix.items()]
    runs.append(run("mixtape", 4, 0.0, [], status="failed"))  # no pair: left out
    study = {"name": "paired", "metric": "test/ppl", "mode": "min", "curve_metric": "val/ppl",
             "baseline": "softmax", "runs": runs}  # fmt: skip
    result = compare(study, summarize(study))[0]
    expected = _paired_t_p(list(mix.values()), list(soft.values()))
    assert result["paired_p_value"] == pytest.approx(expected) and result["pairs"] == 3
    assert result["paired_p_value"] < 0.01 < 0.5 < result["p_value"]
    text = render_markdown(study, tmp_path)
    assert f"Welch's t-test p = {result['p_value']:.3f}, paired by seed (3 pairs) p = " in text
    assert f"p = {expected:.3f}\n" in text


def test_a_tiny_p_is_not_printed_as_zero(study, tmp_path):
    study["runs"] = [r for r in study["runs"] if r["label"] != "mos"]
    for r in study["runs"]:
        if r["label"] == "mixtape":
            r["test"]["test/ppl"] += 500.0  # 5 std away: p far below 0.001
    text = render_markdown(study, tmp_path)
    assert "Welch's t-test p < 0.001" in text and "p = 0.000" not in text


def test_a_study_run_on_uncommitted_changes_says_so(study, tmp_path):
    from app.study.runner import environment

    assert isinstance(environment()["git_dirty"], bool)  # (this checkout: a git repository)
    assert "commit abc." in render_markdown(study, tmp_path)
    study["environment"]["git_dirty"] = True
    assert "commit abc with uncommitted changes." in render_markdown(study, tmp_path)
