import json

import pytest
import torch

from app.bench.inference import softmax_as_one_expert, synthetic_ds_head
from app.bench.run import main
from heads import SoftmaxHead


def test_inference_mode_runs_through_app_bench(tmp_path):
    argv = ["--mode", "inference", "--vocab-size", "500", "--hidden-size", "16", "--experts", "8",
            "--expert-size", "80", "--queries", "20", "--batch-size", "8", "--repeats", "2",
            "--warmup", "0", "--out", str(tmp_path), "--name", "smoke"]  # fmt: skip
    report = main(argv)
    saved = json.loads((tmp_path / "smoke.json").read_text())
    assert saved["latency"].keys() == {"softmax", "softmax_1x", "ds"}
    assert saved["latency_speedup"].keys() == {"softmax", "softmax_1x"}
    for row in saved["latency"].values():
        assert row["batch1_us_per_query"] > 0 and row["batched_us_per_query"] > 0
    # equal expert sizes: the speed-up is V / (|v| + K) whatever the utilisation
    assert report["quality"]["ds"]["flops_speedup"] == pytest.approx(500 / (80 + 8))


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
    from cli import main as cli_main

    repo = __import__("pathlib").Path(__file__).resolve().parents[3]
    monkeypatch.chdir(repo)
    logs = ["--trainer.logger.init_args.save_dir", str(tmp_path),
            "--data.init_args.path", ptb_path, "--trainer.max_epochs", "1"]  # fmt: skip
    cli_main(["fit", "--config", "configs/lm/ptb_softmax.yaml", *TINY, *logs])
    softmax_ckpt = next(tmp_path.glob("ptb_softmax/*/checkpoints/last.ckpt"))
    cli = cli_main(["fit", "--config", "configs/ds/ptb_ds.yaml", *TINY, *logs,
                    "--trainer.max_epochs", "3",
                    "--model.init_args.pretrained_checkpoint", str(softmax_ckpt)])  # fmt: skip
    head = cli.model.head
    assert head.num_experts == 4  # split at epoch 2 (every_n_epochs: 2)
    assert not any(p.requires_grad for p in cli.model.backbone.parameters())
    ds_ckpt = next(tmp_path.glob("ptb_ds/*/checkpoints/last.ckpt"))
    report = main(["--mode", "inference",
                   "--softmax-config", f"{tmp_path}/ptb_softmax/version_0/config.yaml",
                   "--softmax-checkpoint", str(softmax_ckpt),
                   "--ds-config", str(next(tmp_path.glob("ptb_ds/*/config.yaml"))),
                   "--ds-checkpoint", str(ds_ckpt), "--max-eval-batches", "2",
                   "--queries", "10", "--repeats", "1", "--warmup", "0",
                   "--out", str(tmp_path)])  # fmt: skip
    quality = report["quality"]
    assert 0 <= quality["ds"]["acc_top1"] <= quality["ds"]["acc_top10"] <= 1
    assert quality["ds"]["num_experts"] == 4
    assert quality["softmax"]["tokens"] == quality["ds"]["tokens"] > 0
