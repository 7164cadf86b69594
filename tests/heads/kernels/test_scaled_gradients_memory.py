"""The rows plans' backward (heads/kernels/rows_ce.py ``scaled_gradients``, used by
``RowsCrossEntropy``, ``AdaptiveRowsLoss`` and ``MixtapeRowsCrossEntropy``) hands the gradients
stored in the forward over, scaled in place, when autograd will not run the graph again: one
copy of each at the backward's peak, not two. Where the graph is kept (``retain_graph``,
``create_graph``) it scales copies, so that every later backward is still exact: each checked
against the plain maths in float64 (``log_softmax`` over the whole ``[N, V]``) with incoming
gradients 0.37, 0, a vector on the per-token NLL, then once more without keeping the graph."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from heads.kernels import chunks, rows_ce
from heads.kernels.rows_ce import RowsCrossEntropy

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def _draw(gen, *shape, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen, dtype=F64)).requires_grad_()


# -- the three kinds of RowsCrossEntropy, each with its plain float64 maths ------------------
def _softmax_case(seed=0, n=10, v=37, d=5, eps=0.1):
    """One softmax with a bias, label smoothing and two ignored tokens."""
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, bias = _draw(gen, n, d), _draw(gen, v, d), _draw(gen, v)
    target = torch.randint(0, v, (n,), generator=gen)
    target[:2] = -1
    inputs = (hidden, weight, bias)

    def rows():
        keep = (target >= 0).to(F64)
        return RowsCrossEntropy.apply(hidden, weight, bias, target, None, None, None, keep,
                                      1 / keep.sum(), eps, F64, 4, True)  # fmt: skip

    def plain():
        logits = hidden @ weight.t() + bias
        loss = F.cross_entropy(logits, target, ignore_index=-1, label_smoothing=eps)
        nll = F.cross_entropy(logits, target, ignore_index=-1, reduction="none")
        return loss, nll

    return inputs, rows, inputs, plain


def _mixture_case(seed=1, n=9, k=3, v=29, d=4):
    """A mixture of ``k`` softmaxes (MoS, Eq. 1): the component rows and ``log pi``."""
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, prior = _draw(gen, n * k, d), _draw(gen, v, d), _draw(gen, n, k)
    target = torch.randint(0, v, (n,), generator=gen)
    target[0] = -1
    inputs = (hidden, weight, prior)

    def rows():
        keep = (target >= 0).to(F64)
        log_prior = torch.log_softmax(prior, 1)
        return RowsCrossEntropy.apply(hidden, weight, None, target, log_prior, None, None, keep,
                                      1 / keep.sum(), 0.0, F64, 4, True)  # fmt: skip

    def plain():
        log_p = torch.log_softmax((hidden @ weight.t()).view(n, k, v), 2)
        log_mix = torch.logsumexp(torch.log_softmax(prior, 1)[:, :, None] + log_p, 1)
        keep = target >= 0
        nll = torch.where(keep, -log_mix.gather(1, target.clamp_min(0)[:, None])[:, 0], 0.0)
        return nll.sum() / keep.sum(), nll

    return inputs, rows, inputs, plain


def _block_case(seed=2, n=8, v=23, d=4):
    """One block of a larger softmax: the rest's log-sum-exp and target logit given."""
    gen = torch.Generator().manual_seed(seed)
    hidden, weight, bias = _draw(gen, n, d), _draw(gen, v, d), _draw(gen, v)
    out_lse, out_logit = _draw(gen, n), _draw(gen, n)
    target = torch.randint(0, 2 * v, (n,), generator=gen)  # [v, 2v): the other block's
    inside = target < v
    inputs = (hidden, weight, bias, out_lse, out_logit)

    def rows():
        weights = torch.ones(n, dtype=F64)
        return RowsCrossEntropy.apply(hidden, weight, bias, torch.where(inside, target, -1),
                                      None, out_lse, torch.where(inside, 0.0, out_logit),
                                      weights, torch.tensor(1 / n, dtype=F64), 0.0, F64, 3,
                                      True)  # fmt: skip

    def plain():
        logits = hidden @ weight.t() + bias
        total = torch.logaddexp(torch.logsumexp(logits, 1), out_lse)
        inside_logit = logits.gather(1, target.clamp_max(v - 1)[:, None])[:, 0]
        nll = total - torch.where(inside, inside_logit, out_logit)
        return nll.mean(), nll

    return inputs, rows, inputs, plain


