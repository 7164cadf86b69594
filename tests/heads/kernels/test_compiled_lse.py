"""The GPU plan of the fused loss (heads/kernels/compiled_lse.py): float64 equality with the
eager plan at chunk, padding and tile edges; the chunk plan planned for a stated device
memory; and on CUDA, bf16 against float64 and the field's kernels against our plan."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import heads.kernels.compiled_lse as compiled_lse
from heads.fused_cross_entropy import (
    IGNORE_INDEX,
    MEASURED_FASTEST,
    LossOptions,
    linear_cross_entropy,
    linear_lse,
    plan_tiles,
    spans,
)
from tests.heads.kernels.cases import float64_case

pytestmark = pytest.mark.usefixtures("one_thread")

# columns 5 and 23 over V = 23: padded last chunk / one chunk; rows 4: row tiles
LAYOUTS = {
    "padded": {"columns": 5},
    "padded_tiles": {"columns": 5, "rows": 4},
    "one_chunk": {"columns": 23},
}


@pytest.fixture
def quick_compile(monkeypatch):
    """The plan's logic through torch.compile's aot_eager backend (seconds, not a minute of
    Inductor code generation per shape); one test below keeps Inductor."""
    monkeypatch.setattr(compiled_lse, "COMPILE_BACKEND", "aot_eager")
    yield
    torch._dynamo.reset()


def _loss_and_grads(options, hidden, weight, b, target, eps=0.1):
    inputs = [t for t in (hidden, weight, b) if t is not None]
    out = linear_cross_entropy(hidden, weight, b, target, label_smoothing=eps, options=options)
    scale = torch.linspace(0.5, 1.5, hidden.size(0), dtype=hidden.dtype, device=hidden.device)
    grads = torch.autograd.grad((out.loss(eps) * scale).sum(), inputs)
    return [out.nll, out.smoothing, *grads]


@pytest.mark.usefixtures("quick_compile")
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [11, 1, 0])
def test_compiled_plan_equals_the_eager_one_in_float64(layout, bias, rows):
    case = float64_case(rows=rows, bias=bias)
    got = _loss_and_grads(LossOptions(plan="compiled", **layout), *case)
    want = _loss_and_grads(LossOptions(plan="eager", saved_bytes=0), *case)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("quick_compile")
def test_targets_outside_the_block_never_pick_a_padding_column():
    """V = 11 padded to 15: a target of 12 (another block's) must not read padding."""
    hidden, weight, b, _ = float64_case(rows=4, classes=11, seed=3)
    target = torch.tensor([12, 3, -1, 14])
    out = linear_lse(hidden, weight, b, target, options=LossOptions(plan="compiled", columns=5))
    logits = F.linear(hidden, weight, b)
    torch.testing.assert_close(out.lse, torch.logsumexp(logits, -1))
    want = torch.zeros(4, dtype=logits.dtype)
    want[1] = logits[1, 3]
    torch.testing.assert_close(out.target_logit, want)


@pytest.mark.usefixtures("quick_compile")
def test_minus_inf_chunks_are_finite():
    hidden, weight, b, target = float64_case(seed=5)
    with torch.no_grad():
        b[:10] = -torch.inf
    target = torch.randint(10, 23, (11,), generator=torch.Generator().manual_seed(2))
    got = _loss_and_grads(LossOptions(plan="compiled", columns=5), hidden, weight, b, target, 0)
    want = _loss_and_grads(LossOptions(plan="eager"), hidden, weight, b, target, 0)
    for g, w in zip(got[::2] + got[3:], want[::2] + want[3:], strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("bias", [True, False])
def test_inductor_chunk_bodies_equal_the_eager_plan(bias):
    """The real compiler (Inductor's C++ code on a CPU, Triton on a GPU) in float64, both
    backward bodies (the bias gradient folded into dW's product, and none)."""
    case = float64_case(rows=9, seed=4, bias=bias)
    got = _loss_and_grads(LossOptions(plan="compiled", columns=8), *case)
    want = _loss_and_grads(LossOptions(plan="eager"), *case)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()


def test_one_compiled_body_serves_every_chunk(quick_compile):
    """Equal padded chunks: one graph for the forward body and one for each backward body
    (with a bias gradient and without), however many chunks; no recompilation per chunk."""
    from torch._dynamo.utils import counters

    counters.clear()
    hidden, weight, b, target = float64_case(rows=12, classes=100, seed=6)  # 12 rows, 16 columns:
    _loss_and_grads(LossOptions(plan="compiled", columns=16), hidden, weight, b, target)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    # (equal sizes would be "duck-sized" into one symbol, and a later call would recompile)
    # other row counts, chunk widths, and inputs that need no gradient: the same two graphs
    # (each head, cluster and expert has its own shapes; recompiling per shape ran into
    # Dynamo's recompile limit on a GPU and fell back to eager)
    hidden, weight, b, target = float64_case(rows=9, classes=60, seed=7)
    _loss_and_grads(LossOptions(plan="compiled", columns=24), hidden, weight, b, target)
    # no bias gradient: the backward body without the fold, once for every shape
    frozen = weight.detach()
    out = linear_lse(hidden, frozen, None, target, options=LossOptions(plan="compiled"))
    torch.autograd.grad(out.lse.sum(), hidden)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])
    hidden, weight, _, target = float64_case(rows=12, classes=100, seed=6)
    _loss_and_grads(LossOptions(plan="compiled", columns=16), hidden, weight, None, target)
    assert counters["stats"]["unique_graphs"] == 3, dict(counters["stats"])


