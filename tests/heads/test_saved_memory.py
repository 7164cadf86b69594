"""What every head's training step keeps alive (docs/design.md, Numerics): no float32
``[N, V]`` (MoS: no ``[N, K, V]``) tensor is built in training or in an evaluation forward
beyond ``LossOptions.saved_bytes``, and what the forward saves for the backward beyond the
structural ``O((N + V) d)`` tensors is at most that budget per fused call.

Measured on the CPU plans with a budget and chunks far below the ``[N, V]`` logits of the
step, so that a head that kept (or built) its logits whole would show it: the bytes saved for
the backward (unique storages seen by ``saved_tensors_hooks``, parameters and inputs left
out) and the largest storage any operator writes during forward and backward (a
``TorchDispatchMode``)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import heads
from heads.fused_cross_entropy import LossOptions

N, V, D = 256, 4000, 16
LOGITS_BYTES = 4 * N * V  # one float32 [N, V]: 4 MB
BUDGET = 512 << 10  # saved_bytes of the budgeted steps: 1/8 of the logits
CHUNK = 512 << 10  # a chunk's (and the CPU rows plan's tile's) float32 logits
# fused calls a step makes, each with its own budget (LossOptions.saved_bytes is per call):
# Mixtape's frequent and rare blocks; the adaptive softmax's head and two tail clusters, and
# with label smoothing the two clusters again over every row (AdaptiveSoftmaxHead._smoothing);
# DS-Softmax's two experts
CALLS = {"softmax": 1, "mos": 1, "mixtape": 2, "adaptive": 3, "ds": 2}
SMOOTHING_CALLS = {**CALLS, "adaptive": 5}

HEADS = {
    "softmax": lambda: heads.SoftmaxHead(D, V),
    "mos": lambda: heads.MoSHead(D, V, num_components=3),
    "mixtape": lambda: heads.MixtapeHead(D, V, gate_embedding_size=8),
    "adaptive": lambda: heads.AdaptiveSoftmaxHead(D, V, cutoffs=[200, 1000]),
    "ds": lambda: heads.DSSoftmaxHead(D, V, num_experts=2),
}
CASES = [
    pytest.param({}, id="plain"),
    pytest.param({"label_smoothing": 0.1}, id="smoothing"),
    pytest.param({"ignored": 0.3}, id="ignored"),
    pytest.param({"autocast": True}, id="bf16"),
]


class LargestStorage(TorchDispatchMode):
    """The largest storage (bytes) of any operator's output while active."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def saved_bytes_of(fn, exclude: list[torch.Tensor]):
    """``(fn(), bytes of the unique storages fn saves for the backward)``, ``exclude``'s
    storages (parameters, inputs) not counted."""
    left_out = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in left_out:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def batch(vocab: int, ignored: float = 0.0, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=generator, requires_grad=True)
    target = torch.randint(0, vocab, (N,), generator=generator)
    if ignored:
        target[torch.rand(N, generator=generator) < ignored] = -100
    return hidden, target


def step(name: str, saved: int, label_smoothing=0.0, ignored=0.0, autocast=False):
    """One training step of head ``name`` with ``saved_bytes=saved``: (saved bytes, largest
    storage written in forward and backward, the loss and every gradient)."""
    torch.manual_seed(0)
    head = HEADS[name]()
    head.loss_options = LossOptions(saved_bytes=saved, chunk_bytes=CHUNK)
    hidden, target = batch(V, ignored)
    params = list(head.parameters())
    largest = LargestStorage()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with largest:
        with amp:
            out, saved_bytes = saved_bytes_of(
                lambda: head(hidden, target, label_smoothing=label_smoothing),
                exclude=[*params, hidden],
            )
        (out.loss + out.aux_loss).backward()
    grads = [hidden.grad, *(p.grad for p in params)]
    return saved_bytes, largest.largest, out.loss.detach(), grads


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", list(HEADS))
def test_training_step_keeps_within_the_saved_budget(name: str, case: dict) -> None:
    """Saved for the backward: the structural tensors (``O((N + V) d)``, far below one
    ``[N, V]``) plus at most ``saved_bytes`` per fused call; no operator writes a storage
    of half an ``[N, V]`` (MoS: of ``[N, K, V]`` a sixth)."""
    structural, largest, loss0, grads0 = step(name, 0, **case)
    budgeted, largest_budgeted, loss1, grads1 = step(name, BUDGET, **case)
    assert structural < LOGITS_BYTES / 8, (name, structural)
    calls = (SMOOTHING_CALLS if case.get("label_smoothing") else CALLS)[name]
    assert budgeted <= structural + calls * BUDGET, (name, structural, budgeted)
    assert max(largest, largest_budgeted) < LOGITS_BYTES / 2, (name, largest, largest_budgeted)
    # the budget changes what is kept, not the numbers
    tol = {"rtol": 2e-2, "atol": 1e-3} if case.get("autocast") else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(loss1, loss0, **tol)
    for g1, g0 in zip(grads1, grads0, strict=True):
        if g0 is None:
            assert g1 is None
        else:
            torch.testing.assert_close(g1, g0, **tol)


