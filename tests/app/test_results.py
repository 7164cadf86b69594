"""``python -m app.results`` renders the docs from real benchmark JSON."""

import json
import shutil
from pathlib import Path

import pytest

from app.bench.run import main as bench
from app.results import command_of, main, render, table

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "results"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs") / "results"
    bench(["--heads", "softmax", "matmul", "--vocab-sizes", "300", "--hidden-sizes", "16",
           "--batch-sizes", "32", "--repeats", "1", "--warmup", "0", "--out", str(folder),
           "--name", "bench_cpu"])  # fmt: skip
    # a data-preparation report the benchmark wrote (running it takes 12 s of fresh processes;
    # tests/app/bench/test_data.py runs it)
    shutil.copy(COMMITTED / "data_100M_word.json", folder / "data_small.json")
    (folder / "zz_other.json").write_text(json.dumps({"something": "else"}))
    return folder


def test_renders_every_file_with_its_command_and_a_plot(results):
    out = results.parent / "results.md"
    main(["--results", str(results), "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# Measured results")
    assert "## bench_cpu" in text and "## zz_other" in text
    assert "`zz_other.json`: no renderer knows this file." in text
    command = next(
        line
        for line in text.splitlines()
        if line.startswith("python -m app.bench --mode same-batch")
    )
    assert command.startswith("python -m app.bench --mode same-batch --heads softmax matmul ")
    assert " --vocab-sizes 300 " in command and " --batch-sizes 32 " in command
    assert "![bench_cpu](results/bench_cpu.png)" in text
    assert (results / "bench_cpu.png").stat().st_size > 0
    report = json.loads((results / "bench_cpu.json").read_text())
    softmax = next(r for r in report["results"] if r["head"] == "softmax")
    assert f"| softmax | 300 | 16 | 32 | {softmax['time_ms']:.3g} |" in text
    data = json.loads((results / "data_small.json").read_text())["results"][0]
    assert "python -m app.bench --mode data --tokens 100000000 --types 250000" in text
    assert (
        f"| word | {data['prepare']['vocab_size']} | 105000000 | {data['prepare']['wall_s']:.3g} |"
        in text
    )
    assert render(results, results.parent) == text  # deterministic


def test_summary_first_then_topics_in_order(results):
    # data_* belongs to a topic; bench_cpu and zz_other to none, so they come last
    text = render(results, results.parent)
    summary, data = text.index("## Summary"), text.index("## Data preparation")
    other = text.index("## Other measurements")
    assert summary < data < text.index("### data_small") < other
    assert other < text.index("### bench_cpu\n") < text.index("### zz_other")
    rows = text[summary : text.index("\n\n## ", summary + 1)].splitlines()
    assert rows.index(next(r for r in rows if "[data_small]" in r)) < rows.index(
        next(r for r in rows if "[bench_cpu]" in r)
    )
    bench = next(row for row in rows if "[bench_cpu](#bench_cpu)" in row)
    assert (
        "| Other measurements |" in bench
        and "`python -m app.bench --mode same-batch --heads" in bench
    )
    assert "step time x softmax:" not in bench  # no head besides softmax and matmul
    data_row = next(row for row in rows if "[data_small](#data_small)" in row)
    assert "| Data preparation |" in data_row and "word: 100,000,000 tokens prepared in" in data_row
    assert "`python -m app.bench --mode data --tokens 100000000" in data_row
    assert not any("zz_other" in row for row in rows)  # no renderer, no headline


def test_recorded_measurements_and_notes(tmp_path):
    (tmp_path / "recorded.json").write_text(json.dumps({
        "schema": "recorded/1", "note": "A note.", "headline": "x 1.5",
        "parts": ["Setting.", {"commands": ["python cli.py fit"]},
                  {"header": ["a"], "rows": [[1.0]]}],
    }))  # fmt: skip
    text = render(tmp_path, tmp_path)
    section = text[text.index("### recorded") :]
    assert section.startswith(
        "### recorded\n\nA note.\n\nSetting.\n\n```bash\npython cli.py fit\n```\n\n| a |"
    )
    assert "| Other measurements | [recorded](#recorded) | x 1.5 | `python cli.py fit` |" in text
    report = json.loads((tmp_path / "recorded.json").read_text())
    (tmp_path / "recorded.json").write_text(json.dumps({**report, "partial": "2 of 7 repeats"}))
    text = render(tmp_path, tmp_path)
    assert "A note.\n\n**Partial run** (2 of 7 repeats): the command stopped early." in text


def test_table_and_command_formatting():
    assert table(["a", "b"], [[1.23456, "x"], [12345.6, [1, 2]]]) == (
        "| a | b |\n| --- | --- |\n| 1.23 | x |\n| 12,346 | 1 2 |"
    )
    assert command_of("app.x", {"k": 3, "flag": True, "off": False, "none": None,
                                "sizes": [1, 2], "out": "o", "empty": [], "each": ["a", "b"]},
                      skip=("out",), repeated=("each",)) == (
        "python -m app.x --k 3 --flag --sizes 1 2 --each a --each b"
    )  # fmt: skip


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--results", str(tmp_path / "none"), "--out", str(tmp_path / "r.md")])


@pytest.mark.slow  # re-plots every training benchmark: ~18 s
def test_every_committed_results_file_renders(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    for path in COMMITTED.glob("*.json"):
        shutil.copy(path, folder)
    text = render(folder, tmp_path)
    assert "no renderer knows" not in text
    for path in COMMITTED.glob("*.json"):
        assert f"## {path.stem}\n" in text


def test_a_benchmarks_failed_subjects_are_named(results, tmp_path):
    """A subject left out of a run (``failed`` in its JSON) is named under its table."""
    folder = tmp_path / "results"
    folder.mkdir()
    report = json.loads((results / "bench_cpu.json").read_text())
    report["failed"] = {"mixtape V=300 d=16 tokens=32": "RuntimeError: no kernel"}
    (folder / "bench_cpu.json").write_text(json.dumps(report))
    text = render(folder, tmp_path)
    assert "Failed in this run, left out: `mixtape V=300 d=16 tokens=32`: RuntimeError: no" in text


def test_gpu_targets_section_from_the_gpu_runs(results, tmp_path):
    """A section of issue 28's targets where GPU reports exist (``app.bench.targets``); none
    without them."""
    import shutil
    from pathlib import Path

    assert "## GPU targets" not in render(results, tmp_path)
    committed = Path(__file__).resolve().parents[2] / "docs" / "results"
    folder = tmp_path / "results"
    folder.mkdir()
    shutil.copy(committed / "bench_gpu_heads_100k.json", folder)
    text = render(folder, tmp_path)
    section = text[text.index("## GPU targets") : text.index("## Other measurements")]
    assert "python -m app.bench.targets docs/results/bench_gpu_heads_100k.json" in section
    assert "| softmax / CCE at 100k (<= 1) | 0.2022 | 0.20-0.20 | - | met |" in section
    assert "| MoS-15 tokens in 12 GiB at 100k (>= 16384) | - | - | - | unmeasured |" in section
    assert "| Mixtape / softmax at 100k (<= 1.5) | 1.921 | 1.89-1.96 | - | **not met** |" in section
    # the products' counted work beside the time (the rows plans count none: the default's)
    assert "| adaptive speed / PyTorch's at 100k (>= 1.5) | 1.232 | 1.10-1.55 | 0.99 |" in section


def test_a_cpu_runs_memory_measured_in_the_timing_process_is_said_so(results, tmp_path):
    """CPU runs from before the memory worker measured their extra peak in the process that
    timed every subject (order-dependent): said under their table; a new run's is not."""
    from app.results import IN_PROCESS_MEMORY

    assert IN_PROCESS_MEMORY not in render(results, results.parent)  # the worker's
    folder = tmp_path / "results"
    folder.mkdir()
    report = json.loads((results / "bench_cpu.json").read_text())
    report["machine"]["memory_method"] = "rss_reset_peak"
    (folder / "bench_cpu.json").write_text(json.dumps(report))
    assert IN_PROCESS_MEMORY in render(folder, tmp_path)


def test_steps_back_to_back_are_said_with_the_repeats(results, tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    report = json.loads((results / "bench_cpu.json").read_text())
    assert "each the mean of" not in render(results, results.parent)  # one step a repeat
    report["args"]["steps_per_repeat"] = 3
    (folder / "bench_cpu.json").write_text(json.dumps(report))
    text = render(folder, tmp_path)
    assert "median of 1 repeats (each the mean of 3 steps back to back)" in text
    assert " --steps-per-repeat 3 " in text


def test_a_run_of_plans_alone_has_a_headline(tmp_path):
    """The committed CUDA-graphs run times plans only (no plain softmax row): its summary line
    gives each plan against ``softmax@rows``, and its table says so in the column."""
    folder = tmp_path / "results"
    folder.mkdir()
    shutil.copy(COMMITTED / "bench_gpu_graphs_10k.json", folder)
    text = render(folder, tmp_path)
    line = next(row for row in text.splitlines() if row.startswith("| Other measurements |"))
    assert "| step time x softmax@rows: softmax@rows+graphs 0.87x [0.83-0.90], " in line
    assert "mixtape@rows 2.80x [2.61-2.84]" in line and "matmul" not in line.split("|")[3]
    assert "| head | V | d | tokens | ms / batch | us / token | x softmax@rows |" in text


def test_memory_headlines_name_differing_token_counts_and_repeats_are_the_rows(tmp_path):
    """MiB of a step at 8,192 tokens beside MiB at 2,048 are not comparable: the headline says
    each one's count where they differ. A run stopped early: the repeats its rows hold."""
    folder = tmp_path / "results"
    folder.mkdir()
    for name in ("bench_cpu_memory_100k.json", "bench_gpu_h200_heads_100k.json"):
        shutil.copy(COMMITTED / name, folder)
    text = render(folder, tmp_path)
    line = next(row for row in text.splitlines() if "[bench_cpu_memory_100k]" in row)
    assert "softmax 316 (8,192 tokens)" in line and "mos 508 (2,048 tokens)" in line
    h200 = json.loads((COMMITTED / "bench_gpu_h200_heads_100k.json").read_text())
    assert h200["args"]["repeats"] == 7 and {len(r["times_ms"]) for r in h200["results"]} == {6}
    section = text[text.index("## bench_gpu_h200_heads_100k") :]
    assert "median of 6 repeats" in section and "median of 7 repeats" not in section
