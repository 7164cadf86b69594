import itertools
import math

import numpy as np
import pytest
import torch

from datamodules import MarkovChainDataModule
from datamodules.errors import DataConfigError
from datamodules.markov_chain import MarkovChain


def _block_entropy(chain: MarkovChain, n: int) -> float:
    """H(X_1..X_n) of the stationary chain, by enumerating every sequence of n tokens."""
    v, k = chain.vocab_size, chain.order
    p = np.exp(chain.log_transitions)
    total = 0.0
    for seq in itertools.product(range(v), repeat=n):
        context = sum(t * v ** (k - 1 - i) for i, t in enumerate(seq[:k]))
        prob = chain.stationary[context]
        for t in range(k, n):
            prob *= p[context, seq[t]]
            context = (context % v ** (k - 1)) * v + seq[t] if k > 1 else seq[t]
        total -= prob * math.log(prob)
    return total


@pytest.mark.parametrize(("vocab", "rank", "order"), [(4, 3, 1), (3, 2, 2)])
def test_entropy_rate_by_enumeration(vocab, rank, order):
    """H(X_n | X_1..X_{n-1}) = H_n - H_{n-1} is the entropy rate exactly once n > order."""
    chain = MarkovChain.generate(vocab, rank, order=order, seed=5)
    n = order + 3
    assert chain.entropy_rate == pytest.approx(
        _block_entropy(chain, n) - _block_entropy(chain, n - 1), abs=1e-10
    )
    # the stationary distribution is stationary, and a long sample's NLL approaches the rate
    p = np.exp(chain.log_transitions)
    if order == 1:
        np.testing.assert_allclose(chain.stationary @ p, chain.stationary, atol=1e-12)
    sample = chain.sample(200_000, seed=1)
    assert chain.nll(sample).mean() == pytest.approx(chain.entropy_rate, abs=0.01)


@pytest.mark.parametrize("structure", ["clustered", "gaussian"])
def test_rank_and_frequency_order(structure):
    chain = MarkovChain.generate(64, 12, structure=structure, scale=2.0, seed=0)
    assert chain.centred_rank() == 12
    np.testing.assert_allclose(np.exp(chain.log_transitions).sum(1), 1.0, atol=1e-12)
    unigram = chain.unigram
    assert np.all(np.diff(unigram) <= 1e-15)  # ids sorted by decreasing frequency
    assert chain.entropy_rate < -(unigram * np.log(unigram)).sum()  # context helps


def _module(tmp_path, **options):
    args = dict(vocab_size=32, rank=6, train_tokens=5000, valid_tokens=1000, test_tokens=1000,
                batch_size=4, eval_batch_size=4, bptt=8, cache_dir=str(tmp_path))  # fmt: skip
    return MarkovChainDataModule(**{**args, **options})


def test_determinism_by_seed_and_cache(tmp_path, monkeypatch):
    a = _module(tmp_path / "a", seed=3)
    b = _module(tmp_path / "b", seed=3)
    for split in ("train", "valid", "test"):
        assert torch.equal(a.split_tokens(split), b.split_tokens(split))
    assert not torch.equal(
        a.split_tokens("train"), _module(tmp_path / "c", seed=4).split_tokens("train")
    )
    # a second module on the same cache reads it: nothing is generated again
    monkeypatch.setattr(MarkovChain, "generate", lambda *a, **k: pytest.fail("rebuilt"))
    again = _module(tmp_path / "a", seed=3)
    assert torch.equal(again.split_tokens("test"), a.split_tokens("test"))
    assert again.summary == a.summary
    # another option is another entry
    assert _module(tmp_path / "a", seed=3, rank=5).cache.path != a.cache.path


def test_summary_optimum_and_batches(tmp_path):
    data = _module(tmp_path)
    summary = data.summary
    assert summary["centred_rank"] == 6 and summary["rank"] == 6
    chain = data.chain
    assert summary["entropy_rate"] == pytest.approx(chain.entropy_rate)
    for split in ("train", "valid", "test"):
        tokens = data.split_tokens(split).numpy()
        assert data.optimum_nll(split) == pytest.approx(chain.nll(tokens).mean())
    assert data.optimum_nll("val") == data.optimum_nll("valid")
    assert data.token_counts.sum() == 5000 and data.vocab_size == 32
    inputs, targets = next(iter(data.train_dataloader()))
    assert inputs.shape == (4, 8) and torch.equal(inputs[:, 1:], targets[:, :-1])
    assert data.load_state_dict(data.state_dict()) is None


@pytest.mark.parametrize(
    ("option", "value"),
    [("rank", 1), ("rank", 33), ("structure", "banded"), ("scale", 0), ("order", 0),
     ("train_tokens", 0), ("vocab_size", 4096 * 4)],
)  # fmt: skip
def test_bad_config(tmp_path, option, value):
    with pytest.raises(DataConfigError, match=option if option != "vocab_size" else "order"):
        _module(tmp_path, **{option: value, **({"order": 2} if option == "vocab_size" else {})})