class _Ops(TorchDispatchMode):
    """The ATen calls under it, and each product's output shape."""

    def __init__(self):
        super().__init__()
        self.calls, self.products = Counter(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls[func.overloadpacket] += 1
        if func.overloadpacket is torch.ops.aten.mm:
            self.products.append(tuple(out.shape))
        return out


@pytest.mark.parametrize("bias", [True, False])
def test_the_bias_gradient_comes_out_of_the_weight_gradient_product(monkeypatch, bias):
    """A backward chunk is three products (the recomputed logits, ``dz W``, ``dz^T h``) and no
    column sum over ``dz``: with a bias, ``dz^T [h | 1 | 0]`` (8 columns for d = 6) gives
    ``[dW | db | 0]``; with none, nothing forms ``db``. The bodies run as plain functions
    under an op counter; the gradients are still the eager plan's."""
    backward = []

    def counted(name):
        def body(*args):
            with _Ops() as ops:
                out = compiled_lse.BODIES[name](*args)
            if name.startswith("backward"):
                backward.append(ops)
            return out

        return body

    monkeypatch.setattr(compiled_lse, "chunk_body", counted)
    hidden, weight, b, target = float64_case(rows=11, bias=bias)
    inputs = [t for t in (hidden, weight, b) if t is not None]
    results = []
    for options in (LossOptions(plan="compiled", **LAYOUTS["padded_tiles"]), LossOptions()):
        out = linear_lse(hidden, weight, b, target, options=options)
        results.append(torch.autograd.grad(out.lse.sum() - out.target_logit.sum(), inputs))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)
    assert len(backward) == 3 * 5  # row tiles of 4, 4 and 3; 5 chunks of 5 columns
    for ops in backward:
        assert ops.calls[torch.ops.aten.mm] == 3 and torch.ops.aten.sum not in ops.calls
        assert ops.products[-1] == (5, 8 if bias else 6), ops.products


# -- the CUDA chunk plan, checked on a CPU by stating the device's memory ----------------------
H100 = 80 << 30
N, D = 16_384, 512


def _chunk_iterations(rows: int, columns: int, entries: int = 1) -> int:
    options = LossOptions(device_memory=H100)
    tile, width = plan_tiles(rows, columns, torch.device("cuda"), options, entries)
    return len(spans(rows, tile)) * len(spans(columns, width))


