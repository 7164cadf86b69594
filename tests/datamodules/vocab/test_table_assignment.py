import itertools

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from datamodules.vocab.table_assignment import objective, reassign, solve_exact, solve_separable


def brute_force(row_cost: np.ndarray, col_cost: np.ndarray) -> float:
    """Plain reference: try every injective placement of the words into the cells."""
    n, d1 = row_cost.shape
    d2 = col_cost.shape[1]
    best = np.inf
    for cells in itertools.permutations(range(d1 * d2), n):
        cost = sum(row_cost[w, c // d2] + col_cost[w, c % d2] for w, c in enumerate(cells))
        best = min(best, cost)
    return best


def random_instance(rng, n, d1, d2, kind):
    if kind == "uniform":
        return rng.random((n, d1)), rng.random((n, d2))
    # low rank plus noise, scaled by a Zipf-like word count: closer to real Eq. 6 costs,
    # where frequent words have large costs and rows compete for the same words
    counts = (200.0 / np.arange(1, n + 1))[:, None] + 1
    row = (rng.random((n, 4)) @ rng.random((4, d1)) + 0.1 * rng.random((n, d1))) * counts
    col = (rng.random((n, 4)) @ rng.random((4, d2)) + 0.1 * rng.random((n, d2))) * counts
    return row, col


def is_bijection(cells, n, size):
    return cells.shape == (n,) and len(set(cells.tolist())) == n and 0 <= cells.min() < size


@pytest.mark.parametrize("seed", range(6))
def test_exact_equals_brute_force_on_tiny_tables(seed):
    rng = np.random.default_rng(seed)
    n, d1, d2 = [(3, 2, 2), (4, 2, 3), (5, 3, 2)][seed % 3]
    row, col = rng.random((n, d1)), rng.random((n, d2))
    cells = solve_exact(row, col)
    assert is_bijection(cells, n, d1 * d2)
    assert objective(row, col, cells) == pytest.approx(brute_force(row, col))


@pytest.mark.parametrize("kind", ["uniform", "zipf_low_rank"])
@pytest.mark.parametrize("seed", [0, 1])
def test_separable_within_one_percent_of_exact_on_1k_words(kind, seed):
    rng = np.random.default_rng(seed)
    n, d1, d2 = 1000, 32, 32
    row, col = random_instance(rng, n, d1, d2, kind)
    start = rng.permutation(d1 * d2)[:n]
    exact = objective(row, col, solve_exact(row, col))
    cells, lower_bound = solve_separable(row, col, start)
    assert is_bijection(cells, n, d1 * d2)
    approx = objective(row, col, cells)
    # the stated bound of the scalable solver (module docstring)
    assert exact - 1e-6 <= approx <= 1.01 * exact
    assert lower_bound <= exact + 1e-6


def test_separable_never_increases_the_objective_and_keeps_a_bijection():
    rng = np.random.default_rng(3)
    n, d1, d2 = 300, 20, 17
    row, col = random_instance(rng, n, d1, d2, "zipf_low_rank")
    cells = rng.permutation(d1 * d2)[:n]
    for _ in range(3):  # repeated re-assignments, each from the previous table
        row = row + rng.random(row.shape)  # the model (and so the costs) moved meanwhile
        result = reassign(row, col, cells, solver="separable")
        assert is_bijection(result.cells, n, d1 * d2)
        assert result.after <= result.before + 1e-9
        assert result.lower_bound <= result.after + 1e-9
        assert result.moved == pytest.approx(np.mean(result.cells != cells))
        cells = result.cells


def test_reassign_auto_picks_exact_for_small_tables_and_accepts_tensors():
    rng = np.random.default_rng(4)
    row, col = torch.tensor(rng.random((6, 3))), torch.tensor(rng.random((6, 3)))
    result = reassign(row, col, np.arange(6))
    assert result.solver == "exact"
    assert result.after == pytest.approx(brute_force(row.numpy(), col.numpy()))
    assert result.after <= result.before


def test_bad_inputs_are_reported():
    with pytest.raises(ValueError, match="do not fit"):
        solve_exact(np.zeros((5, 2)), np.zeros((5, 2)))
    with pytest.raises(ValueError, match="distinct cell"):
        reassign(np.zeros((2, 2)), np.zeros((2, 2)), [1, 1])
    with pytest.raises(ValueError, match="solver must be"):
        reassign(np.zeros((2, 2)), np.zeros((2, 2)), [0, 1], solver="greedy")


@pytest.mark.parametrize("solver", ["exact", "separable"])
def test_only_movable_words_move(solver):
    rng = np.random.default_rng(5)
    n, d1, d2 = 40, 7, 7
    row, col = random_instance(rng, n, d1, d2, "zipf_low_rank")
    cells = rng.permutation(d1 * d2)[:n]
    movable = rng.random(n) < 0.7
    result = reassign(row, col, cells, solver=solver, movable=movable)
    assert is_bijection(result.cells, n, d1 * d2)
    assert np.array_equal(result.cells[~movable], cells[~movable])
    assert result.after <= result.before + 1e-9
    assert result.lower_bound <= result.after + 1e-9
    if solver == "exact":  # optimal over the cells the fixed words leave free
        free = np.setdiff1d(np.arange(d1 * d2), cells[~movable])
        assert np.isin(result.cells[movable], free).all()
        # plain reference: the dense cost restricted to the free cells
        full = (row[movable][:, :, None] + col[movable][:, None, :]).reshape(movable.sum(), -1)
        r, c = linear_sum_assignment(full[:, free])
        fixed = objective(row[~movable], col[~movable], cells[~movable])
        assert result.after == pytest.approx(full[r, free[c]].sum() + fixed)


@pytest.mark.parametrize("solver", ["auto", "exact", "separable"])
def test_no_movable_word_leaves_the_table_as_it_is(solver):
    # a scoring sample with no rare word in it: nothing to re-learn, and nothing fails
    rng = np.random.default_rng(6)
    row, col = random_instance(rng, 12, 4, 4, "zipf_low_rank")
    cells = rng.permutation(16)[:12]
    result = reassign(row, col, cells, solver=solver, movable=np.zeros(12, dtype=bool))
    assert np.array_equal(result.cells, cells) and result.moved == 0.0
    assert result.after == result.before == result.lower_bound == objective(row, col, cells)
    with pytest.raises(ValueError, match="solver must be"):
        reassign(row, col, cells, solver="greedy", movable=np.zeros(12, dtype=bool))


@pytest.mark.slow
def test_a_10k_word_table_is_reassigned_by_the_scalable_solver():
    """The issue's 10k-word size, on synthetic Eq. 6-like costs (Zipf counts x low rank).
    Its time is measured by ``python -m datamodules.vocab.table_assignment`` (README), not here."""
    rng = np.random.default_rng(0)
    n, d1, d2 = 10_000, 100, 100
    row, col = random_instance(rng, n, d1, d2, "zipf_low_rank")
    result = reassign(row, col, np.arange(n))
    assert result.solver == "separable"
    assert is_bijection(result.cells, n, d1 * d2)
    assert result.lower_bound <= result.after < result.before


def plain_block_descent(row_cost, col_cost, cells, max_sweeps, blocked, solves):
    """Every group solved at every sweep, one after the other (the descent as it was);
    ``solves`` counts the exact assignments."""
    d1, d2 = row_cost.shape[1], col_cost.shape[1]
    rows, cols = cells // d2, cells % d2
    grid = blocked.reshape(d1, d2)
    for _ in range(max_sweeps):
        moved = False
        for cost, fixed, free, groups, taken in ((row_cost, cols, rows, d2, grid.T),
                                                 (col_cost, rows, cols, d1, grid)):  # fmt: skip
            for g in range(groups):
                words = np.flatnonzero(fixed == g)
                if len(words):
                    group_cost = np.where(taken[g], np.inf, cost[words])
                    new = linear_sum_assignment(group_cost)[1]
                    solves.append(1)
                    moved |= bool((new != free[words]).any())
                    free[words] = new
        if not moved:
            break
    return rows * d2 + cols


@pytest.mark.parametrize("workers", [1, 4])
def test_the_descent_re_solves_only_changed_groups_on_threads_with_the_same_table(
    monkeypatch, workers
):
    """Skipping the groups whose members did not change, and solving a phase's groups on a
    thread pool, give the table of the plain descent (blocked cells included)."""
    from datamodules.vocab import table_assignment

    rng = np.random.default_rng(5)
    row, col = random_instance(rng, 600, 30, 25, "low_rank")
    blocked = np.zeros(30 * 25, dtype=bool)
    blocked[rng.choice(30 * 25, 100, replace=False)] = True
    cells = rng.choice(np.flatnonzero(~blocked), 600, replace=False)
    monkeypatch.setattr(table_assignment.os, "cpu_count", lambda: workers)
    calls, plain_calls = [], []
    solve = table_assignment._solve_group
    monkeypatch.setattr(table_assignment, "_solve_group",
                        lambda *args: calls.append(1) or solve(*args))  # fmt: skip
    for sweeps in (1, 3, 30):
        found = table_assignment._block_descent(row, col, cells.copy(), sweeps, blocked)
        expected = plain_block_descent(row, col, cells.copy(), sweeps, blocked, plain_calls)
        np.testing.assert_array_equal(found, expected)
        assert not blocked[found].any() and len(set(found.tolist())) == 600
    assert len(calls) < 0.8 * len(plain_calls)  # fewer solves than the plain descent
