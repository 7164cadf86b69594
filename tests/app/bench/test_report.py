import math

import numpy as np
import pytest
from scipy.stats import binom

from app.bench.report import (
    interval_text,
    paired_row_ratio,
    peer_speedups,
    print_table,
    row_figures,
    softmax_reference,
)


def _row(head, times, tokens=100, vocab=1000, hidden=8):
    return {"head": head, "vocab_size": vocab, "hidden_size": hidden, "tokens": tokens,
            "times_ms": list(times), "time_ms": float(np.median(times)),
            "time_per_token_us": float(np.median(times)) / tokens * 1e3}  # fmt: skip


def _median_interval(values, level=0.95):
    """Order statistics (r, n + 1 - r), 1-based, with the largest r whose coverage
    1 - 2 P(Bin(n, 1/2) <= r - 1) is still >= level: written plainly."""
    x, n = sorted(values), len(values)
    best = None
    for r in range(1, n // 2 + 1):
        if 1 - 2 * binom.cdf(r - 1, n, 0.5) >= level:
            best = r
    return (x[best - 1], x[n - best]) if best else (math.nan, math.nan)


def test_paired_row_ratio_is_the_median_of_the_rounds_ratios_with_an_order_statistics_interval():
    rng = np.random.default_rng(0)
    reference = rng.uniform(90, 110, 11)
    mine = reference * rng.uniform(1.6, 1.8, 11)  # each round's own ratio, not the medians'
    ratio, low, high = paired_row_ratio(_row("mixtape", mine), _row("softmax", reference))
    ratios = mine / reference
    assert ratio == pytest.approx(np.median(ratios))
    assert (low, high) == pytest.approx(_median_interval(ratios))
    assert low < ratio < high


def test_paired_row_ratio_compares_time_per_token():
    times = [10.0] * 9
    mos, softmax = _row("mos", times, tokens=50), _row("softmax", times, tokens=100)
    ratio, _, _ = paired_row_ratio(mos, softmax)
    assert ratio == pytest.approx(2.0)  # same time for half the tokens


def test_few_repeats_give_no_interval_and_unpaired_rows_the_ratio_of_medians():
    ratio, low, high = paired_row_ratio(_row("mixtape", [2.0] * 5), _row("softmax", [1.0] * 5))
    assert ratio == 2.0 and math.isnan(low) and math.isnan(high)
    assert interval_text(low, high) == "-" and interval_text(1.234, 1.5) == "1.23-1.50"
    rows = [_row("softmax", [1.0, 2.0, 3.0]), _row("mixtape", [5.0, 6.0])]  # not one round each
    assert paired_row_ratio(rows[1], rows[0]) is None
    figures = row_figures(rows, rows[1])
    assert figures.rel == pytest.approx(5.5 / 2.0) and math.isnan(figures.rel_low)


def test_peer_speedups_name_our_heads_against_the_fields():
    theirs = [12.0] * 11
    rows = [_row("adaptive", [10.0] * 11), _row("adaptive+compile", [8.0] * 11),
            _row("torch_adaptive", theirs), _row("adaptive", [10.0] * 11, hidden=16),
            _row("mixtape", [30.0] * 11)]  # fmt: skip
    lines = peer_speedups(rows)
    assert len(lines) == 2  # no torch_adaptive at d=16; Mixtape has no peer
    assert lines[0].startswith("`adaptive` against `torch_adaptive` (V=1000, d=8): 1.20x")
    assert "`adaptive+compile` against `torch_adaptive` (V=1000, d=8): 1.50x" in lines[1]


def test_the_table_shows_a_dash_where_nothing_was_measured(capsys):
    rows = [_row("softmax", [1.0] * 3), _row("mixtape", [2.0] * 3)]  # no matmul row, no memory
    for row in rows:
        row.update(matmul_gflop=0.1, extra_peak_mb=None)
    print_table({"results": rows})
    table = capsys.readouterr().out
    assert "nan" not in table
    assert table.splitlines()[-1].split()[-3:] == ["0.1", "-", "-"]  # GFLOP, % matmul, MiB


def test_a_run_of_plans_alone_divides_by_its_first_softmax_plan(capsys):
    """A run without a plain softmax row (plans only: ``softmax@rows`` against its CUDA graph)
    gives its ratios against its first softmax row, and says which."""
    rows = [_row("softmax@rows", [2.0] * 11), _row("softmax@rows+graphs", [1.6] * 11),
            _row("mixtape@rows", [5.0] * 11), _row("matmul", [1.0] * 11)]  # fmt: skip
    assert softmax_reference(rows) == "softmax@rows"
    assert [row_figures(rows, row).rel for row in rows] == pytest.approx([1.0, 0.8, 2.5, 0.5])
    print_table({"results": rows})
    header, *lines = capsys.readouterr().out.strip().splitlines()
    assert "x softmax@rows" in header
    assert {len(line) for line in lines} == {len(header)}  # the wider column still lines up
    plain = [_row("mixtape", [5.0] * 11), _row("softmax", [2.5] * 11), *rows]
    assert softmax_reference(plain) == "softmax"  # the plain head wherever it comes
    assert row_figures(plain, plain[0]).rel == pytest.approx(2.0)
    assert softmax_reference([_row("mixtape", [5.0] * 11)]) == "softmax"  # none: no ratio
    assert math.isnan(row_figures([_row("mixtape", [5.0] * 11)], _row("mixtape", [5.0])).rel)


def test_flops_in_kernels_the_counter_cannot_see_are_not_shown():
    # older reports hold 0 for @cce and @fused, a fraction for mixtape@fused: no figure at all
    rows = [_row(head, [1.0] * 3) for head in ("softmax", "softmax@cce", "mixtape@fused",
                                                 "cce", "matmul")]  # fmt: skip
    for row, gflop in zip(rows, (3.0, 0.0, 0.1, 0.0, 2.0), strict=True):
        row.update(matmul_gflop=gflop, matmul_gflop_per_s=gflop * 1e3)
    figures = {row["head"]: row_figures(rows, row) for row in rows}
    assert figures["softmax"].gflop == 3.0 and figures["softmax"].rate == pytest.approx(150.0)
    for head in ("softmax@cce", "mixtape@fused", "cce"):
        assert math.isnan(figures[head].gflop) and math.isnan(figures[head].rate)