def test_a_training_step_at_100k_runs_at_most_64_chunk_iterations_per_head():
    """V = 100k, 16,384 tokens, d = 512, planned for an 80 GiB GPU (issue 28's bound)."""
    v = 100_000
    counts = {
        "softmax": _chunk_iterations(N, v),
        "mos15": _chunk_iterations(15 * N, v),  # K N component rows
        # frequent block (S = V/10, 2K floats a column) + the shared-gate tail
        "mixtape": _chunk_iterations(N, v // 10, 2 * 4) + _chunk_iterations(N, v - v // 10),
        # head (shortlist + cluster tokens), then tail clusters on their own rows
        "adaptive": sum(
            _chunk_iterations(rows, c)
            for rows, c in ((N, 20_002), (N // 5, 20_000), (N // 20, 60_000))
        ),  # fmt: skip
        "ds64": 64 * _chunk_iterations(N // 64, v // 8),  # an expert's tokens and classes
    }
    assert all(count <= 64 for name, count in counts.items() if name != "ds64"), counts
    assert counts["ds64"] == 64, counts  # one chunk per expert


# -- on CUDA ---------------------------------------------------------------------------------
def _cuda_case(rows=512, classes=5000, dim=64, seed=9):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, dim, generator=gen).cuda().requires_grad_()
    weight = (dim**-0.5 * torch.randn(classes, dim, generator=gen)).cuda().requires_grad_()
    bias = torch.randn(classes, generator=gen).cuda().requires_grad_()
    target = torch.randint(0, classes, (rows,), generator=gen).cuda()
    target[[1, 5]] = IGNORE_INDEX
    return hidden, weight, bias, target


def _double(tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "cce", "liger"])
def test_cuda_bf16_backends_against_float64(backend):
    """Each backend under bf16 autocast against the float64 maths: NLL, smoothing and every
    gradient, with bias, ignored rows, label smoothing and a non-uniform incoming gradient.
    Within bf16's error relative to each tensor's scale (CCE also drops gradient entries
    below 2^-12 by design: its ``filter_eps``)."""
    if backend != "torch":
        pytest.importorskip({"cce": "cut_cross_entropy", "liger": "liger_kernel"}[backend])
    hidden, weight, bias, target = _cuda_case()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = _loss_and_grads(LossOptions(backend=backend), hidden, weight, bias, target)
    want = _loss_and_grads(LossOptions(plan="eager"), *_double((hidden, weight, bias)), target)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(
            g.double(), w, rtol=3e-2, atol=2e-2 * float(w.detach().abs().max())
        )


@pytest.mark.gpu
def test_cuda_compiled_plan_is_sync_free_and_exact_in_float64():
    hidden, weight, bias, target = _double(_cuda_case(rows=256, classes=3000))[:3] + [
        _cuda_case(rows=256, classes=3000)[3]
    ]
    options = LossOptions(plan="compiled", columns=512)
    _loss_and_grads(options, hidden, weight, bias, target)  # compile outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _loss_and_grads(options, hidden, weight, bias, target)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = _loss_and_grads(LossOptions(plan="eager"), hidden, weight, bias, target)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("quick_compile")
@pytest.mark.parametrize("bias", [True, False])
def test_mos_label_smoothing_term_compiled_equals_eager(bias):
    """MoS's ``sum_x log P(x|c)`` (label smoothing) through compiled chunk bodies, the last
    chunk narrower, in float64: value and every gradient."""
    from heads.mos import mixture_log_prob_sum

    gen = torch.Generator().manual_seed(7)
    contexts = torch.randn(5, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(23, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(23, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    shift = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    inputs = [t for t in (contexts, weight, b, shift) if t is not None]
    results = []
    for plan in ("compiled", "eager"):
        total = mixture_log_prob_sum(contexts, weight, b, shift, LossOptions(plan=plan, columns=5))
        scale = torch.linspace(0.5, 1.5, 5, dtype=torch.float64)
        results.append([total, *torch.autograd.grad((total * scale).sum(), inputs)])
    logits = torch.einsum("nkd,vd->nkv", contexts, weight) + (0 if b is None else b)
    plain = torch.logsumexp(logits + shift[..., None], dim=1).sum(1)
    torch.testing.assert_close(results[0][0], plain)
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)


def test_auto_backend_follows_the_measured_table_where_installed(monkeypatch):
    import heads.fused_cross_entropy as fce

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(fce, "MEASURED_FASTEST", {"MoSHead": [(10_000, "liger")]})
    assert fce.fastest_backend("MoSHead", 10_000, cpu) == "torch"  # CPU: always ours
    assert fce.fastest_backend("MoSHead", 50_000, cuda) == "torch"  # not measured there
    assert fce.fastest_backend("SoftmaxHead", 10_000, cuda) == "torch"
    monkeypatch.setattr(fce, "external_loss_function", lambda name: None)  # installed
    assert fce.fastest_backend("MoSHead", 10_000, cuda) == "liger"

    def missing(name):
        raise fce.MissingBackendError(name)

    monkeypatch.setattr(fce, "external_loss_function", missing)
    assert fce.fastest_backend("MoSHead", 10_000, cuda) == "torch"


@pytest.mark.parametrize("head", sorted(MEASURED_FASTEST))
def test_every_choice_of_the_shipped_table_resolves_on_cuda(head):
    """Each size the shipped table measured resolves to a choice the options take (the
    adaptive softmax's ``torch`` at 10k once failed every CUDA fit of it: a KeyError, the
    choice looked up among the external packages)."""
    import heads.fused_cross_entropy as fce

    for largest, choice in fce.MEASURED_FASTEST[head]:
        got = fce.fastest_backend(head, largest, torch.device("cuda"))
        assert got in (choice, "torch")  # an external package not installed: torch
        fce.check_loss_choice(got)
        fce.measured_options(fce.LossOptions(), got)


def test_fused_is_the_rows_plan_with_the_fused_products(monkeypatch):
    """``fused`` (a task's ``loss_backend``, a benchmark subject's ``@fused``, a measured
    table's choice) runs ``rows`` with ``fused_products``; any other choice clears them."""
    import heads.fused_cross_entropy as fce

    fce.check_loss_choice("fused")
    fused = fce.measured_options(fce.LossOptions(saved_bytes=5), "fused")
    assert (fused.backend, fused.plan, fused.fused_products, fused.saved_bytes) == (
        "torch", "rows", True, 5)  # fmt: skip
    for choice in ("rows", "plain", "liger"):
        assert not fce.measured_options(fused, choice).fused_products
    monkeypatch.setattr(fce, "MEASURED_FASTEST", {"SoftmaxHead": [(100_000, "fused")]})
    assert fce.fastest_backend("SoftmaxHead", 50_000, torch.device("cuda")) == "fused"


def test_a_compiled_model_traces_the_plan_into_one_graph():
    """Under ``model.compile`` (Dynamo tracing the head) the chunk bodies are inlined: one
    graph, no breaks, the eager plan's values and gradients."""
    import torch._dynamo

    hidden, weight, b, target = float64_case(rows=12, classes=40, seed=8)
    options = LossOptions(plan="compiled", columns=16)

    def loss(h, w, bb, t):
        return linear_cross_entropy(h, w, bb, t, label_smoothing=0.1, options=options).loss(0.1)

    explained = torch._dynamo.explain(loss)(hidden, weight, b, target)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(hidden, weight, b, target).sum(), (hidden, weight, b))
    eager = LossOptions(plan="eager")
    plain = linear_cross_entropy(hidden, weight, b, target, label_smoothing=0.1, options=eager)
    want = torch.autograd.grad(plain.loss(0.1).sum(), (hidden, weight, b))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_checkpoint_plan_equals_the_eager_one_in_float64(layout):
    """The yardstick plan (plain maths per chunk under torch.utils.checkpoint)."""
    case = float64_case(rows=11)
    got = _loss_and_grads(LossOptions(plan="checkpoint", **layout), *case)
    want = _loss_and_grads(LossOptions(plan="eager"), *case)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("dim", [5, 8, 16])
def test_with_ones_is_h_then_a_one_then_zeros(dtype, dim):
    """``[h | 1 | 0]`` in ``dtype``, ``joint_width`` columns, eagerly (one concatenation) and
    traced (the three writes a compiled graph fuses), the same."""
    hidden = torch.randn(7, dim, dtype=torch.float64)
    want = torch.zeros(7, compiled_lse.joint_width(dim), dtype=dtype)
    want[:, :dim], want[:, dim] = hidden.to(dtype), 1
    assert torch.equal(compiled_lse.with_ones(hidden, dtype), want)
    compiled = torch.compile(compiled_lse.with_ones, backend="eager", fullgraph=True)
    assert torch.equal(compiled(hidden, dtype), want)
    assert compiled_lse.with_ones(hidden[:0], dtype).shape == (0, want.size(1))
