import logging

import numpy as np
import pytest
import torch

import heads.fused_cross_entropy as fce
from heads import HeadConfigError, HeadSetup, adaptive
from heads.adaptive import AdaptiveSoftmaxHead
from heads.errors import CheckpointMismatchError
from heads.fused_cross_entropy import LossOptions
from heads.kernels import chunks, compiled_lse
from tests.heads.contract import (
    CHUNKED,
    HIDDEN,
    PARTLY_KEPT,
    ROW_TILES,
    VOCAB,
    check_compiles_without_graph_breaks,
    check_inductor_compiles_every_batch_size,
    check_loss_matches_reference,
    check_training_keeps_no_vocabulary_rows,
)

COST = {"c": 0.05, "lam": 1e-6, "k0b0": 5000.0}

pytestmark = pytest.mark.usefixtures("one_thread")


def copy_into_torch(ours: AdaptiveSoftmaxHead, div: float) -> torch.nn.AdaptiveLogSoftmaxWithLoss:
    ref = torch.nn.AdaptiveLogSoftmaxWithLoss(
        ours.hidden_size, ours.vocab_size, ours.cutoffs[:-1], div_value=div,
        head_bias=ours.head.bias is not None,
    ).to(ours.head.weight)  # its dtype and device  # fmt: skip
    with torch.no_grad():
        ref.head.weight.copy_(ours.head.weight)
        if ours.head.bias is not None:
            ref.head.bias.copy_(ours.head.bias)
        for theirs, mine in zip(ref.tail, ours.tail, strict=True):
            theirs[0].weight.copy_(mine[0].weight)
            theirs[1].weight.copy_(mine[1].weight)
    return ref


@pytest.mark.parametrize("plan", ["auto", "plain"])
@pytest.mark.parametrize("head_bias", [False, True])
def test_equals_torch_adaptive_log_softmax(head_bias, plan):
    """Plain maths (CUDA's ``auto`` for small classifiers) and a CPU's ``auto``."""
    torch.manual_seed(0)
    ours = AdaptiveSoftmaxHead(32, 300, cutoffs=[20, 90, 200], div_value=2.0,
                               head_bias=head_bias).double()  # fmt: skip
    ours.loss_options = LossOptions(plan=plan)
    ref = copy_into_torch(ours, 2.0)
    hidden = torch.randn(64, 32, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 300, (64,))
    out, expected = ours(hidden, target), ref(hidden, target)
    torch.testing.assert_close(out.nll, -expected.output)
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(ours.log_prob(hidden), ref.log_prob(hidden))
    (grad,) = torch.autograd.grad(out.loss, hidden)
    (ref_grad,) = torch.autograd.grad(expected.loss, hidden)
    torch.testing.assert_close(grad, ref_grad)


@pytest.mark.parametrize("head_bias", [False, True])
def test_loss_edges_log_prob_and_topk_equal_torch_adaptive(head_bias):
    """Chunked short-list and tail classifiers, one row, every row ignored, label smoothing:
    against ``nn.AdaptiveLogSoftmaxWithLoss.log_prob`` with the same weights."""
    torch.manual_seed(3)

    def torch_log_prob(head, hidden):  # differentiable: the torch layer shares our weights
        ref = torch.nn.AdaptiveLogSoftmaxWithLoss(
            head.hidden_size, head.vocab_size, head.cutoffs[:-1], div_value=2.0,
            head_bias=head.head.bias is not None,
        ).to(hidden.dtype)  # fmt: skip
        ref.head.weight = head.head.weight
        if head.head.bias is not None:
            ref.head.bias = head.head.bias
        for theirs, mine in zip(ref.tail, head.tail, strict=True):
            theirs[0].weight, theirs[1].weight = mine[0].weight, mine[1].weight
        return ref.log_prob(hidden)

    check_loss_matches_reference(
        lambda: AdaptiveSoftmaxHead(
            HIDDEN, VOCAB, cutoffs=[4, 11], div_value=2.0, head_bias=head_bias
        ),  # fmt: skip
        torch_log_prob,
        options=(CHUNKED, PARTLY_KEPT, ROW_TILES, LossOptions(), LossOptions(plan="plain")),
    )


