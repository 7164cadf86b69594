"""auto's table on CUDA from benchmark reports (app/bench/fastest.py)."""

from app.bench.fastest import choices, main, table


def _row(head: str, vocab: int, times: list[float]) -> dict:
    return {"head": head, "vocab_size": vocab, "hidden_size": 512, "tokens": 16384,
            "time_per_token_us": sorted(times)[len(times) // 2] / 16.384,
            "times_ms": times}  # fmt: skip


def test_an_alternative_replaces_the_default_only_beyond_the_noise():
    steady = [10.0, 10.2, 9.9, 10.1, 10.0, 9.8, 10.3]
    report = {"results": [
        _row("softmax", 10_000, steady),
        _row("softmax@rows", 10_000, [t / 2 for t in steady]),  # twice as fast, every round
        _row("softmax@liger", 10_000, [t * 3 for t in steady]),
        _row("mos", 10_000, steady),
        _row("mos@liger", 10_000, [9.0, 11.5, 9.5, 10.8, 9.6, 10.4, 9.7]),  # noise
        _row("softmax", 100_000, steady),
        _row("softmax@rows", 100_000, [t * 1.1 for t in steady]),
    ]}  # fmt: skip
    found = {(head, vocab): choice for head, vocab, choice, _ in choices(report)}
    assert found == {("SoftmaxHead", 10_000): "rows", ("MoSHead", 10_000): "torch",
                     ("SoftmaxHead", 100_000): "torch"}  # fmt: skip
    # the default beyond the last other choice is left out; before one it is kept
    assert table(choices(report)) == {"SoftmaxHead": [(10_000, "rows")]}
    entries = [("SoftmaxHead", 10_000, "torch", ""), ("SoftmaxHead", 33_000, "rows", "")]
    assert table(entries) == {"SoftmaxHead": [(10_000, "torch"), (33_000, "rows")]}


def test_the_fused_products_are_an_alternative_like_a_plan():
    steady = [10.0, 10.2, 9.9, 10.1, 10.0, 9.8, 10.3]
    report = {"results": [_row("mos", 100_000, steady),
                          _row("mos@rows", 100_000, [t * 0.6 for t in steady]),
                          _row("mos@fused", 100_000, [t * 0.4 for t in steady])]}  # fmt: skip
    assert table(choices(report)) == {"MoSHead": [(100_000, "fused")]}


def test_the_recorded_gpu_runs_give_the_table_in_the_code(capsys):
    """The H100 runs behind ``MEASURED_FASTEST``: the full bench of 2026-11-26 for softmax,
    MoS-15 and Mixtape (the rows plan at V = 10k and 100k; MoS: 0.22x the column plan's time
    at 10k, faster than Liger), the adaptive softmax's own run of 2026-11-27 for it (its rows
    plan, the whole loss as one function, at both sizes)."""
    from heads.fused_cross_entropy import MEASURED_FASTEST

    adaptive = "AdaptiveSoftmaxHead"
    full = [f"docs/results/full_bench_gpu_heads_{v}_20261126.json" for v in ("10k", "100k")]
    others = {head: sizes for head, sizes in MEASURED_FASTEST.items() if head != adaptive}
    assert {h: s for h, s in main(full).items() if h != adaptive} == others
    assert "MoSHead V=10000: rows (0.22x" in capsys.readouterr().out
    runs = [f"docs/results/bench_gpu_adaptive_defaults_{v}.json" for v in ("10k", "100k")]
    assert main(runs) == {adaptive: MEASURED_FASTEST[adaptive]}
    printed = capsys.readouterr().out
    assert "AdaptiveSoftmaxHead V=10000: rows (0.78x" in printed
    assert "AdaptiveSoftmaxHead V=100000: rows (0.51x" in printed
