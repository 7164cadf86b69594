"""heads/kernels/adaptive_rows.py by row tiles: the adaptive softmax's whole-loss ``rows`` plan
(CUDA's plans, run here on the CPU) walks each classifier's rows in tiles planned as the other
rows plans' (``heads.fused_cross_entropy.row_tile``), so that no classifier's logits are held
whole: untiled, the head classifier held ``[N, k_h + J]`` logits and each tail cluster
``[R_i, |C_i|]``, whatever ``chunk_bytes`` or the device's memory. Loss, NLL and every gradient
against the adaptive softmax written plainly in float64 (Grave et al. Sec. 3.3)."""

from __future__ import annotations

import pytest
import torch

from heads.adaptive import AdaptiveSoftmaxHead
from heads.fused_cross_entropy import LossOptions
from heads.kernels import chunks
from tests.heads.test_saved_memory import LargestStorage, saved_bytes_of

pytestmark = pytest.mark.usefixtures("one_thread")

D, V, CUTOFFS = 16, 300, [20, 90]


@pytest.fixture(autouse=True)
def cuda_plans(monkeypatch):
    """CUDA's execution plans on this CPU (``chunks.GPU_PLAN_DEVICES``): plan ``rows`` runs
    the whole loss as one function, by the torch operators (no Triton here)."""
    monkeypatch.setattr(chunks, "GPU_PLAN_DEVICES", {"cuda", "cpu"})


def _head(options: LossOptions, head_bias: bool = True) -> AdaptiveSoftmaxHead:
    torch.manual_seed(0)
    head = AdaptiveSoftmaxHead(D, V, cutoffs=CUTOFFS, div_value=2.0, head_bias=head_bias)
    head = head.double()
    head.loss_options = options
    return head


def _batch(rows: int = 64, high: int = V, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, high, (rows,), generator=gen)
    target[[0, 7, 30]] = -100
    hidden = torch.randn(rows, D, generator=gen, dtype=torch.float64, requires_grad=True)
    return hidden, target


def _reference_nll(head: AdaptiveSoftmaxHead, hidden: torch.Tensor, target: torch.Tensor):
    """Per row ``-log P(t) = -log P_head(c(t)) - log P_c(t)`` in float64, written plainly
    (0 where ignored)."""
    head_logits = hidden @ head.head.weight.t()
    if head.head.bias is not None:
        head_logits = head_logits + head.head.bias
    head_lp = head_logits - torch.logsumexp(head_logits, 1, keepdim=True)
    nll = []
    for n in range(target.numel()):
        t = int(target[n])
        if t < 0:
            nll.append(hidden.new_zeros(()))
            continue
        if t < CUTOFFS[0]:
            nll.append(-head_lp[n, t])
            continue
        i = 1 if t < CUTOFFS[1] else 2
        start = CUTOFFS[i - 1]
        projected = hidden[n] @ head.tail[i - 1][0].weight.t()
        logits = head.tail[i - 1][1].weight @ projected
        cluster_lp = logits[t - start] - torch.logsumexp(logits, 0)
        nll.append(-head_lp[n, CUTOFFS[0] + i - 1] - cluster_lp)
    return torch.stack(nll)