def test_training_keeps_no_vocabulary_rows():
    check_training_keeps_no_vocabulary_rows(
        lambda: AdaptiveSoftmaxHead(16, 3000, cutoffs=[100, 1000], div_value=2.0)
    )


def test_compiles_without_graph_breaks():
    """The tail clusters' sizes are data-dependent: captured as such, not a graph break."""
    check_compiles_without_graph_breaks(
        lambda: AdaptiveSoftmaxHead(HIDDEN, VOCAB, cutoffs=[4, 11], div_value=2.0)
    )


def test_inductor_compiles_every_batch_size():
    """Regression: after validation's batch size, a training batch recompiled with a symbolic
    size failed in Inductor (the tail's slice by the captured cluster sizes not provably in
    bounds), so `fit` with the compile preset stopped at its first training step."""
    check_inductor_compiles_every_batch_size(
        lambda: AdaptiveSoftmaxHead(8, VOCAB, cutoffs=[4, 11], div_value=2.0)
    )


def test_inductor_compiles_a_tail_projection_of_one_dimension():
    """Regression: a cluster projected to ``d // div^i = 1`` dimension (hidden 4, div 2, the
    second cluster; the Markov LM's d = 4 with one cluster at div 4) stopped `fit` under the
    compile preset at its first training step: autograd's mm backward tested whether the
    ``[rows, 1]`` projection (strides (1, 1)) has one row, a guard on a data-dependent size.
    The compiled head gives the eager losses and gradients."""
    check_inductor_compiles_every_batch_size(
        lambda: AdaptiveSoftmaxHead(4, VOCAB, cutoffs=[4, 11], div_value=2.0)
    )


def test_tail_projection_sizes_follow_div_value():
    head = AdaptiveSoftmaxHead(64, 1000, cutoffs=[100, 400], div_value=4.0)
    assert [t[0].out_features for t in head.tail] == [16, 4]
    assert [t[1].out_features for t in head.tail] == [300, 600]
    assert head.head.out_features == 102


@pytest.mark.parametrize("plan", ["auto", "plain"])
@pytest.mark.parametrize("high", [10, 50], ids=["short_list_only", "first_cluster_only"])
def test_a_cluster_the_batch_misses_gets_a_zero_gradient(high, plan):
    """Under DDP without find_unused_parameters every parameter needs a gradient on every
    rank: a cluster without a target in the batch runs on zero rows, which gives its
    parameters a zero gradient and the loss of the clusters it has."""
    torch.manual_seed(0)
    head = AdaptiveSoftmaxHead(16, 100, cutoffs=[10, 50], div_value=2.0).double()
    head.loss_options = LossOptions(plan=plan)
    hidden = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, high, (8,))
    head(hidden, target).loss.backward()
    expected = -head.log_prob(hidden).gather(1, target[:, None]).mean()
    torch.testing.assert_close(head(hidden, target).loss, expected)
    missed = [head.tail[1]] if high == 50 else list(head.tail)
    for module in missed:
        assert all(p.grad is not None and not p.grad.any() for p in module.parameters())
    if high == 50:
        assert all(p.grad.any() for p in head.tail[0].parameters())


