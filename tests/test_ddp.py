"""DDP on CPU (gloo) through cli.py: two processes reproduce a single-process run.

Each run is a real ``python cli.py fit`` in a subprocess: Lightning's DDP launcher re-executes
the command line for rank 1, which cannot be pytest's. ``batch_size`` is global (each rank
takes its own half of the BPTT streams), so one step of a 2-process run sees the same text as
one step of a 1-process run and the losses agree up to the all-reduce's rounding.

The default run keeps one fast comparison (softmax); every other head, the DS callbacks that
change the parameter set (mitosis, pruning), the Hybrid-LightRNN table re-assignment and the
translation task are ``slow``.
"""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from heads.user_cache import CACHE_ENV
from tests.conftest import EXPERIMENTS

REPO = Path(__file__).resolve().parents[1]

NO_DROPOUT_TINY_LSTM = [
    "--model.init_args.backbone.init_args.embedding_size", "32",
    "--model.init_args.backbone.init_args.hidden_size", "32",
    "--model.init_args.backbone.init_args.input_dropout", "0",
    "--model.init_args.backbone.init_args.hidden_dropout", "0",
    "--model.init_args.backbone.init_args.output_dropout", "0",
]  # fmt: skip


def run_cli(tmp: Path, args: list[str], devices: int, callbacks: list | None = None) -> None:
    args = [
        sys.executable, "cli.py", *args,
        "--trainer.default_root_dir", str(tmp),
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(tmp), "--trainer.logger.name", "csv",
        "--trainer.callbacks", yaml.safe_dump(callbacks) if callbacks else "null",
        "--trainer.enable_progress_bar", "false",
        "--trainer.accelerator", "cpu", "--trainer.devices", str(devices),
        "--trainer.strategy", "ddp" if devices > 1 else "auto",
    ]  # fmt: skip
    # one thread per process: two ranks with two threads each would oversubscribe 2 cores
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # every value a task logs per epoch is already reduced over the ranks: no advice to sync;
    # nor a deprecation inside Lightning that its user can do nothing about
    for noise in ("sync_dist=True", "all_gather is deprecated"):
        assert noise not in done.stderr, done.stderr[-3000:]


def last_metrics(tmp: Path) -> dict[str, float]:
    """The last logged value of every metric (rank 0's CSV)."""
    last: dict[str, float] = {}
    with next(tmp.rglob("metrics.csv")).open() as f:
        for row in csv.DictReader(f):
            last.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return last


def fit(
    tmp: Path,
    ptb_path: str,
    config: str,
    *extra: str,
    devices: int = 1,
    callbacks: list | None = None,
    steps: int = 12,
    epochs: int = 1,
) -> dict[str, float]:
    """Runs a short LM fit and returns the last logged value of every metric."""
    args = [
        "fit", *EXPERIMENTS[config],
        "--data.init_args.path", ptb_path, *NO_DROPOUT_TINY_LSTM,
        "--trainer.enable_checkpointing", "false", "--trainer.max_epochs", str(epochs),
        "--trainer.limit_train_batches", str(steps), "--trainer.limit_val_batches", "20",
        *extra,
    ]  # fmt: skip
    probe = {"class_path": "tests.ddp_probe.DumpRankState", "init_args": {"folder": str(tmp)}}
    run_cli(tmp, args, devices, [*(callbacks or []), probe])
    return last_metrics(tmp)


def rank_states(tmp: Path, devices: int) -> list[dict]:
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(devices)]


def assert_ranks_agree(tmp: Path) -> dict:
    """Both ranks ended with identical head parameters, structure and callback state."""
    rank0, rank1 = rank_states(tmp, 2)
    assert rank0.keys() == rank1.keys()
    for name, value in rank0["head"].items():
        assert same(value, rank1["head"][name]), f"ranks disagree on head.{name}"
    for key in rank0.keys() - {"head"}:
        assert same(rank0[key], rank1[key]), f"ranks disagree on {key}"
    return rank0


def same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def report(name: str, single: dict[str, float], ddp: dict[str, float]) -> None:
    """Printed with ``-s``: the figures the README quotes."""
    print(
        f"\nDDP-vs-single {name}: val/loss single {single['val/loss']:.6f} "
        f"ddp {ddp['val/loss']:.6f} (rel diff {abs(ddp['val/loss'] / single['val/loss'] - 1):.1e});"
        f" train/loss_epoch single {single['train/loss_epoch']:.6f}"
        f" ddp {ddp['train/loss_epoch']:.6f}"
    )


