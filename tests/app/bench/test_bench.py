import json

import torch

from app.bench.run import main, ratio


def test_benchmark_runs_and_writes_valid_json(tmp_path):
    argv = ["--heads", "softmax", "softmax@torch", "mixtape", "mos", "adaptive", "torch_adaptive",
            "matmul", "--vocab-sizes", "300", "600", "--hidden-sizes", "16", "--batch-sizes",
            "32", "--repeats", "2", "--warmup", "1", "--cutoffs", "50", "150", "--out",
            str(tmp_path), "--name", "smoke"]  # fmt: skip
    main(argv)
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.png").stat().st_size > 0
    rows = report["results"]
    assert {r["head"] for r in rows} == {"softmax", "softmax@torch", "mixtape", "mos", "adaptive",
                                          "torch_adaptive", "matmul"}  # fmt: skip
    assert len(rows) == 14
    for row in rows:
        assert row["time_ms"] > 0 and len(row["times_ms"]) == 2
        assert row["extra_peak_mb"] >= 0
        assert row["matmul_gflop"] > 0 and row["matmul_gflop_per_s"] > 0
        # what the host did over the size's timed rounds: this process working, no compile
        # worker beside it (none runs on a CPU; on a GPU they are shut down before timing)
        host = row["host_during_timing"]
        assert host["wall_s"] > 0 and 0 < host["process_cpu_s"]
        assert host["children_cpu_s"] in (None, 0.0)
    # the bare matmul row does the softmax's products (the column plans add the bias gradient
    # as a product, the rows plan as a sum)
    assert 1 <= ratio(report, "softmax", "matmul", 600, key="matmul_gflop") < 1.1
    assert report["machine"]["memory_method"] in ("rss_reset_peak_in_worker", "rss_child_process")


def test_extra_peak_memory_is_measured_not_estimated(tmp_path):
    """The step's extra peak RSS: the unfused logits of the bare matmul ([N, V] float32, kept
    for its backward: 2048 x 20000 floats = 156 MiB) against the fused loss (the rows plan's
    512-row tiles: 39 MiB; the column plan recomputing its 16 MiB chunks, --saved-mb 0);
    MoS's K = 4 component rows too (unfused: 4 x 156 MiB)."""
    argv = ["--heads", "softmax", "softmax@eager", "mos", "matmul", "--vocab-sizes", "20000",
            "--hidden-sizes", "16", "--batch-sizes", "2048", "--repeats", "1", "--warmup", "1",
            "--out",
            str(tmp_path), "--name", "memory", "--mos-components", "4", "--saved-mb", "0",
            "--clock", "cpu"]  # fmt: skip
    report = main(argv)
    memory = {r["head"]: r["extra_peak_mb"] for r in report["results"]}
    assert memory["matmul"] > 150  # its [N, V] logits and their gradient's stand-in
    assert memory["softmax"] < memory["matmul"] / 2  # tiles, not [N, V]
    assert memory["softmax@eager"] < memory["matmul"] / 4  # chunks
    assert memory["mos"] < memory["matmul"] / 2  # O(K N) statistics, chunks of [K N, V]


def test_memory_only_rows_with_tokens_per_subject(tmp_path):
    """``--time skip``: no timed steps, the memory of one step per subject, each at its own
    token count (``--tokens-for``); the JSON renders with ``-`` for the times."""
    from app.results import render_training_bench

    argv = ["--heads", "softmax", "mos", "matmul", "--vocab-sizes", "20000", "--hidden-sizes",
            "16", "--batch-sizes", "2048", "--tokens-for", "mos=256", "--time", "skip",
            "--flops", "skip", "--mos-components", "4", "--saved-mb", "0", "--out",
            str(tmp_path), "--name", "memory"]  # fmt: skip
    report = main(argv)
    rows = {r["head"]: r for r in report["results"]}
    assert {name: r["tokens"] for name, r in rows.items()} == {
        "softmax": 2048, "mos": 256, "matmul": 2048}  # fmt: skip
    assert all(r["time_ms"] is None and r["times_ms"] is None for r in rows.values())
    assert rows["matmul"]["extra_peak_mb"] > 150  # [2048, 20000] float32 logits, kept
    assert rows["softmax"]["extra_peak_mb"] < rows["matmul"]["extra_peak_mb"] / 2
    text = render_training_bench(report, tmp_path / "memory.json", tmp_path)
    assert "not timed" in text and "| mos | 20000 | 16 | 256 | - | - |" in text


