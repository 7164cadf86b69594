"""Choosing adaptive-softmax cut-offs (Grave et al. 2017, adaptive-softmax.txt, Sec. 4).

Computation-time model of a ``[B, d] x [d, k]`` product (Eq. 7)::

    g(k, B) = max(c + lambda * k0B0, c + lambda * k * B)

Expected cost of a head short-list of ``k_h`` words plus ``J`` tail clusters (Eq. 8)::

    C = g(J + k_h, B) + sum_i g(k_i, p_i * B)

where ``p_i`` is the probability mass of cluster i. As in the paper, the program sizes the
clusters at full capacity; the reduced tail dimensions (``d / div^i``) are applied afterwards
and only make the tails cheaper. (Folding ``d_i / d`` into the program drives frequent words
out of the short-list into low-capacity clusters, trading quality for modelled speed.) Words
are assigned by decreasing probability to clusters of increasing size (Sec. 4.3), so only the
cut-off positions are free; they are found by dynamic programming over the sorted vocabulary.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from heads.user_cache import cache_root as user_cache_root

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CostModel:
    """``g(k, B) = max(c + lam * k0b0, c + lam * k * B)``; times in milliseconds."""

    c: float
    lam: float
    k0b0: float

    def time(self, k: np.ndarray | float, batch: np.ndarray | float) -> np.ndarray | float:
        return np.maximum(self.c + self.lam * self.k0b0, self.c + self.lam * k * batch)


def zipf_probabilities(vocab_size: int, exponent: float = 1.0) -> np.ndarray:
    """Unigram model for frequency-sorted ids when no counts are given: p(rank) ~ rank^-s."""
    weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def candidate_positions(vocab_size: int, max_candidates: int = 400) -> np.ndarray:
    """Cut-off positions the search considers: all of them for small vocabularies, else a
    geometric grid (relative resolution ~2%), which is what the cost model can resolve."""
    if vocab_size <= max_candidates:
        return np.arange(1, vocab_size + 1)
    grid = np.unique(np.geomspace(1, vocab_size, max_candidates).round().astype(np.int64))
    return np.union1d(grid, [vocab_size])


def expected_cost(cutoffs: list[int], probs: np.ndarray, model: CostModel, batch: float) -> float:
    """Eq. 8 for a given cut-off list ``[k_h, c_1, ..., V]``."""
    cumulative = np.concatenate(([0.0], np.cumsum(probs)))
    cost = float(model.time(len(cutoffs) - 1 + cutoffs[0], batch))
    for start, stop in zip(cutoffs, cutoffs[1:], strict=False):
        mass = cumulative[stop] - cumulative[start]
        cost += float(model.time(stop - start, mass * batch))
    return cost


def optimal_cutoffs(
    probs: np.ndarray,
    num_clusters: int,
    model: CostModel,
    batch: float,
    max_candidates: int = 400,
) -> tuple[list[int], float]:
    """Dynamic program: cut-offs ``[k_h, c_1, ..., c_J = V]`` minimising Eq. 8 for fixed J.

    ``best[i][p]``: least cost of the head plus the first i tail clusters when cluster i
    ends at position p. Exact over the candidate positions (all positions when
    ``V <= max_candidates``).
    """
    vocab_size = len(probs)
    if num_clusters < 1 or num_clusters >= vocab_size:
        raise ValueError(f"num_clusters must be in [1, {vocab_size - 1}], got {num_clusters}")
    positions = candidate_positions(vocab_size, max_candidates)
    cumulative = np.concatenate(([0.0], np.cumsum(probs)))
    mass_at = cumulative[positions]
    best = model.time(num_clusters + positions, batch).astype(np.float64)  # head ends at p
    best[positions >= vocab_size] = np.inf  # the head cannot hold every word
    back: list[np.ndarray] = []
    for i in range(1, num_clusters + 1):
        # cost of a cluster spanning (q, p] for every pair q < p
        size = positions[None, :] - positions[:, None]
        mass = mass_at[None, :] - mass_at[:, None]
        step = model.time(size, mass * batch)
        total = best[:, None] + np.where(size > 0, step, np.inf)
        arg = total.argmin(axis=0)
        best = total[arg, np.arange(len(positions))]
        if i < num_clusters:
            best[positions >= vocab_size] = np.inf  # later clusters still need room
        back.append(arg)
    end = len(positions) - 1  # the last cluster ends at V
    cuts = [int(positions[end])]
    for arg in reversed(back):
        end = int(arg[end])
        cuts.append(int(positions[end]))
    cuts.reverse()
    return cuts, float(best[-1])


def _time_matmul(rows: int, dim: int, cols: int, device: torch.device, repeats: int) -> float:
    # a private generator: timing must not move the global random stream, or a run that times
    # (rank 0) would initialise and drop out differently from one that read a cached model
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, dim, generator=generator).to(device)
    w = torch.randn(cols, dim, generator=generator).to(device)
    times = []
    for _ in range(repeats + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        x @ w.T
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times[2:]) * 1e3)


# the extra batches a GPU's calibration times at k = 16384 (up to ~2.7e8 k B: cheap there)
_LARGE_BATCHES = (2048, 8192, 16384)


def fit_cost_model(work: np.ndarray, times: np.ndarray) -> CostModel:
    """Eq. 7 fitted to products timed at ``work = k B``: a plateau up to ``k0B0``, a line after.

    Every split of the samples (sorted by work) into a plateau below and a line from it up is
    tried (the plateau their median, the line least squares through the rest); the fit with
    the least squared relative error over all samples is kept, so that products still on the
    plateau do not flatten the line (a GPU's plateau reaches millions of ``k B``).
    """
    order = np.argsort(work)
    work, times = np.asarray(work, np.float64)[order], np.asarray(times, np.float64)[order]
    best: tuple[float, CostModel] | None = None
    for split in range(len(work) - 1):  # the line needs two samples
        lam, c = np.polyfit(work[split:], times[split:], 1)
        lam = max(float(lam), 1e-12)
        plateau = float(np.median(times[:split])) if split else max(float(c), 0.0)
        # the line may not start above the plateau (noise): then it is reached at k B = 0
        c = min(max(float(c), 0.0), plateau)
        model = CostModel(c=c, lam=lam, k0b0=max(plateau - c, 0.0) / lam)
        error = float(np.sum(((model.time(work, 1.0) - times) / times) ** 2))
        if best is None or error < best[0]:
            best = (error, model)
    assert best is not None, "at least two timed products"
    return best[1]


def calibrate(
    hidden_size: int,
    device: torch.device | str = "cpu",
    batch: int = 512,
    repeats: int = 5,
    cache_dir: str | os.PathLike | None = None,
) -> CostModel:
    """Measure ``c``, ``lambda`` and ``k0B0`` for ``[B, d] x [d, k]`` on this machine.

    Times products over a range of ``k * B`` (on a GPU up to ~2.7e8) and fits Eq. 7 to them
    (:func:`fit_cost_model`). The result is cached per device and hidden size in ``cache_dir``,
    else ``adaptive/`` below the project's cache root (``heads/user_cache.py``); ``v2`` in the
    file's name: models fitted before 2026-11-29 took a plateau's products for the line's.
    """
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    threads = torch.get_num_threads()
    cache_root = Path(cache_dir) if cache_dir else user_cache_root("adaptive")
    key = f"{name}-t{threads}-d{hidden_size}".replace(" ", "_").replace("/", "_")
    cache_file = cache_root / f"adaptive_cost_model_v2_{key}.json"
    if cache_file.is_file():
        model = CostModel(**json.loads(cache_file.read_text()))
        log.info("adaptive softmax cost model (cached %s): %s", cache_file, model)
        return model

    ks = np.unique(np.geomspace(4, 16384, 12).astype(int))
    rows = [(k, batch, _time_matmul(batch, hidden_size, int(k), device, repeats)) for k in ks]
    small = [(8, b, _time_matmul(b, hidden_size, 8, device, repeats)) for b in (1, 8, 64)]
    # a GPU's plateau reaches millions of k B: time products past it, so the line is seen
    large = (
        [(16384, b, _time_matmul(b, hidden_size, 16384, device, repeats)) for b in _LARGE_BATCHES]
        if device.type == "cuda"
        else []
    )
    samples = np.array(rows + small + large, dtype=np.float64)
    model = fit_cost_model(samples[:, 0] * samples[:, 1], samples[:, 2])
    cache_root.mkdir(parents=True, exist_ok=True)
    cache_file.write_text(json.dumps(asdict(model)))
    log.info("adaptive softmax cost model (measured, cached in %s): %s", cache_file, model)
    return model
