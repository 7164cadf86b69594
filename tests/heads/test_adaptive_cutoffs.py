import itertools
import json

import numpy as np
import pytest
import torch

from heads.adaptive_cutoffs import (
    CostModel,
    calibrate,
    candidate_positions,
    expected_cost,
    optimal_cutoffs,
    zipf_probabilities,
)

MODELS = [CostModel(0.2, 1e-5, 2000.0), CostModel(0.01, 3e-6, 0.0), CostModel(1.0, 1e-4, 50.0)]


def brute_force(probs, clusters, model, batch):
    vocab = len(probs)
    best = None
    for cuts in itertools.combinations(range(1, vocab), clusters):
        candidate = [*cuts, vocab]
        cost = expected_cost(candidate, probs, model, batch)
        if best is None or cost < best[1] - 1e-12:
            best = (candidate, cost)
    return best


@pytest.mark.parametrize("model", MODELS, ids=["k0b0", "affine", "expensive"])
@pytest.mark.parametrize("clusters", [1, 2, 3])
@pytest.mark.parametrize("probs", ["zipf", "random"])
def test_dynamic_program_matches_brute_force(model, clusters, probs):
    vocab = 24
    if probs == "zipf":
        p = zipf_probabilities(vocab)
    else:
        p = np.sort(np.random.default_rng(clusters).dirichlet(np.ones(vocab)))[::-1]
    cuts, cost = optimal_cutoffs(p, clusters, model, 1024.0)
    best_cuts, best_cost = brute_force(p, clusters, model, 1024.0)
    assert cost == pytest.approx(best_cost, rel=1e-12)
    assert expected_cost(cuts, p, model, 1024.0) == pytest.approx(cost, rel=1e-12)
    assert cuts[-1] == vocab and all(a < b for a, b in zip(cuts, cuts[1:], strict=False))


def test_large_vocabularies_use_a_grid_and_stay_fast():
    positions = candidate_positions(100_000)
    assert positions[-1] == 100_000 and len(positions) <= 401
    cuts, _ = optimal_cutoffs(zipf_probabilities(100_000), 3, MODELS[0], 4096.0)
    assert len(cuts) == 4 and cuts[-1] == 100_000


def test_calibration_measures_and_caches(tmp_path):
    model = calibrate(16, batch=64, repeats=1, cache_dir=tmp_path)
    assert model.lam > 0 and model.c >= 0 and model.k0b0 >= 0
    (cache,) = tmp_path.glob("adaptive_cost_model_*.json")
    assert CostModel(**json.loads(cache.read_text())) == model
    cache.write_text(json.dumps({"c": 1.0, "lam": 2.0, "k0b0": 3.0}))
    assert calibrate(16, cache_dir=tmp_path) == CostModel(1.0, 2.0, 3.0)  # read, not re-measured
    assert torch.get_num_threads() >= 1


def test_calibration_leaves_the_global_random_stream_alone(tmp_path):
    # rank 0 times the device, a later run reads the cached model: both must then draw the
    # same initial weights and dropout masks
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    calibrate(16, batch=64, repeats=1, cache_dir=tmp_path)
    torch.testing.assert_close(torch.rand(4), expected)
