"""A study's headline in docs/results.md's summary table."""

from pathlib import Path

from app.results import headline_study


def test_a_head_with_one_finished_seed_has_its_mean_alone_in_the_headline():
    def run(label, seed, value, status="ok"):
        return {"label": label, "seed": seed, "status": status, "test": {"test/ppl": value},
                "fit": {"curve": [{"epoch": 0, "step": 1, "val/ppl": value}]}}  # fmt: skip

    study = {"name": "x", "metric": "test/ppl", "mode": "min", "curve_metric": "val/ppl",
             "baseline": "softmax",
             "runs": [run("softmax", 1, 100.0), run("softmax", 2, 110.0), run("mos", 1, 95.0),
                      run("mos", 2, 0.0, "failed")]}  # fmt: skip
    text, command = headline_study(study, Path("study_x.json"))
    # mos's failed seed said: its mean is of one run of two (a mean over the survivors alone
    # reads as the head's)
    assert text == "test/ppl (mean ± std over seeds): softmax 105.0 ± 7.1, mos 95.0 (1 of 2 runs)"
    assert command == "python -m app.study run configs/studies/x.yaml"
