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
    fit_cost_model,
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


@pytest.mark.parametrize("k0b0", [0.0, 2**15, 4e6, 1e7])
def test_the_fit_recovers_eq_7_wherever_its_plateau_ends(k0b0):
    # the products calibrate times on a GPU (k over 4..16384 at B = 512, small and large B)
    ks = np.unique(np.geomspace(4, 16384, 12).astype(int))
    work = np.concatenate([ks * 512.0, [8.0, 64.0, 512.0], 16384.0 * np.array([2048, 8192, 16384])])
    true = CostModel(c=0.005, lam=2.6e-9, k0b0=k0b0)
    fitted = fit_cost_model(work, true.time(work, 1.0))
    assert fitted.c == pytest.approx(true.c, rel=1e-6)
    assert fitted.lam == pytest.approx(true.lam, rel=1e-6)
    assert fitted.k0b0 == pytest.approx(true.k0b0, rel=1e-6, abs=1e-3)
    # so the cut-offs are the true model's (a line through the plateau's products picked
    # [2959, 31532] for [4974, 35389] at k0B0 = 1e7: 8.5% slower by the true model)
    probs = zipf_probabilities(100_000)
    assert (
        optimal_cutoffs(probs, 2, fitted, 16384.0)[0] == optimal_cutoffs(probs, 2, true, 16384.0)[0]
    )


def test_the_fit_keeps_the_line_from_starting_above_noisy_plateaus():
    work = np.geomspace(8, 8e6, 15)
    times = CostModel(c=0.01, lam=1e-8, k0b0=1e4).time(work, 1.0)
    rng = np.random.default_rng(0)
    fitted = fit_cost_model(work, times * rng.uniform(0.9, 1.1, len(work)))
    assert 0.0 <= fitted.c <= fitted.c + fitted.lam * fitted.k0b0
    assert fitted.lam == pytest.approx(1e-8, rel=0.2)
    assert fitted.time(8e6, 1.0) == pytest.approx(0.09, rel=0.15)