# -- the adaptive softmax's and Mixtape's rows plans ------------------------------------------
def _adaptive_case(seed=3):
    """The whole-loss rows plan of the adaptive softmax (CUDA's plans, switched on for this
    CPU by the ``cuda_plans`` fixture), against PyTorch's layer holding a float64 copy."""
    from tests.heads.kernels.test_adaptive_rows import _batch, _head
    from tests.heads.test_adaptive import copy_into_torch

    head = _head(head_bias=True)
    hidden, target = _batch(rows=24, seed=seed)
    ref = copy_into_torch(head, head.div_value)
    keep = target >= 0

    def rows():
        out = head(hidden, target)
        assert type(out.loss.grad_fn).__name__ == "AdaptiveRowsLossBackward"
        return out.loss, out.nll

    def plain():
        log_probs = ref.log_prob(hidden)
        nll = -log_probs.gather(1, target.clamp_min(0)[:, None])[:, 0]
        nll = torch.where(keep, nll, 0.0)
        return nll.sum() / keep.sum(), nll

    return (hidden, *head.parameters()), rows, (hidden, *ref.parameters()), plain


def _mixtape_case(seed=4):
    """Mixtape's rows plan (eager tiles, rare tokens, smoothing) against Eq. 2-6 plainly."""
    from tests.heads.kernels.test_mixtape_rows import _case, _reference, _rows

    values, target = _case(n=9, k=4, seed=seed)
    inputs = tuple(x for x in values.values() if x is not None)
    return (inputs, lambda: _rows(values, target, 0.1, 4), inputs,
            lambda: _reference(values, target, 0.1))  # fmt: skip


CASES = {
    "softmax": _softmax_case,
    "mixture": _mixture_case,
    "block": _block_case,
    "adaptive": _adaptive_case,
    "mixtape": _mixtape_case,
}


def _check(got, want):
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.fixture
def cuda_plans(monkeypatch):
    """CUDA's plans on this CPU (the adaptive softmax's whole-loss rows plan runs there)."""
    monkeypatch.setattr(chunks, "GPU_PLAN_DEVICES", {"cuda", "cpu"})


@pytest.mark.usefixtures("cuda_plans")
@pytest.mark.parametrize("case", CASES)
def test_backwards_through_a_kept_graph_stay_exact(case):
    """Four backwards through one graph, the first three keeping it: each one's gradients are
    the plain maths', with a scalar factor, 0 (which scaling in place would make permanent),
    the NLL vector differentiated as well, and finally without keeping the graph."""
    inputs, rows, ref_inputs, plain = CASES[case]()
    loss, nll = rows()
    ref_loss, ref_nll = plain()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    g = torch.linspace(-1.0, 2.0, nll.numel(), dtype=F64)
    for factor, vector, retain in ((0.37, None, True), (0.0, None, True), (2.5, g, True),
                                   (1.0, None, False)):  # fmt: skip
        outs, ref_outs = [loss], [ref_loss]
        grads, ref_grads = [torch.tensor(factor, dtype=F64)], [torch.tensor(factor, dtype=F64)]
        if vector is not None:  # a non-scalar output: the per-token NLL
            outs, ref_outs, grads = outs + [nll], ref_outs + [ref_nll], grads + [vector]
            ref_grads = ref_grads + [vector]
        got = torch.autograd.grad(outs, inputs, grads, retain_graph=retain)
        want = torch.autograd.grad(ref_outs, ref_inputs, ref_grads, retain_graph=True)
        _check(got, want)


@pytest.mark.usefixtures("cuda_plans")
@pytest.mark.parametrize("case", CASES)
def test_backward_once_and_gradient_accumulation_are_exact(case):
    """``.backward()`` twice over two forwards (gradient accumulation): the first backward's
    gradients become ``.grad`` and the second one's are added to them; ``create_graph``
    (which keeps the graph) gives the same."""
    inputs, rows, ref_inputs, plain = CASES[case]()
    for x in inputs:
        x.grad = None
    (rows()[0] * 0.5).backward()
    (rows()[0] * 1.5).backward()
    got = [x.grad.clone() for x in inputs]
    want = torch.autograd.grad(2 * plain()[0], ref_inputs)
    _check(got, want)
    kept = torch.autograd.grad(rows()[0], inputs, create_graph=True)
    _check(kept, torch.autograd.grad(plain()[0], ref_inputs))