def _check_against_reference(head, hidden, target, out, nll_weight=None):
    inputs = [hidden, *head.parameters()]
    nll = _reference_nll(head, hidden, target)
    keep = (target >= 0).sum().clamp_min(1)
    loss = nll.sum() / keep
    torch.testing.assert_close(out.nll, nll, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.loss, loss, rtol=1e-12, atol=1e-12)
    got_objective, want_objective = out.loss, loss
    if nll_weight is not None:
        got_objective = got_objective + (nll_weight * out.nll).sum()
        want_objective = want_objective + (nll_weight * nll).sum()
    got = torch.autograd.grad(got_objective, inputs)
    want = torch.autograd.grad(want_objective, inputs, allow_unused=True, materialize_grads=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


TILED = [
    pytest.param(LossOptions(plan="rows", rows=5), id="rows5"),
    # 3.6 KB of float32 logits: tiles of 40 rows in the head (22 classes), 12 in the first
    # cluster (70), 4 in the second (210)
    pytest.param(LossOptions(plan="rows", chunk_bytes=4 * 3 * 300 + 1), id="chunk_bytes"),
]


@pytest.mark.parametrize("options", TILED)
@pytest.mark.parametrize("high", [V, CUTOFFS[1]], ids=["every_cluster", "last_missed"])
def test_tiled_walk_equals_the_float64_formula(options, high):
    """Several tiles per classifier (5 rows, or a 3.6 KB chunk: 2 to 11 tiles): loss, NLL and
    every gradient as the plain float64 formula, ignored rows and a cluster the batch misses
    included (its parameters' gradients zero); the NLL output differentiated too (the
    backward's walk)."""
    head = _head(options)
    hidden, target = _batch(high=high)
    out = head(hidden, target)
    _check_against_reference(head, hidden, target, out)
    if high < V:
        grads = torch.autograd.grad(head(hidden, target).loss, list(head.tail[1].parameters()))
        assert all(not g.any() for g in grads)
    g = torch.linspace(-1, 2, hidden.size(0), dtype=torch.float64)
    _check_against_reference(head, hidden, target, head(hidden, target), nll_weight=g)


@pytest.mark.parametrize("slots", [(16, 48), (64, 64), (48, 3)])
def test_tiled_fixed_slots_equal_the_float64_formula(slots):
    """A captured step's layout (fixed slots per cluster, those past its rows weightless) by
    tiles of 5 rows: the same numbers."""
    head = _head(LossOptions(plan="rows", rows=5))
    hidden, target = _batch(high=V if slots[1] > 3 else CUTOFFS[1])
    with head.captured_as(("slots", slots)):
        out = head(hidden, target)
    g = torch.linspace(-1, 2, hidden.size(0), dtype=torch.float64)
    _check_against_reference(head, hidden, target, out, nll_weight=g)


# A large step for memory: 2,048 rows, a 4,000-word short list and a 28,000-word last cluster
# that a quarter of the rows fall in: the untiled walk held its [512, 28,000] float32 logits
# (57 MB) and the head's [2,048, 4,002] (33 MB)
BIG_N, BIG_D, BIG_V, BIG_CUTOFFS = 2048, 32, 40_000, [4000, 12_000]
BUDGET = 1 << 20


def _big_step(options: LossOptions):
    torch.manual_seed(0)
    head = AdaptiveSoftmaxHead(BIG_D, BIG_V, cutoffs=BIG_CUTOFFS, div_value=4.0)
    head.loss_options = options
    gen = torch.Generator().manual_seed(2)
    quarter = BIG_N // 4
    target = torch.cat([torch.randint(0, 4000, (2 * quarter,), generator=gen),
                        torch.randint(4000, 12_000, (quarter,), generator=gen),
                        torch.randint(12_000, BIG_V, (quarter,), generator=gen)])  # fmt: skip
    target[::97] = -100
    hidden = torch.randn(BIG_N, BIG_D, generator=gen, requires_grad=True)
    params = list(head.parameters())
    head.expect_targets(target)  # counted on the host, as the tasks do: nothing read back
    largest = LargestStorage()
    with largest:
        out, saved = saved_bytes_of(lambda: head(hidden, target), exclude=[*params, hidden])
        out.loss.backward()
    # what the backward needs: the gradients of the input and of every parameter (float32)
    structural = 4 * (hidden.numel() + sum(p.numel() for p in params))
    return saved, structural, largest.largest


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(LossOptions(plan="rows", chunk_bytes=BUDGET, saved_bytes=BUDGET),
                     id="chunk_bytes"),
        # a stated device: tiles of a 1/16 share of its memory (fce._CUDA_MEMORY_SHARE)
        pytest.param(LossOptions(plan="rows", device_memory=16 * BUDGET, saved_bytes=BUDGET),
                     id="device_memory"),
    ],
)  # fmt: skip
def test_the_rows_plan_holds_tiles_not_whole_classifiers(options):
    """Planned for a budget of 1 MiB (given as ``chunk_bytes``, or as a 16 MiB device's
    share): no storage of the step (forward and backward) is over the budget plus the
    structural gradients' largest (the short list's ``[4,002, 32]`` float32, 0.5 MB); what is
    saved for the backward is the gradients alone (no logits). Untiled, its largest storage was
    the last cluster's logits, 57 MB."""
    saved, structural, largest = _big_step(options)
    assert saved <= structural + 64, (saved, structural)
    assert largest <= BUDGET + 4 * 4002 * BIG_D, largest


def test_a_tiled_step_reads_nothing_back(monkeypatch):
    """The tiles come from the host's counts (``expect_targets``) and the shapes: a tiled step
    makes no read-back (CUDA's sync-free step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ReadBacks(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "item", "nonzero"):
                self.calls.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    tolist = torch.Tensor.tolist
    head = _head(LossOptions(plan="rows", rows=5))
    hidden, target = _batch()
    head.expect_targets(target)
    with ReadBacks() as reads:
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.calls.append("tolist") or
                            tolist(t))  # fmt: skip
        head(hidden, target).loss.backward()
        monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    assert reads.calls == []