@pytest.mark.parametrize("name", list(HEADS))
def test_default_budget_keeps_chunks_it_needs_only(name: str) -> None:
    """With the default budget (128 MiB, more than this step's logits) the column plans keep
    what they computed, the step's logits held once: at most one ``[N, V]`` (MoS: ``[N, K,
    V]``) and the gate planes of Mixtape's frequent block (``2K`` floats a frequent column),
    never two copies."""
    torch.manual_seed(0)
    head = HEADS[name]()
    hidden, target = batch(V)
    params = list(head.parameters())
    _, saved = saved_bytes_of(lambda: head(hidden, target), exclude=[*params, hidden])
    k = getattr(head, "num_components", 1)
    frequent = getattr(head, "num_frequent", 0)
    allowed = LOGITS_BYTES * (k if name == "mos" else 1) + 4 * N * 2 * k * frequent
    assert saved <= allowed + LOGITS_BYTES / 8, (name, saved, allowed)


@pytest.mark.parametrize("name", list(HEADS))
def test_evaluation_forward_builds_no_logit_matrix(name: str) -> None:
    """Perplexity's forward under ``torch.no_grad`` (validation, test) walks the vocabulary
    as the training step does: nothing of half an ``[N, V]``."""
    torch.manual_seed(0)
    head = HEADS[name]().eval()
    head.loss_options = LossOptions(saved_bytes=BUDGET, chunk_bytes=CHUNK)
    hidden, target = batch(V, ignored=0.1)
    largest = LargestStorage()
    with torch.no_grad(), largest:
        out = head(hidden.detach(), target)
    assert out.nll.shape == (N,)
    assert largest.largest < LOGITS_BYTES / 2, (name, largest.largest)


def forward_peak(fn) -> int:
    """Peak bytes of the CPU allocations made while ``fn`` runs (the profiler's memory
    events, in order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("name", list(HEADS))
def test_evaluation_forward_keeps_no_chunks(name: str) -> None:
    """Under ``torch.no_grad`` no backward can read what a forward keeps, so the column plans
    keep nothing: with the default budget (128 MiB, more than this step's logits) an
    evaluation forward's peak stays below half an ``[N, V]``. It kept its chunks up to the
    budget before (softmax, MoS, Mixtape, adaptive, DS: 1.5-2x the logits at this size;
    Mixtape at N = 2,048, V = 8,000: 58 MiB against 16)."""
    torch.manual_seed(0)
    head = HEADS[name]().eval()
    # the default saved_bytes, the column plans (an adaptive classifier this small runs plainly
    # under auto on a CPU, its [rows, C] logits by design: CPU_PLAIN_LOGITS)
    head.loss_options = LossOptions(chunk_bytes=CHUNK, plan="eager")
    hidden, target = batch(V, ignored=0.1)
    hidden = hidden.detach()
    with torch.no_grad():
        expected = head(hidden, target).nll  # warm, and the reference
        out = {}
        peak = forward_peak(lambda: out.setdefault("nll", head(hidden, target).nll))
    torch.testing.assert_close(out["nll"], expected)
    assert peak < LOGITS_BYTES / 2, (name, peak)