def _peak_backward_bytes(loss: torch.Tensor, tmp_path, **kwargs) -> int:
    """The most CPU memory allocated at once during ``loss.backward(**kwargs)``, over what was
    allocated before it: the profiler's allocation events carry a running total (kept across
    profiler sessions, so taken from the first event's total before its own bytes)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward(**kwargs)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not memory:
        return 0
    start = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(m["Total Allocated"] for m in memory) - start


def test_the_backward_holds_one_copy_of_the_stored_gradients(tmp_path):
    """The peak of a backward that does not keep the graph: no second ``[V, d]`` dW and
    ``[N, d]`` dh (they were 2.6 MB here; 428 MB of dW alone at WikiText-103's V = 267,735,
    d = 400 in float32). A kept graph's backward makes its copies (and must)."""
    gen = torch.Generator().manual_seed(0)
    n, v, d = 64, 10_000, 64
    hidden = torch.randn(n, d, generator=gen).requires_grad_()
    weight = torch.randn(v, d, generator=gen).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)
    stored = (n + v) * d * 4  # dh and dW in float32

    def loss():
        keep = torch.ones(n)
        return RowsCrossEntropy.apply(hidden, weight, None, target, None, None, None, keep,
                                      1 / keep.sum(), 0.0, torch.float32, 16, True)[0]  # fmt: skip

    kept = _peak_backward_bytes(loss(), tmp_path, retain_graph=True)
    assert kept >= stored  # the copies
    weight.grad = hidden.grad = None
    once = _peak_backward_bytes(loss(), tmp_path)
    assert once < stored / 10, (once, stored)
    # the gradients are right (float32 against float64 maths)
    doubles = [x.detach().double().requires_grad_() for x in (hidden, weight)]
    plain = F.cross_entropy(doubles[0] @ doubles[1].t(), target)
    for got, want in zip((hidden, weight), torch.autograd.grad(plain, doubles), strict=True):
        torch.testing.assert_close(got.grad.double(), want, rtol=1e-4, atol=1e-7)


def test_the_stored_gradients_are_handed_over_not_copied():
    """Without a kept graph each parameter's ``.grad`` is the very tensor the forward stored
    (adaptive and Mixtape hand theirs over the same way: the peak test's sibling)."""
    pointers = set()  # (not the tensors: a reference held here would make autograd copy)
    save = torch.autograd.function.FunctionCtx.save_for_backward

    def spy(ctx, *tensors):
        pointers.update(t.data_ptr() for t in tensors if t is not None)
        return save(ctx, *tensors)

    inputs, rows, _, _ = _softmax_case()
    torch.autograd.function.FunctionCtx.save_for_backward = spy
    try:
        loss, _ = rows()
    finally:
        torch.autograd.function.FunctionCtx.save_for_backward = save
    loss.backward()
    assert all(x.grad.data_ptr() in pointers for x in inputs)


def test_views_of_one_buffer_are_each_scaled_once():
    """The GPU tiles store ``dW`` and ``db`` as views of one ``[V, d + 1 + pad]`` buffer
    (``TileGradients(fold_bias=True)``): in place, each scaled once; a missing or unneeded
    one left alone; out of place, the stored values untouched."""
    joint = torch.arange(1.0, 25.0, dtype=F64).view(4, 6)
    w, b, extra = joint[:, :4], joint[:, 4], torch.full((3,), 2.0, dtype=F64)
    before = joint.clone()
    factor = torch.tensor(0.25, dtype=F64)
    copies = rows_ce.scaled_gradients([w, b, None, extra], [True, True, True, False], factor,
                                      in_place=False)  # fmt: skip
    assert torch.equal(joint, before) and copies[2] is None and copies[3] is None
    torch.testing.assert_close(copies[0], before[:, :4] / 4, rtol=0, atol=0)
    scaled = rows_ce.scaled_gradients([w, b, None, extra], [True, True, True, False], factor,
                                      in_place=True)  # fmt: skip
    assert scaled[0] is w and scaled[1] is b and scaled[2] is None and scaled[3] is None
    torch.testing.assert_close(joint[:, :5], before[:, :5] / 4, rtol=0, atol=0)
    torch.testing.assert_close(joint[:, 5], before[:, 5], rtol=0, atol=0)
    assert torch.equal(extra, torch.full((3,), 2.0, dtype=F64))


def test_outside_a_backward_the_graph_counts_as_kept():
    """Nothing is scaled in place where autograd's engine is not running a backward."""
    assert rows_ce.graph_kept()


def test_a_torch_without_the_engines_flag_keeps_the_copy(monkeypatch):
    """Where torch lacks the engine's private keep-graph flag, every backward scales out of
    place (as before the hand-over), and the gradients stay right."""
    monkeypatch.setattr(rows_ce, "_KEEP_GRAPH", None)
    assert rows_ce.graph_kept()
    stored = [torch.ones(3, dtype=torch.float64)]
    factor = torch.tensor(2.0, dtype=torch.float64)
    scaled = rows_ce.scaled_gradients(stored, [True], factor)
    assert scaled[0] is not stored[0] and torch.equal(stored[0], torch.ones(3, dtype=torch.float64))
    assert torch.equal(scaled[0], torch.full((3,), 2.0, dtype=torch.float64))