def test_same_memory_mode_and_lm_scope(tmp_path):
    argv = ["--heads", "softmax", "mos", "--vocab-sizes", "400", "--hidden-sizes", "16",
            "--mode", "same-memory", "--memory-budget-mb", "2", "--scope", "lm", "--bptt", "8",
            "--max-batch", "4096", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path),
            "--name", "mem"]  # fmt: skip
    report = main(argv)
    tokens = {r["head"]: r["tokens"] for r in report["results"]}
    assert tokens["softmax"] > tokens["mos"] > 0  # MoS fits fewer tokens in the same budget
    assert all(t % 8 == 0 for t in tokens.values())


def test_a_subject_that_fits_no_batch_is_recorded_as_such(tmp_path):
    """Same-memory mode: a subject whose smallest batch exceeds the budget has no row, and is
    named in ``fits_nothing`` (targets reads it as 0 tokens, not as unmeasured)."""
    argv = ["--heads", "softmax", "--vocab-sizes", "400", "--hidden-sizes", "16",
            "--mode", "same-memory", "--memory-budget-mb", "0.001", "--max-batch", "64",
            "--repeats", "1", "--warmup", "0", "--out", str(tmp_path),
            "--name", "none"]  # fmt: skip
    report = main(argv)
    assert report["results"] == []
    assert report["fits_nothing"] == [{"head": "softmax", "vocab_size": 400, "hidden_size": 16,
                                       "scope": "head", "budget_mb": 0.001}]  # fmt: skip


def test_cpu_clock_times_the_process(tmp_path):
    argv = ["--vocab-sizes", "300", "--hidden-sizes", "16",
            "--batch-sizes", "32", "--repeats", "2", "--warmup", "0", "--clock", "cpu",
            "--memory", "skip", "--flops", "skip", "--out", str(tmp_path), "--name", "cpu",
            "--heads", "softmax", "matmul"]  # fmt: skip
    report = main(argv)
    assert report["args"]["clock"] == "cpu"
    assert all(t > 0 for r in report["results"] for t in r["times_ms"])
    assert all(r["matmul_gflop"] is None for r in report["results"])  # not counted


def test_mixed_precision_times_every_head_under_autocast(tmp_path):
    argv = ["--heads", "softmax", "mixtape", "mos", "adaptive", "torch_adaptive", "matmul",
            "--vocab-sizes", "300", "--hidden-sizes", "16", "--batch-sizes", "32",
            "--repeats", "1", "--warmup", "0", "--cutoffs", "50", "150", "--precision",
            "bf16-mixed", "--memory", "skip", "--out", str(tmp_path), "--name", "bf16"]  # fmt: skip
    report = main(argv)
    assert {r["precision"] for r in report["results"]} == {"bf16-mixed"}
    assert len(report["results"]) == 6 and all(r["time_ms"] > 0 for r in report["results"])


def test_bare_matmul_under_autocast_returns_gradients_in_the_parameters_dtype():
    import torch

    from app.bench.subjects import BareMatmul, step_fn

    module = BareMatmul(8, 20)
    x = torch.randn(5, 8, requires_grad=True)
    step_fn(module, x, torch.zeros(5, dtype=torch.long), "bf16-mixed")()
    assert module.weight.grad.dtype == x.grad.dtype == torch.float32
    expected = (x.detach() @ module.weight.detach().T) @ module.weight.detach()
    torch.testing.assert_close(x.grad, expected, rtol=5e-2, atol=5e-2)  # bf16 products


