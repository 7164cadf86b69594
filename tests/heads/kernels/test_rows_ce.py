"""The rows plan of a single softmax's mean loss (heads/kernels/rows_ce.py): float64 equality
with the plain maths for the loss, the NLL and every gradient, whichever outputs are
differentiated; three products, not four; both tile bodies; the tile planning."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import heads.kernels.compiled_lse as compiled_lse
import heads.kernels.rows_ce as rows_ce
from heads.fused_cross_entropy import (
    IGNORE_INDEX,
    LossOptions,
    mean_cross_entropy,
    mean_loss_plan,
    mean_weights,
    row_tile,
    spans,
)
from tests.heads.kernels.cases import float64_case

pytestmark = pytest.mark.usefixtures("one_thread")

TILES = {"one_tile": None, "tiles_of_4": 4, "tiles_of_1": 1}
# what is differentiated: the loss (training), the NLL (another use), or both
USES = {
    "loss": lambda loss, nll, scale: 1.7 * loss,
    "nll": lambda loss, nll, scale: (scale * nll).sum(),
    "both": lambda loss, nll, scale: 1.7 * loss + (scale * nll).sum(),
}


def _rows(use, hidden, weight, b, target, eps, options=None):
    """``[loss, nll, grads...]`` of the rows plan."""
    inputs = [t for t in (hidden, weight, b) if t is not None]
    scale = torch.linspace(0.5, 1.5, hidden.size(0), dtype=hidden.dtype, device=hidden.device)
    out = mean_cross_entropy(hidden, weight, b, target, label_smoothing=eps,
                             options=options or LossOptions(plan="rows"))  # fmt: skip
    return [out.loss, out.nll, *torch.autograd.grad(use(out.loss, out.nll, scale), inputs)]


def _plain(use, hidden, weight, b, target, eps):
    """The same from ``F.cross_entropy`` (the plain maths)."""
    inputs = [t for t in (hidden, weight, b) if t is not None]
    scale = torch.linspace(0.5, 1.5, hidden.size(0), dtype=hidden.dtype, device=hidden.device)
    logits = F.linear(hidden, weight, b)
    loss = F.cross_entropy(logits, target, label_smoothing=eps)
    nll = F.cross_entropy(logits, target, reduction="none")
    return [loss, nll, *torch.autograd.grad(use(loss, nll, scale), inputs)]


def _results(use, hidden, weight, b, target, eps, options=None):
    """``(rows plan, plain maths)``."""
    case = hidden, weight, b, target, eps
    return _rows(use, *case, options), _plain(use, *case)


@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
@pytest.mark.parametrize("tile", TILES.values(), ids=TILES.keys())
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
def test_rows_plan_equals_the_plain_maths_in_float64(use, tile, eps, bias):
    case = float64_case(bias=bias)
    got, want = _results(use, *case, eps, LossOptions(plan="rows", rows=tile))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_no_rows_and_all_ignored_rows_give_zero_loss_and_gradients():
    for rows in (0, 5):
        hidden, weight, b, target = float64_case(rows=rows)
        target[:] = IGNORE_INDEX
        out = mean_cross_entropy(hidden, weight, b, target, options=LossOptions(plan="rows"))
        grads = torch.autograd.grad(out.loss, (hidden, weight, b))
        assert out.loss.item() == 0 and not out.nll.any()
        assert all(not g.any() for g in grads)


def test_the_loss_runs_three_products_the_column_plan_four():
    """The gradient in the forward: no recomputed logits (the column plans' fourth product)."""
    hidden, weight, b, target = float64_case(rows=64, classes=500, dim=16)
    product = 2 * 64 * 500 * 16

    def flops(plan: str) -> int:
        with FlopCounterMode(display=False) as counter:
            if plan == "rows":
                options = LossOptions(plan="rows")
                loss = mean_cross_entropy(hidden, weight, None, target, options=options).loss
            else:  # the column plan, recomputing (nothing kept for the backward)
                from heads.fused_cross_entropy import linear_cross_entropy

                options = LossOptions(plan="eager", saved_bytes=0)
                loss = linear_cross_entropy(hidden, weight, None, target, options=options).nll
                loss = loss.sum()
            loss.backward()
        return counter.get_total_flops()

    assert flops("rows") == 3 * product
    assert flops("eager") == 4 * product


def test_a_frozen_output_layer_and_no_grad_form_no_gradient():
    """Evaluation (no_grad) and frozen inputs: only what is asked for is formed."""
    hidden, weight, b, target = float64_case()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = mean_cross_entropy(hidden, weight, b, target, options=LossOptions(plan="rows"))
    assert counter.get_total_flops() == 2 * 11 * 23 * 6  # the logits' product only
    logits = F.linear(hidden, weight, b)
    torch.testing.assert_close(out.loss, F.cross_entropy(logits, target))
    frozen = mean_cross_entropy(hidden, weight.detach(), None, target,
                                options=LossOptions(plan="rows"))  # fmt: skip
    (grad,) = torch.autograd.grad(frozen.loss, hidden)
    want = torch.autograd.grad(F.cross_entropy(F.linear(hidden, weight), target), hidden)[0]
    torch.testing.assert_close(grad, want)


@pytest.fixture
def compiled_tiles(monkeypatch):
    """The GPU tile body on a CPU, through torch.compile's aot_eager backend."""
    monkeypatch.setattr(rows_ce, "COMPILED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(compiled_lse, "COMPILE_BACKEND", "aot_eager")
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("compiled_tiles")
@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
@pytest.mark.parametrize("tile", [None, 4], ids=["one_tile", "tiles_of_4"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_compiled_tile_body_equals_the_plain_maths_in_float64(use, tile, eps):
    got, want = _results(use, *float64_case(seed=3), eps, LossOptions(plan="rows", rows=tile))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("compiled_tiles")
def test_compiled_tile_bodies_do_not_recompile_per_shape():
    """Tiles of any row count, vocabularies of any size: the graphs compiled for the first
    calls serve the next ones (a recompilation per shape runs into Dynamo's limit on a GPU
    and falls back to eager)."""
    from torch._dynamo.utils import counters

    def step(rows, classes, tile):
        hidden, weight, b, target = float64_case(rows=rows, classes=classes, seed=rows)
        out = mean_cross_entropy(hidden, weight, b, target,
                                 options=LossOptions(plan="rows", rows=tile))  # fmt: skip
        torch.autograd.grad(out.loss, (hidden, weight, b))

    counters.clear()
    step(12, 100, 5)  # tiles of 5, 5 and 2 rows
    step(9, 60, 4)  # (a second call generalises the sizes the first one specialised)
    graphs = counters["stats"]["unique_graphs"]
    for rows, classes, tile in ((30, 60, None), (17, 333, 7), (40, 1000, 16)):
        step(rows, classes, tile)
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])


def test_compiled_tile_body_under_inductor(monkeypatch):
    """The real compiler (C++ on a CPU, Triton on a GPU) in float64, bias and smoothing."""
    monkeypatch.setattr(rows_ce, "COMPILED_DEVICES", ("cuda", "cpu"))
    got, want = _results(USES["loss"], *float64_case(seed=4), 0.1, LossOptions(plan="rows", rows=4))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()


def test_a_compiled_tile_holds_its_logits_and_dz_in_the_products_dtype_only():
    """A GPU tile's memory: the product's ``[rows, V]`` logits and ``dz``, both in the
    products' dtype; the log-sum-exp's exponentials stay inside its reduction (no float32
    ``[rows, V]`` buffer: half the tile's memory, a third of its traffic). Read off Inductor's
    generated code (C++ here: the buffers it allocates are planned before the backend's
    kernels)."""
    import re

    from torch._inductor.utils import run_and_get_code

    rows, v, d = 64, 1000, 32
    h, w = torch.randn(rows, d).bfloat16(), torch.randn(v, d).bfloat16()
    target, row_weight = torch.randint(0, v, (rows,)), torch.full((rows,), 1 / rows)
    compiled = torch.compile(rows_ce.compiled_forward_tile, dynamic=True)
    _, code = run_and_get_code(compiled, h, w, torch.zeros(v), target, rows_ce.Mixing(),
                               row_weight, 0.0, True)  # fmt: skip
    torch._dynamo.reset()
    buffers = re.findall(r"empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)",
                         "\n".join(code))  # fmt: skip
    matrices = [dtype for shape, dtype in buffers if len(shape.strip(", ").split(",")) == 2]
    assert matrices == ["bfloat16", "bfloat16"], buffers


def test_bf16_autocast_is_close_to_float64():
    hidden, weight, b, target = float64_case(rows=64, classes=300, dim=32, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _rows(USES["loss"], hidden, weight, b, target, 0.1)
    want = _plain(USES["loss"], hidden, weight, b, target, 0.1)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype  # gradients in the inputs' dtype, statistics in float32+
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * float(w.detach().abs().max()))


def test_auto_runs_rows_on_a_cpu_where_the_column_plan_would_recompute():
    """Rows where the column plan cannot keep its chunks (``saved_bytes``), the column plan
    where it keeps them all, under torch.compile and on CUDA (until measured there)."""
    cpu = torch.zeros(700, 1)
    budget = LossOptions(saved_bytes=4 * 700 * 10_000)
    assert mean_loss_plan(budget, cpu, 10_000) == "eager"  # all kept: three products already
    assert mean_loss_plan(budget, cpu, 10_001) == "rows"
    assert mean_loss_plan(LossOptions(saved_bytes=0), cpu, 10) == "rows"
    assert mean_loss_plan(LossOptions(plan="eager", saved_bytes=0), cpu, 10) == "eager"
    assert mean_loss_plan(LossOptions(plan="rows"), cpu, 10) == "rows"
    seen = []
    torch.compile(lambda x: seen.append(mean_loss_plan(LossOptions(saved_bytes=0), x, 10)) or x,
                  backend="eager")(cpu)  # fmt: skip
    assert seen == ["eager"]
    torch._dynamo.reset()


def test_row_tiles_are_planned_from_the_vocabulary():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert row_tile(700, 10_000, cpu, LossOptions()) == 512  # the dW product's inner size
    assert row_tile(100, 10_000, cpu, LossOptions()) == 100
    assert row_tile(4096, 262_144, cpu, LossOptions()) == 256  # 256 MiB of logits at most
    assert row_tile(4096, 1_000, cpu, LossOptions()) == 4096  # 16 MiB: every row
    h100 = LossOptions(device_memory=80 << 30)
    assert row_tile(16_384, 10_000, cuda, h100, 2) == 16_384  # one tile within 768 MiB
    # what the tile holds per logit: bf16 logits alone (Triton), logits and dz (compiled);
    # as few tiles as 768 MiB allows, evened out: 5 of 3,277 rows, not 4 of 4,026 and 280
    assert (768 << 20) // 200_000 == 4026
    assert row_tile(16_384, 100_000, cuda, h100, 2) == 3277 == math.ceil(16_384 / 5)
    assert row_tile(16_384, 100_000, cuda, h100, 4) == 1821  # 2,013 at most: 9 tiles
    assert row_tile(16_384, 100_000, cuda, LossOptions(device_memory=8 << 30), 2) == 2341
    # a mixture's K N rows: 3 GiB tiles (fewer passes of the dW accumulator), within 1/16,
    # of whole tokens (K rows each)
    mixture = {"mixture": True, "bytes_per_logit": 2, "unit": 15}
    assert (3 << 30) // 200_000 == 16_106  # 16 tiles of 1,024 tokens, not 15 of 1,073 and 289
    assert row_tile(15 * 16_384, 100_000, cuda, h100, **mixture) == 15 * 1024
    tile = row_tile(15 * 16_384, 100_000, cuda, LossOptions(device_memory=16 << 30), **mixture)
    assert (
        tile % 15 == 0
        and tile <= (1 << 30) // 200_000
        and math.ceil(16_384 / (tile // 15)) == (math.ceil(15 * 16_384 / ((1 << 30) // 200_000)))
    )  # as few tiles as the budget allows
    for rows, most in ((9, 4), (700, 512), (16_383, 1000), (5, 7)):  # even, and no more tiles
        even = row_tile(rows, 1, cuda, LossOptions(device_memory=64 * most))
        sizes = [stop - start for start, stop in spans(rows, even)]
        assert even <= most and len(sizes) == math.ceil(rows / most)
        assert max(sizes) - min(sizes) < len(sizes)
    assert row_tile(9, 10, cpu, LossOptions(rows=4)) == 4


def test_a_tile_is_planned_for_what_its_body_holds(monkeypatch):
    """Triton's tiles (where installed) hold their logits alone, the compiled ones logits and
    dz, in the products' dtype; a CPU's eager tiles a float32 buffer."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(rows_ce, "triton_available", lambda: True)
    assert rows_ce.tile_bytes_per_logit(cuda, torch.bfloat16) == 2
    assert rows_ce.tile_bytes_per_logit(cuda, torch.float32) == 4
    assert rows_ce.tile_bytes_per_logit(cuda, torch.float64) == 16  # compiled: no fp64 kernels
    monkeypatch.setattr(rows_ce, "triton_available", lambda: False)
    assert rows_ce.tile_bytes_per_logit(cuda, torch.bfloat16) == 4
    assert rows_ce.tile_bytes_per_logit(cpu, torch.bfloat16) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("body", ["triton", "compiled"])
def test_cuda_rows_plan_is_sync_free_and_close_to_float64_under_bf16(monkeypatch, body):
    """Both GPU tile bodies (Triton's kernels; compiled functions where Triton is missing):
    bf16 autocast within bf16's error of the float64 maths (loss, NLL, every gradient), and no
    host sync in the forward and backward."""
    if body == "compiled":
        monkeypatch.setattr(rows_ce, "TRITON_DEVICES", ())
    gen = torch.Generator().manual_seed(9)
    rows, classes, dim = 512, 5000, 64
    hidden = torch.randn(rows, dim, generator=gen).cuda().requires_grad_()
    weight = (dim**-0.5 * torch.randn(classes, dim, generator=gen)).cuda().requires_grad_()
    b = torch.randn(classes, generator=gen).cuda().requires_grad_()
    target = torch.randint(0, classes, (rows,), generator=gen).cuda()
    target[[1, 5]] = IGNORE_INDEX
    options = LossOptions(plan="rows", rows=200)  # three tiles, the last one narrower
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _rows(USES["loss"], hidden, weight, b, target, 0.1, options)  # compile first
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = _rows(USES["loss"], hidden, weight, b, target, 0.1, options)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    doubles = [t.detach().double().requires_grad_() for t in (hidden, weight, b)]
    want = _plain(USES["loss"], *doubles, target, 0.1)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(
            g.double(), w, rtol=3e-2, atol=2e-2 * float(w.detach().abs().max())
        )


# -- a mixture of softmaxes (MoS) ------------------------------------------------------------
def _mixture_case(tokens=7, k=3, classes=19, dim=5, seed=11):
    gen = torch.Generator().manual_seed(seed)
    contexts = torch.randn(tokens * k, dim, generator=gen, dtype=torch.float64,
                           requires_grad=True)  # fmt: skip
    weight = torch.randn(classes, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(classes, generator=gen, dtype=torch.float64, requires_grad=True)
    prior_logits = torch.randn(tokens, k, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, classes, (tokens,), generator=gen)
    target[[1, 4] if tokens > 4 else []] = IGNORE_INDEX
    return contexts, weight, b, prior_logits, target


def _mixture_plain(contexts, weight, b, log_prior, target):
    """``log P(t) = logsumexp_k(log pi_k + log_softmax(z_k)_t)`` from the full logits."""
    n, k = log_prior.shape
    log_p = torch.log_softmax(F.linear(contexts, weight, b).view(n, k, -1), -1)
    mixed = torch.logsumexp(log_prior[..., None] + log_p, 1)  # [N, V]
    keep = target != IGNORE_INDEX
    nll = torch.where(keep, -mixed.gather(1, target.clamp_min(0)[:, None])[:, 0], 0.0)
    return nll.sum() / keep.sum(), nll


def _mixture_results(use, options, case):
    """``(rows plan under options, plain maths)``: ``[loss, nll, grads...]`` of the mixture
    of ``case`` (:func:`_mixture_case`'s), its outputs used as ``use`` uses them."""
    contexts, weight, b, prior_logits, target = case
    inputs = (contexts, weight, b, prior_logits)
    scale = torch.linspace(0.5, 1.5, target.size(0), dtype=torch.float64)
    out = mean_cross_entropy(contexts, weight, b, target, log_prior=prior_logits.log_softmax(-1),
                             options=options)  # fmt: skip
    got = [out.loss, out.nll, *torch.autograd.grad(use(out.loss, out.nll, scale), inputs)]
    loss, nll = _mixture_plain(contexts, weight, b, prior_logits.log_softmax(-1), target)
    want = [loss, nll, *torch.autograd.grad(use(loss, nll, scale), inputs)]
    return got, want


@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
@pytest.mark.parametrize("tile", [None, 6, 1], ids=["one_tile", "tiles_of_2_tokens", "row_1"])
def test_mixture_equals_the_plain_maths_in_float64(use, tile):
    got, want = _mixture_results(use, LossOptions(plan="rows", rows=tile), _mixture_case())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("compiled_tiles")
@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
def test_mixture_compiled_tile_bodies_equal_the_plain_maths_in_float64(use):
    case = _mixture_case(seed=12)
    got, want = _mixture_results(use, LossOptions(plan="rows", rows=6), case)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_mixture_runs_three_products_and_refuses_nothing_it_cannot_do():
    """Three ``[N K, V]`` products (the column plan: four); with label smoothing the rows
    plan steps aside (None: the head runs its column plan); a wrong row count is one line."""
    contexts, weight, b, prior_logits, target = _mixture_case(tokens=16, classes=300, dim=8)
    log_prior = prior_logits.log_softmax(-1).detach()
    options = LossOptions(plan="rows")
    with FlopCounterMode(display=False) as counter:
        out = mean_cross_entropy(contexts, weight, None, target, log_prior=log_prior,
                                 options=options)  # fmt: skip
        out.loss.backward()
    assert counter.get_total_flops() == 3 * 2 * (16 * 3) * 300 * 8
    smoothed = mean_cross_entropy(contexts, weight, b, target, log_prior=log_prior,
                                  label_smoothing=0.1, options=options)  # fmt: skip
    assert smoothed is None
    with pytest.raises(ValueError, match=r"\[N K, d\]"):
        mean_cross_entropy(contexts[:-1], weight, b, target, log_prior=log_prior, options=options)


# -- one block of a larger softmax (Mixtape's rare tokens) -----------------------------------
def _block_results(use, split, options, hidden, weight, b, target):
    """The rows plan over the columns ``[split, V)``, the rest's log-sum-exp and target logit
    taken in from the plain maths (differentiably), against ``F.cross_entropy`` over all."""
    scale = torch.linspace(0.5, 1.5, hidden.size(0), dtype=torch.float64)
    inputs = (hidden, weight, b)
    rest = F.linear(hidden, weight[:split], b[:split])
    in_rest = (target >= 0) & (target < split)
    rest_logit = torch.where(in_rest, rest.gather(1, target.clamp(0, split - 1)[:, None])[:, 0], 0)
    block_target = torch.where(target >= split, target - split, -1)
    out = mean_cross_entropy(hidden, weight[split:], b[split:], block_target,
                             outside=(torch.logsumexp(rest, 1), rest_logit),
                             weights=mean_weights(target != IGNORE_INDEX, hidden),
                             options=options)  # fmt: skip
    got = [out.loss, out.nll, *torch.autograd.grad(use(out.loss, out.nll, scale), inputs)]
    return got, _plain(use, hidden, weight, b, target, 0.0)


@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
@pytest.mark.parametrize("tile", [None, 4], ids=["one_tile", "tiles_of_4"])
def test_a_block_of_a_larger_softmax_equals_the_plain_maths_in_float64(use, tile):
    """Targets in either block and ignored rows; the loss over the whole vocabulary."""
    got, want = _block_results(use, 9, LossOptions(plan="rows", rows=tile), *float64_case())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.usefixtures("compiled_tiles")
@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
def test_a_block_through_the_compiled_tile_bodies_equals_the_plain_maths(use):
    got, want = _block_results(use, 9, LossOptions(plan="rows", rows=4), *float64_case(seed=2))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_each_form_traces_into_one_graph():
    """Under ``torch.compile`` (an explicit ``rows`` plan): no graph break in a softmax, a
    mixture or a block."""
    hidden, weight, b, target = float64_case()
    options = LossOptions(plan="rows", rows=4)
    prior = torch.randn(11, 1, dtype=torch.float64).log_softmax(-1)
    forms = {
        "softmax": lambda h: mean_cross_entropy(h, weight, b, target, options=options),
        "mixture": lambda h: mean_cross_entropy(
            h, weight, b, target, log_prior=prior, options=options
        ),  # fmt: skip
        "block": lambda h: mean_cross_entropy(
            h, weight, b, target, options=options, outside=(h.sum(1), h[:, 0])
        ),  # fmt: skip
    }
    for name, form in forms.items():
        explained = torch._dynamo.explain(lambda h, form=form: form(h).loss)(hidden)
        torch._dynamo.reset()
        assert explained.graph_count == 1 and explained.graph_break_count == 0, name


def test_the_bias_gradient_folded_into_the_weight_product_equals_its_sum():
    """The GPU tiles' ``dz^T [h | 1 | 0]`` gives ``[dW | db]``: the same as ``dz^T h`` and
    the column sums, over two tiles (the second adds)."""
    gen = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(9, 6, generator=gen), torch.randn(23, 6, generator=gen)
    bias, dz = torch.randn(23, generator=gen), torch.randn(9, 23, generator=gen)
    grads = [rows_ce.TileGradients(hidden, weight, bias, torch.float32, (True,) * 3, fold)
             for fold in (True, False)]  # fmt: skip
    assert grads[0].joint is not None and grads[0].joint.size(1) == 8
    for g in grads:
        for r0, r1 in ((0, 4), (4, 9)):
            g.add_tile(r0, r1, hidden[r0:r1], weight, dz[r0:r1], torch.float32)
    for folded, summed in zip((grads[0].h, grads[0].w, grads[0].b),
                              (grads[1].h, grads[1].w, grads[1].b), strict=True):  # fmt: skip
        torch.testing.assert_close(folded, summed)
    torch.testing.assert_close(grads[1].b, dz.sum(0))


def test_float16_products_keep_the_small_gradients():
    """Under float16 autocast the tiles' ``dz`` is formed per unit of 1 / count and scaled
    in the backward: ``p / count`` in float16 would fall into subnormals at 100k tokens
    (measured: 8e-3 relative error of dL/dh that way, 5e-4 this way)."""
    gen = torch.Generator().manual_seed(0)
    rows, classes, dim = 100_000, 50, 8
    hidden = torch.randn(rows, dim, generator=gen, requires_grad=True)
    weight = torch.randn(classes, dim, generator=gen, requires_grad=True)
    target = torch.randint(0, classes, (rows,), generator=gen)
    with torch.autocast("cpu", dtype=torch.float16):
        out = mean_cross_entropy(hidden, weight, None, target, options=LossOptions(plan="rows"))
    got = torch.autograd.grad(1024 * out.loss, (hidden, weight))  # a loss scale, as AMP's
    doubles = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    plain = F.cross_entropy(F.linear(*doubles), target)
    want = torch.autograd.grad(1024 * plain, doubles)
    for g, w in zip(got, want, strict=True):
        assert ((g.double() - w).norm() / w.norm()).item() < 2e-3


def test_the_stored_gradients_are_scaled_in_one_multi_tensor_product(monkeypatch):
    """The backward's scaling of the gradients formed in the forward: each one needed times
    the factor, None where not needed or missing, in one ``torch._foreach_mul`` call (one
    launch on CUDA, not one a gradient)."""
    calls = []
    foreach_mul = torch._foreach_mul

    def spy(tensors, factor):
        calls.append(len(tensors))
        return foreach_mul(tensors, factor)

    monkeypatch.setattr(torch, "_foreach_mul", spy)
    stored = [torch.ones(2, 3), None, torch.full((4,), 2.0), torch.ones(1)]
    factor = torch.tensor(0.5)
    scaled = rows_ce.scaled_gradients(stored, [True, True, True, False], factor)
    assert calls == [2] and scaled[1] is None and scaled[3] is None
    torch.testing.assert_close(scaled[0], torch.full((2, 3), 0.5))
    torch.testing.assert_close(scaled[2], torch.ones(4))
    assert rows_ce.scaled_gradients(stored, [True] * 4, None) == [None] * 4
    assert calls == [2]  # nothing to scale: no call


def test_row_weights_of_a_mean_are_ones_in_a_unit_of_one_over_the_count():
    keep = torch.tensor([True, False, True, True])
    weights = rows_ce.RowWeights.mean(keep, torch.float64)
    assert torch.equal(weights.per_unit, keep.double())
    torch.testing.assert_close(weights.unit, torch.tensor(1 / 3, dtype=torch.float64))
    values = torch.tensor([1.0, 100.0, 2.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(weights.total(values), torch.tensor(2.0, dtype=torch.float64))
    # some tokens' weights keep the batch's unit: their parts add up to the whole
    first, rest = weights.rows(torch.tensor([0, 1])), weights.rows(slice(2, 4))
    torch.testing.assert_close(first.total(values[:2]) + rest.total(values[2:]),
                               weights.total(values))  # fmt: skip
    nothing = rows_ce.RowWeights.mean(torch.zeros(3, dtype=torch.bool), torch.float32)
    assert nothing.unit == 1 and nothing.total(torch.ones(3)) == 0


@pytest.mark.parametrize("smoothed", [False, True])
def test_an_ignored_rows_loss_stays_out_of_the_sum_whatever_it_holds(smoothed):
    per_unit, unit = torch.tensor([1.0, 0.0, 1.0]), torch.tensor(0.5)
    nll = torch.tensor([1.0, math.nan, 3.0])
    row_loss = torch.tensor([2.0, math.inf, 4.0]) if smoothed else nll
    loss, kept_nll = rows_ce.weighted_loss(per_unit, unit, nll, row_loss, smoothed)
    assert torch.equal(kept_nll, torch.tensor([1.0, 0.0, 3.0]))
    assert loss == (3.0 if smoothed else 2.0)


def test_weights_are_row_weights_not_a_plain_tensor():
    hidden, weight, b, target = float64_case()
    with pytest.raises(TypeError, match="RowWeights"):
        mean_cross_entropy(hidden, weight, b, target, weights=torch.ones(hidden.size(0)),
                           options=LossOptions(plan="rows"))  # fmt: skip
