import json
import math

import pytest
import torch

from app.bench.inference import ratios, softmax_as_one_expert, synthetic_ds_head
from app.bench.run import main
from heads import SoftmaxHead


def test_inference_mode_runs_through_app_bench(tmp_path):
    argv = ["--mode", "inference", "--vocab-size", "500", "--hidden-size", "16", "--experts", "8",
            "--expert-size", "80", "--queries", "20", "--batch-size", "8", "--repeats", "2",
            "--warmup", "0", "--svd", "4:0.25:50", "--clock", "cpu", "--block", "5",
            "--out", str(tmp_path), "--name", "smoke"]  # fmt: skip
    report = main(argv)
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["latency"].keys() == {"softmax", "softmax_1x", "ds", "ds+svd4-25-over50"}
    assert saved["reference"] == "softmax"
    assert saved["speedup_vs_softmax"].keys() == {"softmax_1x", "ds", "ds+svd4-25-over50"}
    assert saved["speedup_vs_softmax_1x"].keys() == {"softmax", "ds", "ds+svd4-25-over50"}
    for row in saved["latency"].values():
        assert row["batch1_us_per_query"] > 0 and row["batched_us_per_query"] > 0
    # 4 blocks of 5 queries, 2 repeats: 8 paired blocks; a block of queries is one unit (its
    # median over the repeats), the figure the median of the 4 units, too few for an interval
    speed = saved["speedup_vs_softmax"]["ds"]
    times = saved["latency"]
    mine, theirs = times["ds"]["batch1_us_per_query_blocks"], times["softmax"][
        "batch1_us_per_query_blocks"]  # fmt: skip
    assert len(mine) == len(theirs) == 8
    paired = [b / a for a, b in zip(mine, theirs, strict=True)]  # repeat 0's blocks, then 1's
    units = sorted((paired[j] + paired[4 + j]) / 2 for j in range(4))
    assert speed["batch1_us_per_query"] == pytest.approx((units[1] + units[2]) / 2)
    assert all(math.isnan(x) for x in speed["batch1_us_per_query_ci"])
    assert speed["batch1_us_per_query_min"] == pytest.approx(
        times["softmax"]["batch1_us_per_query_min"] / times["ds"]["batch1_us_per_query_min"]
    )
    # equal expert sizes: the speed-up is V / (|v| + K) whatever the utilisation
    assert report["quality"]["ds"]["flops_speedup"] == pytest.approx(500 / (80 + 8))
    svd = report["quality"]["ds+svd4-25-over50"]
    assert svd["svd"] == {"rank": 4, "candidates": 0.25, "min_classes": 50}
    assert svd["svd_experts"] == 8  # every 80-class expert is over 50 classes
    # W + n W / r + max(k, N) rows per query instead of n
    expected = 500 / ((4 + 80 * 4 / 16 + 20) + 8)
    assert svd["svd_flops_speedup_top10"] == pytest.approx(expected)
    assert saved["args"]["svd"] == [{"rank": 4, "candidates": 0.25, "min_classes": 50}]
    assert len(saved["machine"]["load_average"]) == 3
    if saved["machine"]["native_kernel"]:
        stages = saved["breakdown"]["ds"]
        assert stages["same_answers"] and stages["kernel_total"] > 0
        assert saved["breakdown"]["ds+svd4-25-over50"]["svd_select"] > 0


def test_files_without_block_times_give_the_ratio_of_medians():
    latency = {"softmax": {"batch1_us_per_query": 30.0}, "ds": {"batch1_us_per_query": 2.0}}
    assert ratios(latency, "softmax") == {"ds": {"batch1_us_per_query": 15.0}}


def test_bad_svd_spec_is_one_clear_error(capsys):
    with pytest.raises(SystemExit):
        main(["--mode", "inference", "--svd", "16"])
    assert "RANK:CANDIDATES" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--mode", "inference", "--svd", "16:1.5"])
    assert "svd_candidates" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--mode", "inference", "--svd", "16:0.1", "--svd", "16:0.1:1000"])
    assert "same row twice" in capsys.readouterr().err