@pytest.fixture
def gpu_plans_here(monkeypatch):
    """CUDA's execution plans on this CPU (``chunks.GPU_PLAN_DEVICES``): compiled tile bodies,
    through torch.compile's aot_eager backend (seconds instead of Inductor's minutes)."""
    import torch._dynamo

    monkeypatch.setattr(chunks, "GPU_PLAN_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(compiled_lse, "COMPILE_BACKEND", "aot_eager")
    yield
    torch._dynamo.reset()


def test_the_fused_products_on_gpu_plans_run_large_classifiers_by_rows_small_ones_plainly(
    gpu_plans_here, monkeypatch
):
    """``loss_backend: fused`` (the rows plan's fused products) on CUDA's plans: a classifier
    over more than ``ROWS_PLAIN_LOGITS`` logits by the rows plan (its gradient in the forward),
    a smaller one plainly, in one step; its loss, NLL and every gradient equal PyTorch's
    layer's in float64. (Plan ``rows`` itself runs the whole loss as one function:
    ``tests/heads/kernels/test_adaptive_rows.py``.)"""
    monkeypatch.setattr(fce, "ROWS_PLAIN_LOGITS", 1200)
    ran = {"plain": [], "rows": []}

    def spy(path, function):
        def spied(hidden, weight, *args, **kwargs):
            ran[path].append(weight.size(0))  # the classifier's columns
            return function(hidden, weight, *args, **kwargs)

        monkeypatch.setattr(adaptive, function.__name__, spied)

    spy("plain", adaptive.plain_nll)
    spy("rows", adaptive.mean_cross_entropy)
    torch.manual_seed(0)
    ours = AdaptiveSoftmaxHead(16, 300, cutoffs=[20, 90], div_value=2.0).double()
    ours.loss_options = LossOptions(plan="rows", fused_products=True)
    ref = copy_into_torch(ours, 2.0)
    gen = torch.Generator().manual_seed(1)
    # 64 rows: the head classifier's 64 x 22 logits (1,408) and the second cluster's 8 x 210
    # (1,680) over 1,200, the first cluster's 16 x 70 (1,120) within
    target = torch.cat([torch.randint(0, 20, (40,), generator=gen),
                        torch.randint(20, 90, (16,), generator=gen),
                        torch.randint(90, 300, (8,), generator=gen)])  # fmt: skip
    target = target[torch.randperm(64, generator=gen)]
    hidden = torch.randn(64, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    out, expected = ours(hidden, target), ref(hidden, target)
    assert ran == {"plain": [70], "rows": [22, 210]}
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(out.nll, -expected.output)
    mine = [hidden, *ours.parameters()]
    theirs = [hidden, *ref.parameters()]
    assert [p.shape for p in mine] == [p.shape for p in theirs]
    for got, want in zip(torch.autograd.grad(out.loss, mine),
                         torch.autograd.grad(expected.loss, theirs), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want)


def test_plan_rows_on_gpu_plans_at_the_losss_edges(gpu_plans_here, monkeypatch):
    """The same plans at the contract's edges (one row, ignored rows, every row ignored, label
    smoothing), against the float64 formula: every classifier by rows, and some plainly."""
    for crossover in (0, 30):
        monkeypatch.setattr(fce, "ROWS_PLAIN_LOGITS", crossover)
        check_loss_matches_reference(
            lambda: AdaptiveSoftmaxHead(HIDDEN, VOCAB, cutoffs=[4, 11], div_value=2.0),
            options=(LossOptions(plan="rows"), LossOptions(plan="rows", rows=4)),
        )


@pytest.mark.parametrize("align", [False, True], ids=["as_is", "aligned"])
@pytest.mark.parametrize("plan", ["auto", "plain"])
def test_a_small_step_on_gpu_plans_runs_every_classifier_on_every_row(
    gpu_plans_here, plan, align, monkeypatch
):
    """Within the saved budget, CUDA's plans run the short list and each tail cluster over
    every row (no sort, no read-back, no gather): the loss, NLL and every gradient equal
    PyTorch's layer's in float64, and a cluster the batch misses gets a zero gradient; the
    same with every classifier's columns padded to a multiple of 64 (``aligned``: as a large
    step runs them, fce.aligned_columns)."""
    if align:
        monkeypatch.setattr(fce, "PLAIN_ALIGN_FLOPS", 0)

    def no_sort(*args):
        raise AssertionError("the dense step sorts nothing and reads nothing back")

    monkeypatch.setattr(adaptive, "sort_into_groups", no_sort)
    torch.manual_seed(0)
    ours = AdaptiveSoftmaxHead(16, 300, cutoffs=[20, 90, 200], div_value=2.0,
                               head_bias=True).double()  # fmt: skip
    ours.loss_options = LossOptions(plan=plan)
    ref = copy_into_torch(ours, 2.0)
    gen = torch.Generator().manual_seed(1)
    target = torch.randint(0, 200, (64,), generator=gen)  # the last cluster missed
    target[[3, 9]] = fce.IGNORE_INDEX
    hidden = torch.randn(64, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    out, expected = ours(hidden, target), ref(hidden[target >= 0], target[target >= 0])
    torch.testing.assert_close(out.loss, expected.loss)
    torch.testing.assert_close(out.nll[target >= 0], -expected.output)
    assert not out.nll[[3, 9]].any()
    mine, theirs = [hidden, *ours.parameters()], [hidden, *ref.parameters()]
    got = torch.autograd.grad(out.loss, mine)  # every parameter has one (DDP needs it)
    want = torch.autograd.grad(expected.loss, theirs, allow_unused=True)
    for g, w, p in zip(got, want, mine, strict=True):
        torch.testing.assert_close(g, torch.zeros_like(p) if w is None else w)
    assert [w is None for w in want[-2:]] == [True, True]  # the missed cluster's: zero here


def test_the_dense_step_at_the_losss_edges(gpu_plans_here):
    """One row, ignored rows, every row ignored, label smoothing (each cluster's head entry
    counted once per word of it), against the float64 formula."""
    check_loss_matches_reference(
        lambda: AdaptiveSoftmaxHead(
            HIDDEN, VOCAB, cutoffs=[4, 11], div_value=2.0, head_bias=True
        ),  # fmt: skip
        options=(LossOptions(), LossOptions(plan="plain")),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_dense_step_smooths_in_float32_under_half_autocast(gpu_plans_here, dtype,
                                                                monkeypatch):  # fmt: skip
    """Label smoothing sums each row's head log-probs over the vocabulary (about -2e5 here):
    under 16-mixed a float16 product of them overflowed (65504) and the loss was inf. Under
    either autocast the dense step's loss equals the float32 one and its gradient is finite."""

    def no_sort(*args):
        raise AssertionError("the dense step sorts nothing")

    monkeypatch.setattr(adaptive, "sort_into_groups", no_sort)
    torch.manual_seed(0)
    head = AdaptiveSoftmaxHead(32, 20_000, cutoffs=[2000, 10_000], div_value=4.0).eval()
    hidden, target = 2 * torch.randn(96, 32), torch.randint(0, 20_000, (96,))
    want = head(hidden, target, label_smoothing=0.1).loss
    hidden.requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype):
        got = head(hidden, target, label_smoothing=0.1).loss
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-3, atol=0)
    got.backward()
    assert torch.isfinite(hidden.grad).all()


def test_the_dense_step_compiles_into_one_graph_without_captured_sizes(gpu_plans_here):
    """Nothing data-dependent in the dense step: one graph under torch.compile even where
    Dynamo may not capture scalar outputs (the sorted step breaks the graph there)."""
    import torch._dynamo

    head = AdaptiveSoftmaxHead(16, 100, cutoffs=[10, 50], div_value=2.0)
    hidden = torch.randn(12, 16, requires_grad=True)
    target = torch.randint(0, 100, (12,))
    counts = []
    for options in (LossOptions(), LossOptions(saved_bytes=0)):  # dense, then sorted
        head.loss_options = options
        with torch._dynamo.config.patch(capture_scalar_outputs=False):
            explained = torch._dynamo.explain(lambda h, t: head(h, t, label_smoothing=0.1).loss)(
                hidden, target
            )
        counts.append(explained.graph_break_count)
        torch._dynamo.reset()
    assert counts[0] == 0 and counts[1] > 0, counts


def test_steps_over_the_saved_budget_and_cpus_keep_each_cluster_to_its_rows(monkeypatch):
    """The dense step is for CUDA's plans within the saved budget: over it, or with another
    plan, or on a CPU's plans, the rows are sorted into their clusters (the one read-back)."""
    sorted_steps = []
    sort = adaptive.sort_into_groups

    def spied(labels, groups, sizes=None):
        sorted_steps.append(labels.numel())
        return sort(labels, groups, sizes)

    monkeypatch.setattr(adaptive, "sort_into_groups", spied)
    head = AdaptiveSoftmaxHead(16, 100, cutoffs=[10, 50], div_value=2.0)
    hidden, target = torch.randn(8, 16), torch.randint(0, 100, (8,))
    dense_bytes = 4 * 8 * (100 + 2)  # float32 logits of the three classifiers over 8 rows
    head.loss_options = LossOptions(plan="plain")
    head(hidden, target)  # a CPU's plans
    monkeypatch.setattr(chunks, "GPU_PLAN_DEVICES", {"cuda", "cpu"})
    for options in (LossOptions(saved_bytes=dense_bytes - 1), LossOptions(plan="rows"),
                    LossOptions(plan="eager"), LossOptions(saved_bytes=dense_bytes)):  # fmt: skip
        head.loss_options = options
        head(hidden, target)
    assert sorted_steps == [8, 8, 8, 8]  # all but the last: dense


def test_sizes_counted_on_the_host_leave_nothing_to_read_back(monkeypatch):
    """Told the batch's targets on the host first (``expect_targets``, as the tasks do before
    the batch is copied to the device), the sorted step reads nothing back and gives the same
    loss and gradients; told another batch's, it fails (a device-side assert), never silently;
    told a batch of another size, or nothing, it reads the sizes back as before."""
    torch.manual_seed(0)
    head = AdaptiveSoftmaxHead(16, 100, cutoffs=[10, 50], div_value=2.0).double()
    hidden = torch.randn(12, 16, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 100, (12,))
    target[3] = fce.IGNORE_INDEX
    out = head(hidden, target)
    want = torch.autograd.grad(out.loss, [hidden, *head.parameters()])
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    head.expect_targets(target.view(3, 4))  # (an LM batch: the task flattens it)
    reads.clear()  # (expect_targets counts on the host, outside the step)
    got = head(hidden, target)
    assert not reads
    torch.testing.assert_close(got.loss, out.loss)
    for g, w in zip(torch.autograd.grad(got.loss, [hidden, *head.parameters()]), want,
                    strict=True):  # fmt: skip
        torch.testing.assert_close(g, w)
    head.expect_targets(torch.roll(torch.arange(12) * 8, 1))  # another batch, as many targets
    with pytest.raises(RuntimeError, match="group sizes given for another batch"):
        head(hidden, target)
    for told in (target[:5], None):  # another size, or nothing told: read back
        if told is not None:
            head.expect_targets(told)
        reads.clear()
        torch.testing.assert_close(head(hidden, target).loss, out.loss)
        assert len(reads) == 1


def test_the_steps_one_read_back_comes_before_any_product():
    """The group sizes are read back before the first product is queued: on a GPU the host
    then waits for the backbone and the sort only, not for the head classifier, and the GPU
    is not left idle from the read-back to the first tail kernel."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Order(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    head = AdaptiveSoftmaxHead(16, 100, cutoffs=[10, 50], div_value=2.0)
    hidden = torch.randn(12, 16, requires_grad=True)
    target = torch.randint(0, 100, (12,))
    tolist = torch.Tensor.tolist

    def recorded_tolist(tensor):
        order.calls.append("tolist")  # a read-back that bypasses the dispatcher
        return tolist(tensor)

    with Order() as order, pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", recorded_tolist)
        head(hidden, target).loss.backward()
    products = [i for i, name in enumerate(order.calls) if name in ("mm", "addmm", "linear")]
    read_backs = [i for i, name in enumerate(order.calls)
                  if name in ("tolist", "_local_scalar_dense", "item")]  # fmt: skip
    assert products and read_backs, order.calls
    assert max(read_backs) < min(products), order.calls


def test_auto_cutoffs_from_the_cost_model():
    head = AdaptiveSoftmaxHead(64, 5000, cutoffs="auto", cost_model=COST, num_clusters=2)
    assert len(head.cutoffs) == 3 and head.cutoffs[-1] == 5000
    assert 0 < head.cutoffs[0] < head.cutoffs[1] < 5000


def test_auto_cutoffs_use_given_counts():
    counts = [1000] * 50 + [1] * 950  # 50 very frequent words, then a flat tail
    head = AdaptiveSoftmaxHead(64, 1000, "auto", cost_model=COST, num_clusters=1,
                               token_counts=counts, calibration_batch=4096)  # fmt: skip
    assert head.cutoffs[0] == 50


@pytest.mark.parametrize(
    "cutoffs", [[0, 10], [10, 5], [10, 10], [10, 24], [30], [], [2.5]], ids=str
)
def test_bad_cutoffs_are_reported(cutoffs):
    with pytest.raises(HeadConfigError, match="cutoffs must be increasing positive integers"):
        AdaptiveSoftmaxHead(HIDDEN, VOCAB, cutoffs=cutoffs)


def test_too_many_clusters_for_the_hidden_size():
    with pytest.raises(HeadConfigError, match="0 dimensions"):
        AdaptiveSoftmaxHead(8, 100, cutoffs=[5, 10, 20], div_value=4.0)


def test_a_trailing_vocabulary_size_is_accepted():
    assert AdaptiveSoftmaxHead(HIDDEN, VOCAB, cutoffs=[10, 23]).cutoffs == [10, 23]


def test_checkpoint_with_other_cutoffs_is_refused_clearly():
    saved = AdaptiveSoftmaxHead(16, 100, cutoffs=[10, 50]).state_dict()
    AdaptiveSoftmaxHead(16, 100, cutoffs=[10, 50]).load_state_dict(saved)
    with pytest.raises(
        CheckpointMismatchError, match=r"pass --model.head.init_args.cutoffs '\[10, 50\]'"
    ):
        AdaptiveSoftmaxHead(16, 100, cutoffs=[20, 50]).load_state_dict(saved)


def test_auto_starts_from_a_deterministic_choice_without_timing(monkeypatch):
    def no_timing(*args, **kwargs):
        raise AssertionError("auto must not time anything at construction")

    monkeypatch.setattr(adaptive, "calibrate", no_timing)
    first = AdaptiveSoftmaxHead(64, 5000, cutoffs="auto")
    assert first.cutoffs == AdaptiveSoftmaxHead(64, 5000, cutoffs="auto").cutoffs


def test_setup_takes_rank_zeros_decision_and_rebuilds():
    head = AdaptiveSoftmaxHead(16, 200, cutoffs="auto", cost_model=COST)
    decided_elsewhere = [7, 60, 200]

    def from_rank_zero(decide):  # what a non-zero rank sees: rank 0's result, not its own
        return decided_elsewhere

    head.setup(HeadSetup(decide_once=from_rank_zero))
    assert head.cutoffs == decided_elsewhere
    assert head.head.out_features == 7 + 2 and head.tail[1][1].out_features == 140
    hidden, target = torch.randn(6, 16), torch.randint(0, 200, (6,))
    assert torch.isfinite(head(hidden, target).loss)


def test_a_rebuilt_head_starts_from_the_seed_not_the_global_stream():
    # DDP re-seeds before setup, a single process does not: both must initialise alike, and
    # the rebuild must not move the stream the rest of the run draws from
    def rebuilt(draws_before: int) -> tuple[AdaptiveSoftmaxHead, torch.Tensor]:
        torch.manual_seed(5)
        head = AdaptiveSoftmaxHead(16, 200, cutoffs="auto", cost_model=COST)
        torch.rand(draws_before)
        head.setup(HeadSetup(decide_once=lambda decide: [7, 60, 200]))
        return head, torch.rand(3)

    (a, after_a), (b, _) = rebuilt(0), rebuilt(11)
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y)
    torch.manual_seed(5)
    AdaptiveSoftmaxHead(16, 200, cutoffs="auto", cost_model=COST)
    torch.testing.assert_close(torch.rand(3), after_a)


def test_setup_times_the_given_device_once_and_uses_the_datas_counts(monkeypatch, caplog):
    timed = []
    caplog.set_level(logging.INFO, logger="heads")

    def fake_calibrate(hidden_size, device, *args, **kwargs):
        timed.append((hidden_size, torch.device(device)))
        return adaptive.CostModel(**COST)

    monkeypatch.setattr(adaptive, "calibrate", fake_calibrate)
    head = AdaptiveSoftmaxHead(64, 1000, cutoffs="auto", num_clusters=1, calibration_batch=4096)
    counts = np.array([1000] * 50 + [1] * 950)
    provisional = [r.getMessage() for r in caplog.records]  # not said: setup decides
    head.setup(HeadSetup(device=torch.device("cpu"), token_counts=counts))
    assert timed == [(64, torch.device("cpu"))]
    assert head.cutoffs[0] == 50
    said = [r.getMessage() for r in caplog.records if "cut-offs" in r.getMessage()]
    assert provisional == [] and len(said) == 1 and str(head.cutoffs) in said[0]


def test_given_cutoffs_ignore_setup():
    head = AdaptiveSoftmaxHead(16, 100, cutoffs=[10, 50])
    head.setup(HeadSetup(decide_once=lambda decide: [20, 50, 100]))
    assert head.cutoffs == [10, 50, 100]


def test_small_vocabularies_fall_back_to_fewer_clusters(caplog):
    # hidden 8 / div 4^2 leaves no dimension for a second cluster: one cluster, with a warning
    head = AdaptiveSoftmaxHead(8, 64, cutoffs="auto", num_clusters=2)
    assert head.num_clusters == 1
    assert "2 tail clusters do not fit" in caplog.text
    hidden, target = torch.randn(5, 8), torch.randint(0, 64, (5,))
    assert torch.isfinite(head(hidden, target).loss)
    # the fewest words a split takes (Sec. 4.3): a short-list of one and a one-word cluster
    assert AdaptiveSoftmaxHead(8, 2, cutoffs="auto").cutoffs == [1, 2]
    with pytest.raises(HeadConfigError, match=r"vocab_size >= 2 \(got 1\)"):
        AdaptiveSoftmaxHead(8, 1, cutoffs="auto")
    with pytest.raises(HeadConfigError, match=r"hidden_size // div_value >= 1 \(got 2 // 4.0\)"):
        AdaptiveSoftmaxHead(2, 10, cutoffs="auto")


def test_auto_adopts_a_checkpoints_cutoffs():
    trained = AdaptiveSoftmaxHead(16, 100, cutoffs=[10, 50]).double()
    fresh = AdaptiveSoftmaxHead(16, 100, cutoffs="auto").double()
    assert fresh.cutoffs != trained.cutoffs
    fresh.check_state_dict(trained.state_dict())
    fresh.load_state_dict(trained.state_dict())
    assert fresh.cutoffs == [10, 50, 100]
    hidden = torch.randn(3, 16, dtype=torch.float64)
    torch.testing.assert_close(fresh.log_prob(hidden), trained.log_prob(hidden))