@pytest.mark.slow  # two fits through the CLI, ~26 s; the default run keeps the adaptive DDP tests
def test_two_process_ddp_matches_one_process_with_the_same_global_batch(tmp_path, ptb_path):
    # batch_size is global: 20 streams on one process, 10 on each of two ranks. The
    # validation perplexity is reduced over both ranks' halves of the validation streams.
    single = fit(tmp_path / "single", ptb_path, "ptb_softmax")
    ddp = fit(tmp_path / "ddp", ptb_path, "ptb_softmax", devices=2)
    report("softmax", single, ddp)
    assert single["step"] == ddp["step"] == 11  # 12 steps, logged 0-based
    assert ddp["val/loss"] == pytest.approx(single["val/loss"], rel=1e-4)
    # uniform over 10k words is log(10k) = 9.21; the Zipf-started head begins near the
    # unigram's ~6.5 and must not have left it upwards in 12 steps
    assert single["val/loss"] < 6.6
    assert_ranks_agree(tmp_path / "ddp")


HEADS = {
    "mos": ["--model.init_args.head.init_args.num_components", "3",
            "--model.init_args.head.init_args.context_dropout", "0"],
    "mixtape": ["--model.init_args.head.init_args.context_dropout", "0",
                "--model.init_args.head.init_args.gate_dropout", "0",
                "--model.init_args.head.init_args.gate_noise", "0",
                "--model.init_args.head.init_args.gate_embedding_size", "16"],
    "adaptive": ["--model.init_args.head.init_args.cutoffs", "[386, 3011]"],
}  # fmt: skip
CONFIG = {"mos": "ptb_mos", "mixtape": "ptb_mixtape", "adaptive": "ptb_adaptive"}


