"""The softmax-bottleneck diagnostic: spectrum and numerical rank of a head's row-centred
log-probability matrix, the context sample, and the command on a trained checkpoint."""

import json
import sys

import numpy as np
import pytest
import torch

from app.rank import ContextSampler, centred_spectrum, head_rank, main, numerical_rank
from heads import IGNORE_INDEX, MixtapeHead, MoSHead, SoftmaxHead
from tests.conftest import EXPERIMENTS

D, V, N = 6, 60, 40


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def test_softmax_rank_is_d_plus_one_and_matches_a_plain_float64_reference():
    head = SoftmaxHead(D, V).double()
    with torch.no_grad():
        head.bias.normal_()
    hidden = torch.randn(N, D, dtype=torch.float64)
    report = head_rank(head, hidden)
    # written plainly: log_softmax row by row, centred, NumPy's rank with its default tolerance
    logits = hidden.numpy() @ head.weight.detach().numpy().T + head.bias.detach().numpy()
    log_probs = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1,
                keepdims=True)) - logits.max(1, keepdims=True)  # fmt: skip
    centred = log_probs - log_probs.mean(1, keepdims=True)
    assert report.rank == np.linalg.matrix_rank(centred) == D + 1 == report.softmax_bound
    np.testing.assert_allclose(report.singular_values, np.linalg.svd(centred, compute_uv=False),
                               rtol=1e-9, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize(
    "head",
    [lambda: MoSHead(D, V, num_components=4),
     lambda: MixtapeHead(D, V, num_components=4, frequent_ratio=1.0, gate_embedding_size=3)],
    ids=["mos", "mixtape"],
)  # fmt: skip
def test_high_rank_heads_exceed_the_softmax_bound(head):
    report = head_rank(head(), torch.randn(N, D) * 3)
    assert report.rank > D + 1
    assert report.rank <= min(N, V)


def test_row_shifts_do_not_change_the_spectrum():
    matrix = torch.randn(10, 30, dtype=torch.float64)
    shifted = matrix + torch.randn(10, 1, dtype=torch.float64) * 100
    torch.testing.assert_close(centred_spectrum(matrix), centred_spectrum(shifted))


def test_numerical_rank_uses_numpys_tolerance_or_the_given_one():
    values = torch.tensor([10.0, 1.0, 1e-3, 1e-20], dtype=torch.float64)
    rank, tol = numerical_rank(values, (100, 50))
    assert rank == 3 and tol == pytest.approx(10.0 * 100 * np.finfo(np.float64).eps)
    assert numerical_rank(values, (100, 50), tolerance=0.5) == (2, 0.5)


def test_the_head_is_left_as_it_was():
    head = MoSHead(D, V, num_components=3, context_dropout=0.5).train()
    before = {k: v.clone() for k, v in head.state_dict().items()}
    head_rank(head, torch.randn(N, D))
    assert head.training and next(head.parameters()).dtype == torch.float32
    for key, value in head.state_dict().items():
        assert torch.equal(value, before[key])


def test_sampler_keeps_a_seeded_sample_and_skips_ignored_rows():
    def sample(seed):
        sampler = ContextSampler(5, seed)
        for start in range(0, 40, 8):
            rows = torch.arange(start, start + 8, dtype=torch.float32).unsqueeze(1)
            target = torch.where(rows.squeeze(1) % 2 == 0, IGNORE_INDEX, 1)
            sampler(None, (rows, target), {})
        return sampler

    first, again, other = sample(0), sample(0), sample(1)
    assert first.seen == 20  # the odd rows only
    values = first.sample().squeeze(1)
    assert values.numel() == 5 and torch.all(values % 2 == 1)
    assert torch.equal(values, again.sample().squeeze(1))
    assert not torch.equal(values, other.sample().squeeze(1))


def test_command_on_a_trained_checkpoint(ptb_path, tmp_path, monkeypatch):
    from cli import main as cli_main

    monkeypatch.setattr(sys, "argv", ["cli.py"])
    small = [*EXPERIMENTS["ptb_mos"], "--data.init_args.path", ptb_path,
             "--model.init_args.backbone.init_args.embedding_size", "8",
             "--model.init_args.backbone.init_args.hidden_size", "8",
             "--model.init_args.head.init_args.num_components", "3"]  # fmt: skip
    cli_main(["fit", *small, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
              "--trainer.limit_val_batches", "2", "--trainer.enable_progress_bar", "false",
              "--trainer.default_root_dir", str(tmp_path),
              "--trainer.logger.init_args.save_dir", str(tmp_path)])  # fmt: skip
    ckpt = next(tmp_path.rglob("last.ckpt"))
    out = tmp_path / "rank"
    report = main([*small[:2], "--ckpt", str(ckpt), "--contexts", "30", "--out", str(out),
                   "--label", "mos", *small[2:], "--trainer.limit_val_batches", "1"])  # fmt: skip
    saved = json.loads((out / "rank.json").read_text())
    assert saved["rank"] == report.rank and saved["contexts"] == 30 and saved["label"] == "mos"
    assert saved["softmax_bound"] == 9 and 9 < report.rank <= 30  # MoS-3 over d = 8
    assert len(saved["singular_values"]) == 30
    assert (out / "spectrum.png").stat().st_size > 1000
