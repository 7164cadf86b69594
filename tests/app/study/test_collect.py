"""What the runner reads back from a run: CSVLogger rows, validation curves, regressions."""

import math

import pytest

from app.study.collect import last_values, max_regression, read_metrics, validation_curve

CSV = """epoch,step,time/train_epoch_s,train/loss,val/loss,val/ppl
0,49,,5.0,,
0,99,,,5.31,202.0
0,99,12.5,,,
1,149,,4.9,,
1,199,,,5.59,268.0
1,199,11.5,,,
"""


def test_curve_has_one_point_per_validation_with_cumulative_training_time(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text(CSV)
    curve = validation_curve(read_metrics(path), "val/ppl")
    assert [p["epoch"] for p in curve] == [0, 1]
    assert [p["val/ppl"] for p in curve] == [202.0, 268.0]
    assert [p["train_s"] for p in curve] == [12.5, 24.0]
    assert curve[1]["time/train_epoch_s"] == 11.5 and curve[0]["val/loss"] == 5.31


def test_missing_file_reads_as_no_rows(tmp_path):
    assert read_metrics(tmp_path / "nope.csv") == []


def test_last_values_keep_the_latest_of_each_metric():
    rows = [{"test/ppl": 3.0}, {"test/ppl": 2.0, "test/loss": 1.0}, {"val/ppl": 9.0}]
    assert last_values(rows, "test/") == {"test/ppl": 2.0, "test/loss": 1.0}


@pytest.mark.parametrize(
    "values, mode, expected",
    [
        ([300, 250, 202, 268, 260], "min", 268 / 202 - 1),  # the seed-7 Mixtape
        ([300, 250, 202, 190], "min", 0.0),
        ([20.0, 30.0, 27.0, 31.0], "max", 0.1),
        ([300, float("nan")], "min", math.inf),
    ],
)
def test_max_regression_is_the_worst_step_back_from_the_best_so_far(values, mode, expected):
    curve = [{"m": v} for v in values]
    assert max_regression(curve, "m", mode) == pytest.approx(expected)


def test_a_validation_inside_its_epoch_gets_its_share_of_the_epoch_time():
    """val_check_interval: two validations an epoch of 10 steps, 100 s each epoch."""
    rows = []
    for epoch in (0, 1):
        for step in (epoch * 10 + 4, epoch * 10 + 9):
            rows.append({"epoch": epoch, "step": step, "val/ppl": 100.0})
        rows.append({"epoch": epoch, "step": epoch * 10 + 9, "time/train_epoch_s": 100.0})
    curve = validation_curve(rows, "val/ppl")
    assert [p["train_s"] for p in curve] == pytest.approx([50.0, 100.0, 150.0, 200.0])
    assert all(p["time/train_epoch_s"] == 100.0 for p in curve)