@pytest.mark.slow
def test_adaptive_auto_cutoffs_are_decided_once_under_ddp(
    tmp_path, ptb_path, monkeypatch, user_cache
):
    # rank 0 times the device and broadcasts its choice (HeadTask.setup): both ranks build the
    # same head, and train as one process does with the cost model rank 0 cached
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    auto = ["--model.init_args.head", "configs/heads/adaptive.yaml",
            "--data.init_args.cache_dir", str(user_cache / "data")]  # fmt: skip
    ddp = fit(tmp_path / "ddp", ptb_path, "ptb_adaptive", *auto, steps=6, devices=2)
    assert len(list((tmp_path / "cache" / "adaptive").glob("*.json"))) == 1  # timed once
    single = fit(tmp_path / "single", ptb_path, "ptb_adaptive", *auto, steps=6)
    rank0 = assert_ranks_agree(tmp_path / "ddp")
    assert (
        rank0["head"]["_extra_state"]
        == rank_states(tmp_path / "single", 1)[0]["head"]["_extra_state"]
    )
    assert ddp["val/loss"] == pytest.approx(single["val/loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("head", sorted(HEADS))
def test_every_head_under_ddp_matches_one_process(head, tmp_path, ptb_path):
    extra = HEADS[head]
    single = fit(tmp_path / "single", ptb_path, CONFIG[head], *extra, steps=6)
    ddp = fit(tmp_path / "ddp", ptb_path, CONFIG[head], *extra, steps=6, devices=2)
    report(head, single, ddp)
    assert ddp["val/loss"] == pytest.approx(single["val/loss"], rel=1e-4)
    assert single["val/loss"] < math.log(10_000)  # a working model: below uniform
    assert_ranks_agree(tmp_path / "ddp")


DS = [
    "--model.init_args.head", "heads.DSSoftmaxHead",
    "--model.init_args.head.init_args.num_experts", "2",
    "--model.init_args.head.init_args.lambda_lasso", "0.001",
    "--model.init_args.tie_weights", "false",
    "--model.init_args.optimizer.init_args.lr", "0.01",
]  # fmt: skip
DS_CALLBACKS = [
    {"class_path": "app.callbacks.Mitosis",
     "init_args": {"max_experts": 4, "every_n_epochs": 1, "noise_std": 0.01}},
    # row norms start near 1 (init std d^-1/2): gamma 0.95 prunes a share of the rows
    {"class_path": "app.callbacks.DSPruning", "init_args": {"gamma": 0.95, "every_n_steps": 3}},
    # expert utilisation on the validation tokens, counted on each rank and summed
    {"class_path": "app.callbacks.DSMonitor"},
]  # fmt: skip


@pytest.mark.slow
def test_ds_mitosis_and_pruning_under_ddp_keep_the_ranks_identical(tmp_path, ptb_path):
    # 2 epochs of 6 steps: pruning at steps 3 and 6, mitosis (2 -> 4 experts) at the second
    # epoch's start, pruning again at 9 and 12. The DDP wrapper is rebuilt after each change,
    # so the new parameters' gradients are all-reduced and both ranks stay identical.
    common = dict(callbacks=DS_CALLBACKS, steps=6, epochs=2)
    single = fit(tmp_path / "single", ptb_path, "ptb_softmax", *DS, **common)
    ddp = fit(tmp_path / "ddp", ptb_path, "ptb_softmax", *DS, devices=2, **common)
    report("DS-Softmax + mitosis + pruning", single, ddp)
    state = assert_ranks_agree(tmp_path / "ddp")
    (alone,) = rank_states(tmp_path / "single", 1)
    assert state["Mitosis.splits"] == alone["Mitosis.splits"] == 1
    assert len(state["head"]["expert_offsets"]) == 5  # 4 experts
    assert state["DSPruning.pruned_rows"] > 0
    # the same decisions as one process: the same rows survive
    assert torch.equal(state["head"]["row_class"], alone["head"]["row_class"])
    assert state["DSPruning.pruned_rows"] == alone["DSPruning.pruned_rows"]
    assert ddp["val/loss"] == pytest.approx(single["val/loss"], rel=1e-3)
    # utilisation over all validation tokens, not rank 0's half
    for key in ("ds/speedup", "ds/max_utilisation", "ds/rows"):
        assert ddp[key] == pytest.approx(single[key], rel=1e-6), key


LIGHTRNN = [
    "--data.init_args.vocab", "hybrid_lightrnn", "--data.init_args.max_vocab_size", "3000",
    "--data.init_args.lightrnn_frequent", "300",
]  # fmt: skip
REASSIGN = [
    {"class_path": "app.callbacks.LightRNNTableReassignment",
     "init_args": {"every_n_epochs": 1, "max_batches": 6, "batch_size": 8,
                   "solver": "separable"}},
]  # fmt: skip


@pytest.mark.slow
def test_lightrnn_reassignment_under_ddp_sums_the_costs_of_both_ranks(tmp_path, ptb_path):
    # Each rank scores its own 4 of the 8 scoring streams; the summed Eq. 6 costs are the
    # single process's, so both ranks solve the same problem and install the same table.
    common = dict(callbacks=REASSIGN, steps=4, epochs=2)
    single = fit(tmp_path / "single", ptb_path, "ptb_softmax", *LIGHTRNN, **common)
    ddp = fit(tmp_path / "ddp", ptb_path, "ptb_softmax", *LIGHTRNN, devices=2, **common)
    report("Hybrid-LightRNN + re-assignment", single, ddp)
    state = assert_ranks_agree(tmp_path / "ddp")
    (alone,) = rank_states(tmp_path / "single", 1)
    frequency_order = torch.arange(len(alone["cells"]))
    assert not torch.equal(alone["cells"], frequency_order)  # the table was re-learnt
    assert torch.equal(state["cells"], alone["cells"])
    assert ddp["val/loss"] == pytest.approx(single["val/loss"], rel=1e-3)


MT_TINY = [
    "--config", "configs/mt/multi30k.yaml",
    "--model.init_args.backbone.init_args.model_size", "32",
    "--model.init_args.backbone.init_args.num_heads", "2",
    "--model.init_args.backbone.init_args.encoder_layers", "1",
    "--model.init_args.backbone.init_args.decoder_layers", "1",
    "--model.init_args.backbone.init_args.feedforward_size", "64",
    "--model.init_args.backbone.init_args.dropout", "0",
    "--data.init_args.max_vocab_size", "2000",
    "--trainer.limit_val_batches", "4", "--trainer.limit_test_batches", "4",
]  # fmt: skip


@pytest.mark.slow
def test_translation_under_ddp_trains_and_reduces_validation_over_ranks(tmp_path):
    # Training: 4 steps on two ranks (each takes every other token bucket), ranks identical.
    ckpt = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path / "ckpt"), "save_last": True}}  # fmt: skip
    probe = {"class_path": "tests.ddp_probe.DumpRankState",
             "init_args": {"folder": str(tmp_path / "ddp")}}  # fmt: skip
    fit_args = ["fit", *MT_TINY, "--trainer.max_steps", "4",
                "--model.init_args.decode.val_beam_size", "0"]  # fmt: skip
    run_cli(tmp_path / "ddp", fit_args, 2, [ckpt, probe])
    assert_ranks_agree(tmp_path / "ddp")
    # Evaluation: the same checkpoint on 1 and on 2 processes gives the same test loss over
    # the whole split, so the token-weighted NLL is reduced over both ranks' batches (none
    # dropped or repeated). Under DDP the split is cut anew, into balanced rounds of one batch
    # per rank (datamodules/pair_batches.py): a batch limit would cover other lines.
    last = str(tmp_path / "ckpt" / "last.ckpt")
    results = {}
    for devices in (1, 2):
        out = tmp_path / f"test{devices}"
        run_cli(out, ["test", *MT_TINY, "--ckpt_path", last,
                      "--model.init_args.decode.beam_size", "1",
                      "--trainer.limit_test_batches", "1.0"], devices)  # fmt: skip
        results[devices] = last_metrics(out)
    print(f"\nDDP-vs-single translation test/loss: {results[1]['test/loss']:.6f} (1 process), "
          f"{results[2]['test/loss']:.6f} (2 processes)")  # fmt: skip
    assert results[2]["test/loss"] == pytest.approx(results[1]["test/loss"], rel=1e-5)


