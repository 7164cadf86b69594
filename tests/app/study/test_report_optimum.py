import math

from app.study.report import optimum_rows, render_optimum


def _run(head, variant, seed, loss, d, rank):
    test = {"test/loss": loss, "test/optimum_nll": 3.0, "test/entropy_rate": 3.01,
            "test/data_rank": 32.0}  # fmt: skip
    return {
        "label": f"{head}+{variant}", "head": head, "variant": variant, "seed": seed,
        "status": "ok", "test": test,
        "rank": {"rank": rank, "hidden_size": d, "relative_ranks": {"1e-02": rank - 1}},
    }  # fmt: skip


def test_excess_and_closed_share():
    runs = [
        _run("softmax", "d8", 1, 3.30, 8, 9), _run("softmax", "d8", 2, 3.32, 8, 9),
        _run("mos", "d8", 1, 3.12, 8, 200), _run("mos", "d8", 2, 3.14, 8, 200),
        _run("softmax", "d48", 1, 3.02, 48, 33), _run("softmax", "d48", 2, 3.02, 48, 33),
    ]  # fmt: skip
    study = {"runs": runs, "baseline": "softmax"}
    rows = {r["label"]: r for r in optimum_rows(study)}
    assert math.isclose(rows["softmax+d8"]["mean_std"][0], 0.31)
    assert math.isclose(rows["mos+d8"]["closed"], (0.31 - 0.13) / 0.31)
    assert math.isclose(rows["mos+d8"]["closed_above_floor"], (0.31 - 0.13) / (0.31 - 0.02))
    assert math.isnan(rows["softmax+d48"]["closed_above_floor"])
    text = "\n".join(render_optimum(study))
    assert "| mos+d8 | 8 | 2 | 0.1300 ± 0.0141 | 58% | 62% | 200/200 | 199/199 | 9 | 32 |" in text


def test_no_optimum_no_section():
    assert render_optimum({"runs": [{"label": "a", "status": "ok", "test": {}}],
                           "baseline": "a"}) == []  # fmt: skip