def test_same_memory_search_stops_at_the_limit_when_everything_fits(monkeypatch):
    """A head that fits any batch: the search must end at the largest multiple of bptt
    under --max-batch (it used to loop for ever when the limit was not a power-of-two
    multiple of bptt), and find nothing when even one sequence is over budget. The memory is
    a stand-in, 1000 bytes per token (a tiny step's measured RSS can be 0: no new pages)."""
    import torch

    import app.bench.run as bench_run
    from app.bench.run import Case, largest_batch
    from app.bench.subjects import BenchOptions

    monkeypatch.setattr(bench_run, "step_memory", lambda step, case: case.tokens * 1000)

    targets = torch.zeros(200, dtype=torch.long)
    case = Case("softmax", "head", 50, 8, 0, targets, BenchOptions(), torch.device("cpu"), 7)
    assert largest_batch(case, budget=2**40, limit=100) == 98
    assert largest_batch(case, budget=2**40, limit=6) == 0
    assert largest_batch(case, budget=0, limit=100) == 0
    assert largest_batch(case, budget=50_000, limit=100) == 49  # 7 sequences
    # a large search stops within 1/64 of the largest fit, in fewer probes than an exact one
    probes = []

    def memory(step, case):
        probes.append(case.tokens)
        return case.tokens * 1000

    monkeypatch.setattr(bench_run, "step_memory", memory)
    monkeypatch.setattr(bench_run, "build_case", lambda case: (torch.nn.Module(), lambda: None))
    found = largest_batch(case, budget=70_000_000, limit=2**40)  # 10,000 sequences fit
    assert 70_000 * (1 - 1 / 64) <= found <= 70_000 and found % 7 == 0
    assert len(probes) <= 21  # exact: 15 doublings and 13 halvings


