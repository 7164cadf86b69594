"""The fused linear + log-sum-exp primitive (heads/fused_cross_entropy.py) against plain float64
math: values and gradients of every input, chunk and tile edges, kept and recomputed chunks,
ignored rows, label smoothing, autocast, memory and torch.compile."""

import pytest
import torch
import torch.nn.functional as F

import heads.fused_cross_entropy as fce
import heads.kernels.chunks as chunks
from heads.errors import HeadConfigError, UserError
from heads.fused_cross_entropy import (
    CPU_PLAIN_LOGITS,
    IGNORE_INDEX,
    ROWS_PLAIN_LOGITS,
    LossOptions,
    MissingBackendError,
    combine_lse,
    linear_cross_entropy,
    linear_lse,
    plain_loss_fits,
    plain_nll,
    plan_tiles,
    spans,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# how the chunks run: one chunk kept (small problems), chunks of 5 columns and tiles of 4 rows
# recomputed in the backward (V = 23 is not a multiple of 5), and the same partly kept; each
# with dL/dz folded chunk by chunk (fold) and with the row scale on [N, d] (rows)
_LAYOUTS = {
    "one_chunk_kept": {},
    "recomputed": {"columns": 5, "rows": 4, "saved_bytes": 0},
    "partly_kept": {"columns": 5, "rows": 4, "saved_bytes": 2 * 4 * 5 * 8},
    "tall_chunks": {"columns": 23, "rows": 1, "saved_bytes": 0},
}
OPTIONS = {
    f"{name}-{mode}": LossOptions(**layout, fold=mode == "fold")
    for name, layout in _LAYOUTS.items()
    for mode in ("fold", "rows")
}


def _case(rows: int, classes: int = 23, dim: int = 6, bias: bool = True, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    hidden, weight = rand(rows, dim), rand(classes, dim)
    b = rand(classes) if bias else None
    target = torch.randint(0, classes, (rows,), generator=gen)
    return hidden, weight, b, target


def _reference(hidden, weight, bias, target, eps):
    """Plain: the [N, V] logits, log_softmax, smoothing by hand (0 at ignored rows)."""
    log_probs = F.linear(hidden, weight, bias).log_softmax(-1)
    keep = target != IGNORE_INDEX
    nll = -log_probs.gather(1, target.clamp_min(0)[:, None]).squeeze(1)
    smoothing = -log_probs.mean(-1)
    zero = torch.zeros_like(nll)
    return torch.where(keep, nll, zero), torch.where(keep, smoothing, zero)


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "rows, ignored",
    [(11, [2, 7]), (1, []), (5, [0, 1, 2, 3, 4]), (0, [])],
    ids=["mixed", "one_row", "all_ignored", "no_rows"],
)
def test_values_and_gradients_equal_plain_float64(options, eps, bias, rows, ignored):
    hidden, weight, b, target = _case(rows, bias=bias)
    target[ignored] = IGNORE_INDEX
    inputs = [t for t in (hidden, weight, b) if t is not None]
    weights = torch.rand(rows, dtype=torch.float64) + 0.5  # a non-uniform incoming gradient
    out = linear_cross_entropy(hidden, weight, b, target, label_smoothing=eps, options=options)
    nll, smoothing = _reference(hidden, weight, b, target, eps)
    torch.testing.assert_close(out.nll, nll)
    if eps:
        torch.testing.assert_close(out.smoothing, smoothing)
    else:
        assert out.smoothing is None
    got = torch.autograd.grad((out.loss(eps) * weights).sum(), inputs, allow_unused=True)
    want = torch.autograd.grad((((1 - eps) * nll + eps * smoothing) * weights).sum(), inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.zeros_like(w) if g is None else g, w)


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_chunks_of_minus_inf_logits_are_finite_and_exact(options):
    """Masked columns (``-inf`` bias: DS's pruned classes, padding) filling whole chunks,
    the first one included: the shift of such a chunk is ``-inf`` and ``-inf - -inf`` was NaN.
    Loss and every gradient equal the float64 reference (whose masked entries get 0)."""
    hidden, weight, b, target = _case(11, seed=5)
    with torch.no_grad():
        b[:10] = -torch.inf  # chunks [0, 5) and [5, 10) of the 5-column layouts
        b[15:] = -torch.inf  # [15, 20) and the short last chunk [20, 23)
    target = torch.randint(10, 15, (11,), generator=torch.Generator().manual_seed(1))
    target[3] = IGNORE_INDEX
    inputs, weights = (hidden, weight, b), torch.rand(11, dtype=torch.float64) + 0.5
    out = linear_cross_entropy(hidden, weight, b, target, options=options)
    lse = linear_lse(hidden, weight, b, target, options=options).lse
    torch.testing.assert_close(lse, torch.logsumexp(F.linear(hidden, weight, b), -1))
    got = torch.autograd.grad((out.nll * weights).sum(), inputs)
    nll, _ = _reference(hidden, weight, b, target, 0.0)
    torch.testing.assert_close(out.nll, nll)
    want = torch.autograd.grad((nll * weights).sum(), inputs)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_gradcheck_every_output_and_input(options):
    hidden, weight, b, target = _case(7, classes=11, dim=3, seed=1)
    target[3] = 20  # outside [0, V): no target logit (another block's target)

    def parts(h, w, bb):
        out = linear_lse(h, w, bb, target, logit_sum=True, options=options)
        return out.lse, out.target_logit, out.logit_sum

    assert torch.autograd.gradcheck(parts, (hidden, weight, b))


def test_lse_target_logit_and_sum_are_the_plain_ones():
    hidden, weight, b, target = _case(9, seed=2)
    target[4] = -1
    logits = F.linear(hidden, weight, b)
    out = linear_lse(hidden, weight, b, target, logit_sum=True, options=OPTIONS["recomputed-rows"])
    torch.testing.assert_close(out.lse, logits.logsumexp(-1))
    expected = torch.where(target >= 0, logits.gather(1, target.clamp_min(0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(out.target_logit, expected)
    torch.testing.assert_close(out.logit_sum, logits.sum(-1))


def test_blocks_combine_into_the_whole_vocabulary():
    """Two blocks' partial log-sum-exps (as Mixtape's frequent and rare parts): their
    ``combine_lse`` and summed target logits give the full cross-entropy and its gradient."""
    hidden, weight, b, target = _case(8, seed=3)
    ref = F.cross_entropy(F.linear(hidden, weight, b), target, reduction="sum")
    first = linear_lse(hidden, weight[:9], b[:9], torch.where(target < 9, target, -1))
    second = linear_lse(hidden, weight[9:], b[9:], torch.where(target >= 9, target - 9, -1))
    ours = (combine_lse(first.lse, second.lse) - first.target_logit - second.target_logit).sum()
    torch.testing.assert_close(ours, ref)
    for g, w in zip(torch.autograd.grad(ours, (hidden, weight)),
                    torch.autograd.grad(ref, (hidden, weight)), strict=True):  # fmt: skip
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("saved", [0, 1 << 30], ids=["recomputed", "kept"])
def test_a_peaked_softmax_is_exact_in_log_space(saved):
    """Logits spread over thousands: exps fall below the CPU floor and target probabilities
    underflow float32, yet losses and gradients match torch's float32 cross-entropy."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 8, generator=gen).requires_grad_()
    weight = (300 * torch.randn(37, 8, generator=gen)).requires_grad_()
    target = torch.randint(0, 37, (40,), generator=gen)
    options = LossOptions(columns=16, saved_bytes=saved)
    ours = linear_cross_entropy(hidden, weight, None, target, options=options).nll
    ref = F.cross_entropy(F.linear(hidden, weight), target, reduction="none")
    assert ours.max() > 1000
    torch.testing.assert_close(ours, ref)
    for g, w in zip(torch.autograd.grad(ours.sum(), (hidden, weight)),
                    torch.autograd.grad(ref.sum(), (hidden, weight)), strict=True):  # fmt: skip
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize(
    "options",
    [
        OPTIONS[f"{layout}-{mode}"]
        for layout in ("partly_kept", "one_chunk_kept")
        for mode in ("fold", "rows")
    ],
)
def test_a_retained_graph_gives_the_same_gradients_twice(options):
    """The backward leaves the kept chunks as it found them."""
    hidden, weight, b, target = _case(8, seed=5)
    loss = linear_cross_entropy(hidden, weight, b, target, label_smoothing=0.1,
                                options=options).loss(0.1).sum()  # fmt: skip
    first = torch.autograd.grad(loss, (hidden, weight, b), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight, b))
    for a, c in zip(first, second, strict=True):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "rows"])
def test_bf16_autocast_products_with_float32_statistics(fold):
    """Under CPU bf16 autocast: float32 outputs and float32 gradients of float32 inputs; the
    values are float32 math on the bf16 product (what autocast's ``F.linear`` gives), the
    gradients those of float32 math to bf16 precision."""
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(33, 16, generator=gen).requires_grad_()
    weight = (0.5 * torch.randn(301, 16, generator=gen)).requires_grad_()
    bias = torch.randn(301, generator=gen).requires_grad_()
    target = torch.randint(0, 301, (33,), generator=gen)
    target[5] = IGNORE_INDEX
    with torch.autocast("cpu", dtype=torch.bfloat16):
        options = LossOptions(columns=64, saved_bytes=0, fold=fold)
        out = linear_cross_entropy(hidden, weight, bias, target, label_smoothing=0.1,
                                   options=options)  # fmt: skip
    assert out.nll.dtype == out.smoothing.dtype == out.lse.dtype == torch.float32
    with torch.no_grad():
        product = (hidden.bfloat16() @ weight.bfloat16().T).float() + bias
        ref = F.cross_entropy(product, target, reduction="none", label_smoothing=0.1)
    torch.testing.assert_close(out.loss(0.1), ref)
    ref = F.cross_entropy(F.linear(hidden, weight, bias), target, reduction="none",
                          label_smoothing=0.1)  # fmt: skip
    grads = torch.autograd.grad(out.loss(0.1).sum(), (hidden, weight, bias))
    ref_grads = torch.autograd.grad(ref.sum(), (hidden, weight, bias))
    for g, w in zip(grads, ref_grads, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=3e-2, atol=3e-2)


def _saved_numels(fn) -> list[int]:
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sizes


@pytest.mark.parametrize("saved_bytes", [0, 64 * 32 * 4 * 3])
def test_memory_is_chunks_not_logits(saved_bytes):
    """Saved for the backward: the inputs, per-row statistics and at most ``saved_bytes`` of
    kept chunks (three of 32 columns here), never the [N, V] logits."""
    n, v, d = 64, 1000, 8
    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(v, d, requires_grad=True)
    target = torch.randint(0, v, (n,))
    options = LossOptions(columns=32, saved_bytes=saved_bytes)
    sizes = _saved_numels(
        lambda: linear_cross_entropy(hidden, weight, None, target, options=options).nll.sum()
    )
    big = [s for s in sizes if s > v * d]
    assert big == [], big  # nothing larger than W itself
    chunks = [s for s in sizes if s == n * 32]
    assert len(chunks) == saved_bytes // (n * 32 * 4)


def test_chunk_plan_is_by_bytes_and_covers_everything():
    cpu = torch.device("cpu")
    tile, width = plan_tiles(2048, 100_000, cpu, LossOptions(chunk_bytes=16 << 20))
    assert tile == 2048 and width == 2048  # 16 MiB of float32 [2048, 2048]
    tile, width = plan_tiles(500_000, 100_000, cpu, LossOptions(chunk_bytes=16 << 20))
    assert width == 128 and tile == (16 << 20) // 4 // 128  # many rows: tiles of rows
    assert plan_tiles(10, 7, cpu, LossOptions()) == (10, 7)  # one chunk
    # as many chunks as 2048 columns need, of even widths: no narrow last one
    for columns, width in ((10_000, 2000), (9000, 1808), (2049, 1040)):
        assert plan_tiles(2048, columns, cpu, LossOptions(chunk_bytes=16 << 20))[1] == width
        sizes = [b - a for a, b in spans(columns, width)]
        assert len(sizes) == -(-columns // 2048) and max(sizes) - min(sizes) < 16 * len(sizes)
    assert plan_tiles(2048, 9000, cpu, LossOptions(columns=2048))[1] == 2048  # forced: kept
    assert spans(23, 5) == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 23)]
    assert spans(0, 5) == [] and spans(9, None) == [(0, 9)]


def test_backend_errors_are_one_line():
    with pytest.raises(HeadConfigError, match="loss backend 'fast' is not one of"):
        LossOptions(backend="fast")
    hidden, weight, b, target = _case(3)
    for backend in ("cce", "liger"):
        with pytest.raises(MissingBackendError, match="CUDA only") as raised:
            linear_cross_entropy(hidden, weight, b, target, options=LossOptions(backend=backend))
        assert isinstance(raised.value, UserError) and "\n" not in str(raised.value)


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "rows"])
def test_compiles_into_one_graph_without_breaks(fold):
    """The training step's loss traces into one graph (forward and backward) under
    torch.compile: loops over shapes only, no host syncs; and it gives the eager values and
    gradients."""
    import torch._dynamo

    hidden, weight, b, target = _case(12, classes=40, seed=8)
    target[2] = IGNORE_INDEX
    options = LossOptions(columns=16, saved_bytes=12 * 16 * 8, fold=fold)

    def loss(h, w, bb, t):
        out = linear_cross_entropy(h, w, bb, t, label_smoothing=0.1, options=options)
        return out.loss(0.1).sum()

    explained = torch._dynamo.explain(loss)(hidden, weight, b, target)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(hidden, weight, b, target), (hidden, weight, b))
    want = torch.autograd.grad(loss(hidden, weight, b, target), (hidden, weight, b))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()


def _cuda_case(dtype=torch.float32, rows=64, classes=1000, dim=32):
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(rows, dim, generator=gen).cuda().requires_grad_()
    weight = (dim**-0.5 * torch.randn(classes, dim, generator=gen)).cuda().requires_grad_()
    bias = torch.randn(classes, generator=gen).cuda().requires_grad_()
    target = torch.randint(0, classes, (rows,), generator=gen).cuda()
    target[[1, 5]] = IGNORE_INDEX
    return hidden, weight, bias, target


@pytest.mark.gpu
def test_cuda_portable_path_equals_the_cpu_in_float64():
    hidden, weight, bias, target = (t.double() if t.is_floating_point() else t
                                    for t in _cuda_case())  # fmt: skip
    results = []
    for device in ("cuda", "cpu"):
        inputs = [t.detach().to(device).requires_grad_() for t in (hidden, weight, bias)]
        out = linear_cross_entropy(*inputs, target.to(device), label_smoothing=0.1,
                                   options=LossOptions(columns=128, saved_bytes=0))  # fmt: skip
        grads = torch.autograd.grad(out.loss(0.1).sum(), inputs)
        results.append([t.cpu() for t in (out.nll, out.smoothing, *grads)])
    for a, c in zip(*results, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cce", "liger"])
def test_cuda_external_backends_match_the_portable_path(backend):
    """CCE and Liger (optional packages) under bf16 autocast: per-row NLL, smoothing and every
    gradient, with a non-uniform incoming gradient per row, close to the portable path's."""
    pytest.importorskip({"cce": "cut_cross_entropy", "liger": "liger_kernel"}[backend])
    hidden, weight, bias, target = _cuda_case()
    weights = torch.rand(hidden.size(0), device="cuda") + 0.5
    results = []
    for name in ("torch", backend):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = linear_cross_entropy(hidden, weight, bias, target, label_smoothing=0.1,
                                       options=LossOptions(backend=name))  # fmt: skip
        grads = torch.autograd.grad((out.loss(0.1) * weights).sum(), (hidden, weight, bias))
        results.append([out.nll, out.smoothing, *grads])
    for a, c in zip(*results, strict=True):  # bf16 error relative to each tensor's scale
        scale = float(a.detach().abs().max())
        torch.testing.assert_close(c.float(), a.float(), rtol=3e-2, atol=2e-2 * scale)


def test_plain_nll_equals_the_formula_in_float64_and_keeps_float32_under_bf16():
    """One product and PyTorch's fused kernels: the NLL and every gradient of the formula,
    0 on ignored rows; under bf16 autocast the NLL comes out in float32."""
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (7,), generator=gen)
    target[[1, 5]] = IGNORE_INDEX
    scale = torch.linspace(0.5, 1.5, 7, dtype=torch.float64)
    got = plain_nll(hidden, weight, bias, target)
    log_probs = torch.log_softmax(hidden @ weight.T + bias, -1)
    want = torch.where(target >= 0, -log_probs.gather(1, target.clamp_min(0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(got, want)
    inputs = (hidden, weight, bias)
    for g, w in zip(torch.autograd.grad((got * scale).sum(), inputs),
                    torch.autograd.grad((want * scale).sum(), inputs), strict=True):  # fmt: skip
        torch.testing.assert_close(g, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = plain_nll(hidden.float(), weight.float(), bias.float(), target)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low.double(), want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
def test_a_large_plain_product_on_gpu_plans_runs_on_aligned_columns(with_bias, monkeypatch):
    """On the GPU plans' devices a plain product of V = 37 columns (large enough: here any)
    runs on 64 (rows_ce.padded_columns), the extra columns' logits -inf: the NLL, the V
    log-probabilities (with label smoothing's mean over them) and every gradient equal the
    unpadded formula's in float64; under bf16 autocast they stay finite and close."""
    products = []
    linear = F.linear

    def spy(hidden, weight, bias=None):
        products.append(weight.size(0))
        return linear(hidden, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    monkeypatch.setattr(chunks, "GPU_PLAN_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(fce, "PLAIN_ALIGN_FLOPS", 0)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(37, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(37, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = bias if with_bias else None
    target = torch.randint(0, 37, (9,), generator=gen)
    target[2] = IGNORE_INDEX
    inputs = [x for x in (hidden, weight, bias) if x is not None]
    nll, log_probs = fce.plain_log_probs(hidden, weight, bias, target)
    assert products == [64] and log_probs.shape == (9, 37)
    want_log_probs = torch.log_softmax(F.linear(hidden, weight, bias), -1)
    want = torch.where(target >= 0, -want_log_probs.gather(1, target.clamp_min(0)[:, None])[:, 0],
                       0.0)  # fmt: skip
    torch.testing.assert_close(log_probs, want_log_probs)
    torch.testing.assert_close(nll, want)
    got_loss = nll.sum() - 0.1 * log_probs.mean(1).sum()
    want_loss = want.sum() - 0.1 * want_log_probs.mean(1).sum()
    for g, w in zip(torch.autograd.grad(got_loss, inputs), torch.autograd.grad(want_loss, inputs),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(g, w)
    floats = [x.detach().float().requires_grad_() for x in inputs]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low, _ = fce.plain_log_probs(*floats, *([] if with_bias else [None]), target)
    low.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in floats)
    torch.testing.assert_close(low.double(), want, rtol=0.05, atol=0.05)


def test_plain_products_are_padded_only_where_they_count():
    """Aligned already, on a CPU's own plans, or fewer FLOPs than PLAIN_ALIGN_FLOPS (a
    launch-bound step, where the padding's operators cost more than they save): unchanged."""
    weight, bias = torch.randn(37, 6), torch.randn(37)
    rows = fce.PLAIN_ALIGN_FLOPS // (2 * 6 * 37)
    big, small = torch.empty(rows + 1, 6), torch.empty(rows - 1, 6)
    assert fce.aligned_columns(big, weight, bias)[0] is weight  # this CPU's plans
    chunks.GPU_PLAN_DEVICES.add("cpu")
    try:
        assert fce.aligned_columns(big, weight, bias)[0].shape == (64, 6)
        assert fce.aligned_columns(small, weight, bias)[0] is weight
        aligned = torch.randn(40, 6)  # 16-byte rows of half-precision logits already
        assert fce.aligned_columns(big, aligned, None)[0] is aligned
    finally:
        chunks.GPU_PLAN_DEVICES.discard("cpu")


def test_plain_runs_on_cuda_where_the_logits_fit_the_saved_budget():
    """``auto``: plain on CUDA up to ``saved_bytes`` of float32 logits, never on a CPU (the
    hand-written plan is faster there); ``plain`` forces it; other plans and backends never."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    budget = LossOptions(saved_bytes=4 * 100 * 50)
    assert plain_loss_fits(budget, cuda, 100, 50)
    assert not plain_loss_fits(budget, cuda, 101, 50)
    assert not plain_loss_fits(budget, cpu, 100, 50)
    assert plain_loss_fits(LossOptions(plan="plain"), cpu, 10**6, 10**6)
    # the measured rows plan (MEASURED_FASTEST, for large steps) leaves a small step plain
    rows = LossOptions(plan="rows", saved_bytes=4 * 100 * 50)
    assert plain_loss_fits(rows, cuda, 100, 50) and not plain_loss_fits(rows, cuda, 101, 50)
    for options in (LossOptions(plan="compiled"), LossOptions(plan="eager"),
                    LossOptions(backend="liger")):  # fmt: skip
        assert not plain_loss_fits(options, cuda, 1, 1)


def test_on_a_cpu_only_a_small_classifier_runs_plainly():
    """A CPU under ``auto``: an adaptive softmax's classifier (``classifier=True``) of at most
    ``CPU_PLAIN_LOGITS`` logits within the saved budget runs plainly (the hand-written loop's
    fixed cost outweighs it); a larger one, a single softmax's loss, an explicit plan, or no
    budget keep the hand-written plan."""
    cpu = torch.device("cpu")
    rows, columns = 1024, CPU_PLAIN_LOGITS // 1024
    ample = LossOptions(saved_bytes=64 * CPU_PLAIN_LOGITS)
    assert plain_loss_fits(ample, cpu, rows, columns, classifier=True)
    assert not plain_loss_fits(ample, cpu, rows + 1, columns, classifier=True)
    assert not plain_loss_fits(ample, cpu, rows, columns)  # a softmax: the loop
    for plan in ("eager", "rows", "compiled"):
        options = LossOptions(plan=plan, saved_bytes=64 * CPU_PLAIN_LOGITS)
        assert not plain_loss_fits(options, cpu, 1, 1, classifier=True)
    assert not plain_loss_fits(LossOptions(saved_bytes=4 * 99 * 50), cpu, 100, 50, classifier=True)


def test_plan_rows_runs_a_large_classifier_by_rows_and_a_small_one_plainly():
    """An adaptive softmax's classifier (``classifier=True``) under ``rows`` on CUDA: plainly up
    to ``ROWS_PLAIN_LOGITS`` logits (launch-bound) within the saved budget, by the rows plan
    beyond, however large the budget; ``auto`` and a softmax's (or Mixtape's) ``rows``, which
    is its auto on CUDA, keep the saved budget alone; ``plain`` is always plain."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    rows, columns = 1024, ROWS_PLAIN_LOGITS // 1024
    ample = LossOptions(plan="rows", saved_bytes=64 * ROWS_PLAIN_LOGITS)
    assert plain_loss_fits(ample, cuda, rows, columns, classifier=True)
    assert not plain_loss_fits(ample, cuda, rows + 1, columns, classifier=True)
    assert not plain_loss_fits(ample, cpu, rows, columns, classifier=True)  # CPU: no rows rule
    assert plain_loss_fits(ample, cuda, rows + 1, columns)  # a softmax's rows: the budget
    # the budget still bounds the plain classifier's memory
    tight = LossOptions(plan="rows", saved_bytes=4 * 100 * 50)
    assert plain_loss_fits(tight, cuda, 100, 50, classifier=True)
    assert not plain_loss_fits(tight, cuda, 101, 50, classifier=True)
    auto = LossOptions(saved_bytes=64 * ROWS_PLAIN_LOGITS)  # auto: unchanged
    assert plain_loss_fits(auto, cuda, rows + 1, columns, classifier=True)
    plain = LossOptions(plan="plain", saved_bytes=0)
    assert plain_loss_fits(plain, cuda, rows + 1, columns, classifier=True)
