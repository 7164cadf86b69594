import json

from app.bench.run import main, ratio


def test_benchmark_runs_and_writes_valid_json(tmp_path):
    argv = ["--heads", "softmax", "mixtape", "mos", "adaptive", "torch_adaptive", "matmul",
            "--vocab-sizes", "300", "600", "--hidden-sizes", "16", "--batch-sizes", "32",
            "--repeats", "2", "--warmup", "1", "--cutoffs", "50", "150", "--out", str(tmp_path),
            "--name", "smoke"]  # fmt: skip
    main(argv)
    report = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.png").stat().st_size > 0
    rows = report["results"]
    assert {r["head"] for r in rows} == {"softmax", "mixtape", "mos", "adaptive",
                                          "torch_adaptive", "matmul"}  # fmt: skip
    assert len(rows) == 12
    for row in rows:
        assert row["time_ms"] > 0 and len(row["times_ms"]) == 2
        assert row["peak_memory_mb"] > 0
        assert row["matmul_gflop"] > 0 and row["matmul_gflop_per_s"] > 0
    # the bare matmul row does the softmax's products (which add only the bias gradient)
    assert 1 < ratio(report, "softmax", "matmul", 600, key="matmul_gflop") < 1.1
    # MoS's K softmaxes must take more memory than one softmax (a real measurement)
    assert ratio(report, "mos", "softmax", 600, key="peak_memory_mb") > 2


def test_same_memory_mode_and_lm_scope(tmp_path):
    argv = ["--heads", "softmax", "mos", "--vocab-sizes", "400", "--hidden-sizes", "16",
            "--mode", "same-memory", "--memory-budget-mb", "2", "--scope", "lm", "--bptt", "8",
            "--max-batch", "4096", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path),
            "--name", "mem"]  # fmt: skip
    report = main(argv)
    tokens = {r["head"]: r["tokens"] for r in report["results"]}
    assert tokens["softmax"] > tokens["mos"] > 0  # MoS fits fewer tokens in the same budget
    assert all(t % 8 == 0 for t in tokens.values())


def test_cpu_clock_times_the_process(tmp_path):
    argv = ["--heads", "softmax", "--vocab-sizes", "300", "--hidden-sizes", "16",
            "--batch-sizes", "32", "--repeats", "2", "--warmup", "0", "--clock", "cpu",
            "--out", str(tmp_path), "--name", "cpu"]  # fmt: skip
    report = main(argv)
    assert report["args"]["clock"] == "cpu"
    assert all(t > 0 for t in report["results"][0]["times_ms"])


def test_mixed_precision_times_every_head_under_autocast(tmp_path):
    argv = ["--heads", "softmax", "mixtape", "mos", "adaptive", "torch_adaptive", "matmul",
            "--vocab-sizes", "300", "--hidden-sizes", "16", "--batch-sizes", "32",
            "--repeats", "1", "--warmup", "0", "--cutoffs", "50", "150", "--precision",
            "bf16-mixed", "--out", str(tmp_path), "--name", "bf16"]  # fmt: skip
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


def test_same_memory_search_stops_at_the_limit_when_everything_fits():
    """A head that fits any batch: the search must end at the largest multiple of bptt
    under --max-batch (it used to loop for ever when the limit was not a power-of-two
    multiple of bptt), and find nothing when even one sequence is over budget."""
    import torch

    from app.bench.run import largest_batch
    from app.bench.subjects import BenchOptions

    targets = torch.zeros(200, dtype=torch.long)
    args = ("softmax", "head", 50, 8)
    common = dict(targets=targets, options=BenchOptions(), device=torch.device("cpu"), bptt=7)
    assert largest_batch(*args, budget=2**40, limit=100, **common) == 98
    assert largest_batch(*args, budget=2**40, limit=6, **common) == 0
    assert largest_batch(*args, budget=0, limit=100, **common) == 0
