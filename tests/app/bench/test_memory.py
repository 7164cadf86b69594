import pytest

from app.bench.memory import can_reset_peak_rss
from app.bench.run import main


@pytest.mark.skipif(not can_reset_peak_rss(), reason="resets the peak RSS: Linux only")
def test_a_subjects_memory_does_not_depend_on_what_ran_before_it(tmp_path):
    """The same MoS step, measured after Mixtape's or after softmax's: glibc's heap, shaped by
    the subject before, once moved it by half (module docstring of app/bench/memory.py)."""
    argv = ["--vocab-sizes", "10000", "--hidden-sizes", "64", "--batch-sizes", "1024",
            "--mos-components", "4", "--time", "skip", "--flops", "skip",
            "--out", str(tmp_path)]  # fmt: skip
    peaks = []
    for order in (["mixtape", "mos"], ["softmax", "mos"], ["mos"]):
        report = main(["--heads", *order, "--name", "_".join(order), *argv])
        peaks.append({r["head"]: r["extra_peak_mb"] for r in report["results"]}["mos"])
    assert max(peaks) - min(peaks) < 0.02 * min(peaks), peaks