@pytest.mark.slow
def test_translation_table_reassignment_under_ddp_keeps_the_ranks_identical(tmp_path):
    # Each rank scores its own token buckets of the epoch's order; the summed Eq. 6 costs give
    # both ranks the same problem, so they install the same target table.
    reassign = [{"class_path": "app.callbacks.LightRNNTableReassignment",
                 "init_args": {"max_batches": 4, "solver": "separable"}}]  # fmt: skip
    probe = {"class_path": "tests.ddp_probe.DumpRankState",
             "init_args": {"folder": str(tmp_path / "ddp")}}  # fmt: skip
    args = ["fit", *MT_TINY, "--data.init_args.vocab", "hybrid_lightrnn",
            "--data.init_args.lightrnn_frequent", "300", "--trainer.max_epochs", "2",
            "--trainer.limit_train_batches", "3", "--trainer.enable_checkpointing", "false",
            "--model.init_args.decode.val_beam_size", "0"]  # fmt: skip
    run_cli(tmp_path / "ddp", args, 2, [*reassign, probe])
    state = assert_ranks_agree(tmp_path / "ddp")
    metrics = last_metrics(tmp_path / "ddp")
    assert metrics["lightrnn/moved"] > 0 and metrics["lightrnn/seen"] > 0
    assert not torch.equal(state["cells"], torch.arange(len(state["cells"])))  # re-learnt


@pytest.mark.slow
@pytest.mark.parametrize("vocab", ["word", "bpe"])
def test_rank_0_prepares_the_data_and_rank_1_reads_the_cache(tmp_path, vocab):
    """A 2-process fit on an empty cache: rank 0 builds the vocabulary while the CLI builds
    its objects and tokenises in ``prepare_data``; rank 1 (started by the DDP launcher) finds
    both in the cache and memory-maps the token files. Told by the cache's log lines."""
    from app.bench.data import write_synthetic_corpus

    corpus = tmp_path / "corpus"
    write_synthetic_corpus(corpus, tokens=60_000, types=3_000)
    args = [
        sys.executable, "cli.py", "fit", "--config", "configs/lm/ptb.yaml",
        "--data.init_args.path", str(corpus), "--data.init_args.vocab", vocab,
        "--data.init_args.bpe_vocab_size", "500",
        "--data.init_args.cache_dir", str(tmp_path / "cache"), *NO_DROPOUT_TINY_LSTM,
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "2",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false",
        "--trainer.callbacks", "null", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu",
        "--trainer.devices", "2", "--trainer.strategy", "ddp",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "data cache" in line]
    vocabulary = f"the {vocab} vocabulary"
    # built once: by rank 0, while the CLI linked vocab_size (before any rank was launched)
    assert [line for line in lines if "miss" in line and vocabulary in line] == [
        line for line in lines if "miss" in line and vocabulary in line and "[rank" not in line
    ] and sum("miss" in line and vocabulary in line for line in lines) == 1
    assert any(line.startswith(f"[rank 1] data cache hit: {vocabulary}") for line in lines)
    # each token file built once (BPE's training ids come with its vocabulary), by rank 0
    for split in ("train", "valid"):
        built = [line for line in lines if f"miss: preparing {split} token ids" in line]
        assert len(built) == (0 if vocab == "bpe" and split == "train" else 1)
        assert not any(line.startswith("[rank 1]") for line in built)
        assert any(line.startswith(f"[rank 1] data cache hit: {split} token ids") for line in lines)
