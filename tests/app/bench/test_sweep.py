"""``python -m app.bench.sweep``: every launch setting of the Triton tiles timed, the defaults
put back after (a CPU runs the eager tiles: the plumbing, not the kernels, is tested here)."""

import json
from dataclasses import asdict

import pytest

import app.bench.sweep as sweep
from heads.kernels import rows_ce, triton_gemm, triton_mixtape, triton_mixtape_gemm, triton_rows
from heads.kernels.triton_gemm import GemmLaunch

SMALL = ["--device", "cpu", "--precision", "32-true", "--vocab", "300", "--hidden", "16",
         "--tokens", "64", "--repeats", "2", "--steps", "2"]  # fmt: skip


def test_every_setting_of_every_subject_is_timed_and_written(tmp_path, capsys):
    report = sweep.main([*SMALL, "--out", str(tmp_path), "--name", "tiles"])
    assert json.loads((tmp_path / "tiles.json").read_text()) == report
    rows = report["results"]
    per_setting = len(sweep.ROWS_SETTINGS) + len(sweep.FUSED_SETTINGS)  # cuBLAS's, the fused
    assert [r["subject"] for r in rows].count("softmax@rows") == per_setting
    assert [r["subject"] for r in rows].count("mos@rows") == per_setting
    assert [r["subject"] for r in rows].count("mixtape@rows") == len(sweep.MIXTAPE_SETTINGS) + len(
        sweep.FREQUENT_SETTINGS
    )  # its frequent block's fused tiles, then the cuBLAS tile's kernels
    assert rows[0]["subject"] == "matmul"
    # one row a subject under the defaults, which the table's ratios are taken against
    defaults = [r["subject"] for r in rows if r["default"]]
    assert defaults == ["matmul", "softmax@rows", "mos@rows", "mixtape@rows"]
    assert all(len(r["times_ms"]) == 2 and r["time_ms"] > 0 for r in rows)
    assert {r["setting"]["programs_per_sm"] for r in rows
            if r["subject"] == "mos@rows" and "fused_products" not in r["setting"]} == {
        launch.programs_per_sm for launch in sweep.ROWS_SETTINGS}  # fmt: skip
    fused = [r["setting"]["fused_products"] for r in rows if "fused_products" in r["setting"]]
    assert fused == [asdict(g) for g in sweep.FUSED_SETTINGS for _ in ("softmax", "mos")]
    frequent = [r["setting"]["fused_frequent"] for r in rows if "fused_frequent" in r["setting"]]
    assert frequent == [asdict(f) for f in sweep.FREQUENT_SETTINGS]
    assert triton_mixtape_gemm.FREQUENT_LAUNCH == triton_mixtape_gemm.FrequentLaunch()
    assert report["triton"] is False and "changed nothing" in capsys.readouterr().err
    assert triton_rows.LAUNCH == triton_rows.Launch()
    assert rows_ce.FUSED_PRODUCTS is False and triton_gemm.GEMM_LAUNCH == GemmLaunch()
    assert report["defaults"]["fused_products"] is None  # opt-in: the cuBLAS tiles ran


def test_the_defaults_are_put_back_when_a_subject_fails(monkeypatch, tmp_path):
    calls = []

    def timed(name, args, targets):
        calls.append((name, triton_rows.LAUNCH))
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return [1.0]

    monkeypatch.setattr(sweep, "_timed", timed)
    launch, columns = triton_rows.LAUNCH, triton_mixtape.COLUMNS_PER_THREAD
    with pytest.raises(RuntimeError, match="out of memory"):
        sweep.main([*SMALL, "--out", str(tmp_path), "--name", "cut"])
    assert calls[1][1] == sweep.ROWS_SETTINGS[0]  # set for the subject
    # the rows timed before the failure (or a lent GPU's time limit) are on disk
    kept = json.loads((tmp_path / "cut.json").read_text())["results"]
    assert [r["subject"] for r in kept] == ["matmul", "softmax@rows"]
    assert triton_rows.LAUNCH is launch and triton_mixtape.COLUMNS_PER_THREAD is columns


def test_groups_time_only_their_settings(tmp_path):
    report = sweep.main([*SMALL, "--out", str(tmp_path), "--groups", "mixtape"])
    assert [r["subject"] for r in report["results"]] == ["matmul"] + ["mixtape@rows"] * len(
        sweep.MIXTAPE_SETTINGS
    )  # the matmul, the reference of every group, always


def test_a_bad_count_is_one_error_line(capsys):
    with pytest.raises(SystemExit):
        sweep.parse_args(["--device", "cpu", "--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err


def test_the_sweep_renders_in_the_results_document(tmp_path):
    from app.results import render

    folder = tmp_path / "results"
    sweep.main([*SMALL, "--out", str(folder), "--name", "sweep_tiles"])
    text = render(folder, tmp_path)
    assert "## sweep_tiles" in text or "### sweep_tiles" in text
    assert "no renderer knows" not in text and "(no Triton tiles ran" in text
    assert "python -m app.bench.sweep --device cpu --precision 32-true --vocab 300" in text
    assert "| softmax@rows | programs_per_sm 2, reps 4, warps 8 |" in text
    assert "| mos@rows | fused_products: block_m 128, block_n 64, block_k 64," in text
    assert "| 1 |" in text  # the default against itself