# None: a machine without load averages (app.machine.load_average: Windows)
@pytest.mark.parametrize("load_average", [[1.0, 1.0, 1.0], None])
def test_plot_of_a_report(tmp_path, load_average):
    """The plot reads the JSON the benchmark writes (here shaped as a checkpoint run's) and
    refuses a report without accuracy."""
    from app.bench.inference_plot import main as plot_main

    def timings(us):
        return {"batch1_us_per_query": us, "batched_us_per_query": us / 4,
                "batch1_us_per_query_min": us, "batched_us_per_query_min": us / 4}  # fmt: skip

    accuracy = {"softmax": (0.25, 0.44, 0.52), "ds": (0.25, 0.44, 0.519),
                "ds+svd16-50": (0.248, 0.43, 0.51)}  # fmt: skip
    report = {
        "args": {"k": 10, "batch_size": 100},
        "reference": "softmax",
        "quality": {
            name: dict(zip(("acc_top1", "acc_top5", "acc_top10"), acc, strict=True))
            for name, acc in accuracy.items()
        },
        "latency": {
            "softmax": timings(330.0),
            "softmax_1x": timings(290.0),
            "ds": timings(16.0),
            "ds+svd16-50": timings(11.0),
        },
        "machine": {"device": "cpu", "threads": 1, "load_average": load_average},
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    written = plot_main([str(path)])
    assert written == tmp_path / "report.png" and written.stat().st_size > 10_000
    for metrics in report["quality"].values():
        for key in ("acc_top1", "acc_top5", "acc_top10"):
            del metrics[key]
    path.write_text(json.dumps(report))
    with pytest.raises(SystemExit, match="no accuracy"):
        plot_main([str(path)])


@pytest.mark.parametrize("projection", [False, True])
def test_softmax_as_one_expert_is_the_same_distribution(projection):
    torch.manual_seed(0)
    softmax = SoftmaxHead(12, 50, embedding_size=8 if projection else None)
    with torch.no_grad():
        softmax.bias.normal_()
    one = softmax_as_one_expert(softmax)
    hidden = torch.randn(6, 12)
    torch.testing.assert_close(one.log_prob(hidden), softmax.log_prob(hidden))
    for n in range(6):  # batch 1: the C kernel where there is a compiler
        values, classes = one.topk(hidden[n : n + 1], 5)
        expected = softmax.topk(hidden[n : n + 1], 5)
        torch.testing.assert_close(values, expected[0])
        assert torch.equal(classes, expected[1])


def test_synthetic_ds_head_covers_every_class():
    head = synthetic_ds_head(vocab=100, hidden=8, experts=4, expert_size=30)
    assert head.expert_sizes() == [30] * 4
    assert head.classes_without_expert().numel() == 0
    for k in range(4):
        classes = head.expert_classes(k)
        assert torch.equal(classes, classes.unique())  # sorted, no repeats
    with pytest.raises(ValueError, match="expert-size"):
        synthetic_ds_head(vocab=100, hidden=8, experts=4, expert_size=10)


TINY = [
    "--model.init_args.backbone.init_args.embedding_size", "16",
    "--model.init_args.backbone.init_args.hidden_size", "16",
    "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
    "--trainer.enable_progress_bar", "false",
]  # fmt: skip


@pytest.mark.slow
def test_ptb_softmax_then_ds_then_inference_bench(tmp_path, monkeypatch, ptb_path):
    """The whole recipe at toy size: softmax LM, DS from its checkpoint (configs/ds/ptb_ds.yaml
    with mitosis and pruning), then the inference bench evaluating both checkpoints."""
    from app.bench.inference_plot import main as plot_main
    from cli import main as cli_main

    repo = __import__("pathlib").Path(__file__).resolve().parents[3]
    monkeypatch.chdir(repo)
    logs = ["--trainer.logger.init_args.save_dir", str(tmp_path),
            "--data.init_args.path", ptb_path, "--trainer.max_epochs", "1"]  # fmt: skip
    cli_main(["fit", "--config", "configs/lm/ptb.yaml", *TINY, *logs])
    softmax_ckpt = next(tmp_path.glob("ptb/*/checkpoints/last.ckpt"))
    cli = cli_main(["fit", "--config", "configs/ds/ptb_ds.yaml", *TINY, *logs,
                    "--trainer.max_epochs", "3",
                    "--model.init_args.pretrained_checkpoint", str(softmax_ckpt)])  # fmt: skip
    head = cli.model.head
    assert head.num_experts == 4  # split at epoch 2 (every_n_epochs: 2)
    assert not any(p.requires_grad for p in cli.model.backbone.parameters())
    ds_ckpt = next(tmp_path.glob("ptb_ds/*/checkpoints/last.ckpt"))
    report = main(["--mode", "inference",
                   "--softmax-config", f"{tmp_path}/ptb/version_0/config.yaml",
                   "--softmax-checkpoint", str(softmax_ckpt),
                   "--ds-config", str(next(tmp_path.glob("ptb_ds/*/config.yaml"))),
                   "--ds-checkpoint", str(ds_ckpt), "--max-eval-batches", "2",
                   "--svd", "4:0.5:1",
                   "--queries", "10", "--repeats", "1", "--warmup", "0",
                   "--out", str(tmp_path)])  # fmt: skip
    quality = report["quality"]
    assert 0 <= quality["ds"]["acc_top1"] <= quality["ds"]["acc_top10"] <= 1
    assert quality["ds"]["num_experts"] == 4
    assert quality["softmax"]["tokens"] == quality["ds"]["tokens"] > 0
    assert report["accuracy_vs_softmax_points"]["ds"]["acc_top1"] == pytest.approx(
        100 * (quality["ds"]["acc_top1"] - quality["softmax"]["acc_top1"])
    )
    assert quality["ds+svd4-50-over1"]["tokens"] == quality["ds"]["tokens"]
    plot_main([str(tmp_path / "inference.json"), "--out", str(tmp_path / "plot.png")])
    assert (tmp_path / "plot.png").stat().st_size > 10_000


@pytest.mark.gpu
def test_inference_bench_on_cuda(tmp_path):
    """The GPU rows: heads and queries on the device, timings synchronised."""
    argv = ["--mode", "inference", "--vocab-size", "500", "--hidden-size", "16", "--experts", "8",
            "--expert-size", "80", "--queries", "20", "--batch-size", "8", "--repeats", "1",
            "--warmup", "0", "--svd", "4:0.25:50", "--device", "cuda",
            "--out", str(tmp_path)]  # fmt: skip
    report = main(argv)
    assert report["machine"]["device"] != "cpu"
    assert report["breakdown"] == {}  # the C kernel's profile is a CPU figure
    assert all(row["batch1_us_per_query"] > 0 for row in report["latency"].values())


def test_an_interval_is_over_the_blocks_of_queries_not_every_repeat_of_them():
    # 10 blocks of queries, 3 repeats: block j's speed-up is j + 1 in every repeat; the 30
    # pairs would give a 95% interval over 30 values, the 10 units one over 10
    blocks = [100.0] * 30
    fast = [100.0 / (j + 1) for _ in range(3) for j in range(10)]
    latency = {
        "softmax": {"batch1_us_per_query_blocks": blocks, "batch1_us_per_query": 100.0},
        "ds": {"batch1_us_per_query_blocks": fast, "batch1_us_per_query": 20.0},
    }
    speed = ratios(latency, "softmax", repeats=3)["ds"]
    assert speed["batch1_us_per_query"] == pytest.approx(5.5)
    assert speed["batch1_us_per_query_ci"] == pytest.approx([2.0, 9.0])  # order stats 2 and 9
    every_pair = ratios(latency, "softmax")["ds"]["batch1_us_per_query_ci"]
    assert every_pair[1] - every_pair[0] < 9.0 - 2.0
