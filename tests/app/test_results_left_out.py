"""docs/results.md says what a measurement lacks: a summary row of a run cut short or with
failed subjects, a same-memory search's tokens, a count as a count, the clock a latency is."""

import json
import shutil
from pathlib import Path

from app.results import render

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "results"


def _summary_row(text: str, stem: str) -> str:
    return next(row for row in text.splitlines() if row.startswith("| ") and f"[{stem}]" in row)


def test_a_summary_row_says_its_run_was_cut_short_or_left_subjects_out(tmp_path):
    """The section says "Partial run" and names failed subjects; the summary row, read alone,
    gave the figures of what ran as the whole command's."""
    folder = tmp_path / "results"
    folder.mkdir()
    shutil.copy(COMMITTED / "profile_gpu_lm_ptb_step.json", folder)  # 1 of 4 subjects
    report = json.loads((COMMITTED / "bench_cpu_lm_ptb_10k_d200.json").read_text())
    report["failed"] = {"mos V=10000 d=200 tokens=700": "RuntimeError: out of memory"}
    (folder / "bench_cpu_lm_ptb_10k_d200.json").write_text(json.dumps(report))
    text = render(folder, tmp_path)
    profile = _summary_row(text, "profile_gpu_lm_ptb_step")
    assert "softmax 435 (1.96) (**partial run: 1 of 4 subjects**) |" in profile
    bench = _summary_row(text, "bench_cpu_lm_ptb_10k_d200")
    assert "(**failed, left out: mos V=10000 d=200 tokens=700**) |" in bench
    assert "partial run" not in bench
    h200 = json.loads((COMMITTED / "bench_gpu_h200_heads_100k.json").read_text())
    (folder / "bench_gpu_h200_heads_100k.json").write_text(json.dumps(h200))
    row = _summary_row(render(folder, tmp_path), "bench_gpu_h200_heads_100k")
    assert "(**partial run: 6 of 7 repeats, no FLOPs or memory**) |" in row  # said once


def test_a_same_memory_searchs_tokens_and_the_target_count(tmp_path):
    """The tokens a same-memory search fitted are its result: in its summary row, and in the
    targets table as a count (not 6.461e+04)."""
    folder = tmp_path / "results"
    folder.mkdir()
    shutil.copy(COMMITTED / "bench_gpu_memory_12g_mos.json", folder)
    text = render(folder, tmp_path)
    row = _summary_row(text, "bench_gpu_memory_12g_mos")
    assert "| extra peak MiB of a step: mos 10,988 (64,610 tokens) |" in row
    assert "| MoS-15 tokens in 12 GiB at 100k (>= 16384) | 64,610 | - | - | met |" in text


def test_an_inference_runs_latency_names_its_clock(tmp_path):
    """``--clock`` is wall by default: such a run's latencies are not CPU time."""
    folder = tmp_path / "results"
    folder.mkdir()
    report = json.loads((COMMITTED / "ds_inference_synthetic.json").read_text())
    (folder / "ds_inference_synthetic.json").write_text(json.dumps(report))
    assert "Top-10 latency (median CPU time per query;" in render(folder, tmp_path)
    report["args"]["clock"] = "wall"
    (folder / "ds_inference_synthetic.json").write_text(json.dumps(report))
    text = render(folder, tmp_path)
    assert "Top-10 latency (median wall time per query;" in text and "CPU time" not in text


def test_a_study_whose_grid_file_changed_since_it_ran_says_so(tmp_path):
    """The summary's command runs ``configs/studies/<name>.yaml`` as it is now: where that is
    no longer the grid the study's JSON ran, the section and the summary row say which keys
    differ."""
    from app.results import grid_changes

    (tmp_path / "configs" / "studies").mkdir(parents=True)
    grid = {"name": "g", "base": "configs/lm/ptb.yaml", "seeds": [1, 2]}
    (tmp_path / "configs" / "studies" / "g.yaml").write_text(json.dumps(grid))  # (YAML too)
    assert grid_changes({"name": "g", "grid": grid}, tmp_path) == []
    ran = {**grid, "base": ["configs/lm/ptb_softmax.yaml", "configs/lm/ptb.yaml"]}
    assert grid_changes({"name": "g", "grid": ran}, tmp_path) == ["base"]
    assert grid_changes({"name": "gone", "grid": ran}, tmp_path) == ["the grid file"]
    assert grid_changes({"name": "g"}, tmp_path) == []  # a study without its grid

    folder = tmp_path / "results"
    folder.mkdir()
    study = json.loads((COMMITTED / "study_ptb_lightrnn_tables_cpu.json").read_text())
    (folder / "study_ptb_lightrnn_tables_cpu.json").write_text(json.dumps(study))
    assert "grid changed" not in render(folder, tmp_path)  # the grid it ran is the file's
    study["grid"]["seeds"] = [1, 2, 3]
    (folder / "study_ptb_lightrnn_tables_cpu.json").write_text(json.dumps(study))
    text = render(folder, tmp_path)
    assert "(**grid changed since the run: seeds**) |" in _summary_row(
        text, "study_ptb_lightrnn_tables_cpu"
    )
    changed = "`configs/studies/ptb_lightrnn_tables_cpu.yaml` has changed since this run"
    assert f"{changed} (`seeds`)" in text