def test_heads_are_built_from_the_cli_fragments_with_overrides(capsys):
    """The benchmarked heads are the ones users train: configs/heads/<head>.yaml through
    jsonargparse (Mixtape with its dropouts and weight norm), with --init-args and the named
    shortcuts over the fragment's init_args; a bad override is one parser error."""
    import pytest
    import yaml

    from app.bench.run import bench_options, parse_args
    from app.bench.subjects import FRAGMENT_DIR, build_head, head_config
    from heads import MixtapeHead

    fragment = yaml.safe_load((FRAGMENT_DIR / "mixtape.yaml").read_text())["init_args"]
    args = parse_args(["--heads", "mixtape", "mos", "--mos-components", "3", "--init-args",
                       "mixtape.gate_noise=0", "adaptive.cutoffs=[10,20]"])  # fmt: skip
    options = bench_options(args)
    assert options.init_args == {"mos": {"num_components": 3}, "mixtape": {"gate_noise": 0},
                                 "adaptive": {"cutoffs": [10, 20]}}  # fmt: skip
    config = head_config("mixtape", options)
    assert config["init_args"] == {**fragment, "gate_noise": 0}
    head = build_head("mixtape", 16, 300, options)
    assert isinstance(head, MixtapeHead) and head.training
    assert build_head("torch_adaptive", 16, 300, options).layer.cutoffs == [10, 20, 300]
    for bad in (["--init-args", "mixtape.colour=1"], ["--init-args", "nohead.x=1"],
                ["--mixtape-ratio", "high"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(["--heads", "mixtape", *bad])
        assert "error:" in capsys.readouterr().err


def test_subject_names_are_checked_with_one_clear_error(capsys):
    import pytest

    from app.bench.run import parse_args
    from app.bench.subjects import Subject, parse_subject

    assert parse_subject("mixtape@torch+compile") == Subject("mixtape", "torch", True)
    assert parse_subject("cce") == Subject("cce")
    assert parse_subject("mos@fused") == Subject("mos", "fused", False)
    assert parse_subject("mixtape@rows+graphs") == Subject("mixtape", "rows", graphs=True)
    assert parse_subject("softmax+graphs+compile") == Subject("softmax", None, True, True)
    for bad in ("softmax@fast", "softmax@cpu", "cce+compile", "matmul@torch", "nohead",
                "matmul+graphs", "softmax+graph", "softmax+compile+compile"):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args(["--heads", bad])
        assert "error:" in capsys.readouterr().err


def test_a_fused_subject_runs_the_rows_plan_with_the_fused_products():
    from app.bench.subjects import BenchOptions, build_head

    options = build_head("mixtape@fused", 16, 300, BenchOptions()).loss_options
    assert (options.backend, options.plan, options.fused_products) == ("torch", "rows", True)
    assert not build_head("mixtape@rows", 16, 300, BenchOptions()).loss_options.fused_products


def test_peers_of_the_field_need_cuda_and_say_so():
    import pytest

    from app.bench.subjects import BenchOptions, build_head
    from heads.errors import UserError

    for peer in ("cce", "liger"):
        with pytest.raises(UserError, match="pip install"):
            build_head(peer, 8, 50, BenchOptions())


def test_compiled_subject_counts_its_eager_twins_flops(tmp_path):
    """A +compile subject: timed compiled, FLOPs counted on its eager twin (the same products);
    a +graphs one likewise (on a CPU its step runs eagerly), in the LM too."""
    argv = ["--heads", "softmax", "softmax+compile", "mixtape@rows", "mixtape@rows+graphs",
            "--vocab-sizes", "300", "--hidden-sizes", "16", "--batch-sizes", "32", "--repeats",
            "1", "--warmup", "1", "--memory", "skip", "--out", str(tmp_path),
            "--name", "compiled"]  # fmt: skip
    report = main(argv)
    flops = {r["head"]: r["matmul_gflop"] for r in report["results"]}
    assert flops["softmax+compile"] == flops["softmax"] > 0
    assert flops["mixtape@rows+graphs"] == flops["mixtape@rows"] > 0
    lm = main([*argv[:5], "--scope", "lm", *argv[5:-1], "lm"])
    assert {r["head"] for r in lm["results"]} >= {"mixtape@rows+graphs"}


def test_a_graphed_subjects_memory_counts_what_its_graphs_keep(monkeypatch, tmp_path):
    """+graphs: the memory its graphs keep (pools and copies, allocated at the capture, before
    the measured step, and never freed) is part of its extra memory, in both scopes. Here
    the captures are the CPU stand-in, each said to keep 512 MiB."""
    import dataclasses

    from app.bench.subjects import GraphedHead, WholeLM, graphs_held_bytes
    from heads import SoftmaxHead
    from heads.graphs import GRAPH_DEVICES
    from tests.heads.test_graphs import Rerun

    def keeping(function, inputs, warmup):
        return dataclasses.replace(Rerun()(function, inputs, warmup), held_bytes=512 << 20)

    monkeypatch.setattr("heads.graphs.GRAPH_DEVICES", GRAPH_DEVICES | {"cpu"})
    monkeypatch.setattr("heads.graphs.capture_cuda", keeping)
    lm = WholeLM(GraphedHead(SoftmaxHead(8, 40)), 8, 40)
    assert graphs_held_bytes(lm) == 0  # nothing captured yet
    tokens = torch.randint(0, 40, (2, 5))
    lm(tokens, tokens).backward()
    assert graphs_held_bytes(lm) == 512 << 20
    argv = ["--heads", "softmax", "softmax+graphs", "--vocab-sizes", "300", "--hidden-sizes",
            "16", "--batch-sizes", "32", "--repeats", "1", "--warmup", "1", "--flops", "skip",
            "--out", str(tmp_path), "--name", "graphed"]  # fmt: skip
    for scope in ("head", "lm"):
        rows = {r["head"]: r for r in main([*argv, "--scope", scope])["results"]}
        assert rows["softmax+graphs"]["extra_peak_mb"] >= 512 > rows["softmax"]["extra_peak_mb"]


def test_the_adaptive_softmaxs_graphed_subject_is_told_its_targets_and_captured(
    monkeypatch, tmp_path
):
    """adaptive@rows+graphs: the benchmark's step tells the head its targets on the host, as a
    task does, so that its step over the dense budget is captured (in slots) and replayed,
    not run eagerly. Here on CUDA's plans on this CPU, the capture the CPU stand-in."""
    from app.bench.subjects import GraphedHead
    from heads.graphs import GRAPH_DEVICES
    from tests.heads.test_graphs import Rerun

    captures = Rerun()
    monkeypatch.setattr("heads.graphs.GRAPH_DEVICES", GRAPH_DEVICES | {"cpu"})
    monkeypatch.setattr("heads.graphs.capture_cuda", captures)
    monkeypatch.setattr("heads.kernels.chunks.GPU_PLAN_DEVICES", {"cuda", "cpu"})
    graphed = []
    init = GraphedHead.__init__
    monkeypatch.setattr(GraphedHead, "__init__",
                        lambda self, head: graphed.append(self) or init(self, head))  # fmt: skip
    main(["--heads", "adaptive@rows+graphs", "--vocab-sizes", "300", "--hidden-sizes", "16",
          "--batch-sizes", "64", "--saved-mb", "0", "--repeats", "1", "--warmup", "1",
          "--memory", "skip", "--flops", "skip", "--out", str(tmp_path)])  # fmt: skip
    assert captures.captures and all(g.graphs.captured == 1 for g in graphed)


def test_a_device_or_backend_this_machine_lacks_is_one_line(capsys, tmp_path):
    """No traceback for what the user asked and the machine has not got."""
    import pytest
    import torch

    from app.cli.console import exit_status

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as stopped:
            main(["--device", "cuda", "--heads", "softmax"])
        assert stopped.value.code == 2 and "no CUDA device here" in capsys.readouterr().err
    argv = ["--device", "cpu", "--heads", "softmax@cce", "--vocab-sizes", "100", "--hidden-sizes",
            "8", "--batch-sizes", "8", "--out", str(tmp_path)]  # fmt: skip
    assert exit_status(lambda: main(argv)) == 2
    assert "error: loss backend 'cce' runs on CUDA only" in capsys.readouterr().err


def test_a_subject_that_fails_is_left_out_and_the_others_measured(tmp_path, monkeypatch, capsys):
    """One GPU session measures everything it can: a subject whose first step raises (a
    compiler or device failure) is reported in one line and in the JSON's ``failed``, the
    others are timed, and the command exits 1."""
    import app.bench.run as bench_run

    build = bench_run.build_case

    def failing_mixtape(case):
        module, step = build(case)
        if case.name != "mixtape":
            return module, step

        def broken():
            raise RuntimeError("Triton compilation failed\nsecond line")

        return module, broken

    monkeypatch.setattr(bench_run, "build_case", failing_mixtape)
    argv = ["--heads", "softmax", "mixtape", "--vocab-sizes", "300", "--hidden-sizes", "16",
            "--batch-sizes", "32", "--repeats", "1", "--warmup", "1", "--memory", "skip",
            "--out", str(tmp_path), "--name", "partial"]  # fmt: skip
    report = main(argv)
    assert [r["head"] for r in report["results"]] == ["softmax"]
    saved = json.loads((tmp_path / "partial.json").read_text())
    assert saved["failed"] == {
        "mixtape V=300 d=16 tokens=32": "RuntimeError: Triton compilation failed second line"
    }
    assert "FAILED mixtape" in capsys.readouterr().err
    assert bench_run.exit_code(report) == 1 and bench_run.exit_code({"failed": {}}) == 0


def test_a_run_cut_short_keeps_the_rounds_it_timed(tmp_path):
    """A GPU session's time limit can kill the benchmark mid-run: the JSON is rewritten after
    every timed round and every size, marked ``partial`` until the run completes."""
    from app.bench.run import parse_args, run

    args = parse_args(["--heads", "softmax", "matmul", "--vocab-sizes", "300", "600",
                       "--hidden-sizes", "16", "--batch-sizes", "32", "--repeats", "3",
                       "--warmup", "0", "--memory", "skip", "--flops", "skip"])  # fmt: skip
    saved = []
    final = run(args, saved.append)
    notes = [report["partial"] for report in saved]
    assert notes == ["partial: 1 of 3 repeats, no FLOPs or memory",
                     "partial: 2 of 3 repeats, no FLOPs or memory", "1 of 2 sizes",
                     "partial: 1 of 3 repeats, no FLOPs or memory",
                     "partial: 2 of 3 repeats, no FLOPs or memory"]  # fmt: skip
    assert [len(r["times_ms"]) for r in saved[1]["results"]] == [2, 2]
    assert [r["vocab_size"] for r in saved[3]["results"]] == [300, 300, 600, 600]
    assert "partial" not in final and len(final["results"]) == 4
    assert [len(r["times_ms"]) for r in final["results"]] == [3, 3, 3, 3]


def test_a_note_is_kept_and_left_out_of_the_command(tmp_path):
    """``--note``: in the JSON as its note, which docs/results.md prints above the table; the
    command that reproduces the run does not repeat it."""
    from app.results import render

    report = main(["--heads", "softmax", "--vocab-sizes", "50", "--hidden-sizes", "8",
                   "--batch-sizes", "16", "--repeats", "1", "--warmup", "0", "--memory", "skip",
                   "--flops", "skip", "--out", str(tmp_path), "--name", "bench_noted",
                   "--note", "why this run was made"])  # fmt: skip
    assert report["note"] == "why this run was made"
    assert json.loads((tmp_path / "bench_noted.json").read_text())["note"] == report["note"]
    text = render(tmp_path, tmp_path)
    assert "why this run was made\n" in text and "--note" not in text
