"""A study on a corpus with a known optimum renders with its excess table and headline."""

import json

from app.results import render


def _run(head, variant, seed, loss, d):
    return {
        "label": f"{head}+{variant}", "head": head, "variant": variant, "seed": seed,
        "status": "ok", "train_s": 10.0,
        "test": {"test/loss": loss, "test/optimum_nll": 3.0, "test/entropy_rate": 3.0,
                 "test/data_rank": 16.0},
        "fit": {"curve": [{"epoch": 0, "val/loss": loss, "train_s": 10.0}]},
        "rank": {"rank": d + 1, "hidden_size": d, "relative_ranks": {"1e-02": d}},
    }  # fmt: skip


def test_optimum_study_section_and_headline(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    runs = [_run(h, v, s, 3.0 + e + 0.001 * s, d) for h, v, d, e in
            [("softmax", "d4", 4, 0.3), ("mos", "d4", 4, 0.1), ("softmax", "d24", 24, 0.02)]
            for s in (1, 2)]  # fmt: skip
    study = {"schema": "study/1", "name": "markov_test", "description": "", "metric": "test/loss",
             "mode": "min", "curve_metric": "val/loss", "baseline": "softmax", "budget": {},
             "runs": runs, "epoch_time_excludes_validation": True}  # fmt: skip
    (folder / "study_markov_test.json").write_text(json.dumps(study))
    text = render(folder, tmp_path)
    # 4 decimals, as the excess table: with 3 a std of 0.0004 read as 0.000
    assert "excess over the optimum (nats, mean ± std over seeds): softmax+d4 0.3015 ± 0.0007" in (
        text
    )
    assert "| mos+d4 | 4 | 2 | 0.1015 ± 0.0007 | 66% | 71% |" in text
