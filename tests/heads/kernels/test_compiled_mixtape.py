"""The GPU plan of Mixtape's frequent block (heads/kernels/compiled_mixtape.py): float64
equality with the hand-written CPU plan (outputs and every input's gradient, several blocks, a
narrower last block, gate noise replayed), through the whole head, with the real compiler, and
one graph per body however many blocks and rows."""

from functools import partial

import pytest
import torch

import heads.kernels.compiled_lse as compiled_lse
from heads import MixtapeHead, mixtape
from heads.fused_cross_entropy import LossOptions
from tests.heads.contract import HIDDEN, VOCAB, check_compiles_without_graph_breaks

pytestmark = pytest.mark.usefixtures("one_thread")

EAGER = LossOptions(plan="eager", columns=3, saved_bytes=0)
COMPILED = LossOptions(plan="compiled", columns=3)


@pytest.fixture
def quick_compile(monkeypatch):
    """The bodies through torch.compile's aot_eager backend (seconds); one test keeps
    Inductor."""
    monkeypatch.setattr(compiled_lse, "COMPILE_BACKEND", "aot_eager")
    yield
    torch._dynamo.reset()


def _inputs(k: int, s: int, v: int, n: int = 6, d: int = 5, e: int = 7, seed: int = 0):
    """``(gate inputs, gate weights, contexts, W, b)`` in float64 and targets: row 1 ignored
    (-1), the others anywhere in ``[0, v)`` (beyond ``s``: another block's)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    target = torch.randint(0, v, (n,), generator=gen)
    target[1] = -1
    return (rand(n, k - 1, e), rand(s, e), rand(n, k, d), rand(s, d), rand(s)), target


def _outputs_and_grads(options, tensors, target, noise: float, want_sum: bool = True):
    """The three outputs and the gradients of a loss weighting each of them differently."""
    torch.manual_seed(11)  # the gate noise's draws
    out = mixtape.mixtape_frequent_lse(*tensors, target, want_sum, noise, options)
    n = target.size(0)
    scale = torch.linspace(0.5, 1.5, n, dtype=torch.float64)
    loss = (scale * out.lse - 1.3 * out.target_logit).sum()
    if want_sum:
        loss = loss - 0.1 * (scale * out.logit_sum).sum()
    grads = torch.autograd.grad(loss, tensors)
    sums = [out.logit_sum] if want_sum else []
    return [out.lse, out.target_logit, *sums, *grads], torch.rand(2)


@pytest.mark.usefixtures("quick_compile")
@pytest.mark.parametrize(
    "k,s,v,noise,want_sum",
    [(2, 3, 7, 0.0, True), (4, 7, 12, 0.7, True), (8, 5, 9, 0.7, False), (4, 2, 2, 0.0, False)],
)
def test_compiled_blocks_equal_the_hand_written_plan_in_float64(k, s, v, noise, want_sum):
    """Blocks of 3 columns (a narrower last one), targets in this block, another block and
    ignored; with gate noise the backward replays the forward's draws, and the random stream
    after the step is where the hand-written plan leaves it."""
    tensors, target = _inputs(k, s, v)
    got, after = _outputs_and_grads(COMPILED, tensors, target, noise, want_sum)
    want, want_after = _outputs_and_grads(EAGER, tensors, target, noise, want_sum)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(after, want_after, rtol=0, atol=0)


@pytest.mark.usefixtures("quick_compile")
def test_the_head_by_the_compiled_plan_equals_the_hand_written_one():
    """A training step of the whole head (gate noise, dropout, weight norm, shared gates for
    the rare tokens, label smoothing): loss and every parameter's gradient."""
    torch.manual_seed(0)
    head = MixtapeHead(HIDDEN, VOCAB, num_components=4, frequent_ratio=0.4,
                       gate_embedding_size=3, embedding_size=5, gate_noise=0.5,
                       gate_dropout=0.2, weight_norm_scale=1.5).double().train()  # fmt: skip
    hidden = torch.randn(9, HIDDEN, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, VOCAB, (9,))
    target[4] = -100
    results = []
    for options in (COMPILED, EAGER):
        head.loss_options = options
        torch.manual_seed(5)
        out = head(hidden, target, label_smoothing=0.1)
        loss = out.loss + 0.3 * (out.nll * torch.arange(9.0, dtype=torch.float64)).sum()
        results.append([loss, *torch.autograd.grad(loss, [hidden, *head.parameters()])])
    for g, w in zip(*results, strict=True):
        torch.testing.assert_close(g, w)


def test_inductor_blocks_equal_the_hand_written_plan():
    """The real compiler (C++ on a CPU, Triton on a GPU) in float64."""
    tensors, target = _inputs(4, 7, 12, seed=3)
    got, _ = _outputs_and_grads(COMPILED, tensors, target, 0.0)
    want, _ = _outputs_and_grads(EAGER, tensors, target, 0.0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch._dynamo.reset()


def test_one_graph_per_body_for_every_block_and_row_count(quick_compile):
    """Dynamic shapes: blocks, a narrower last block and other row counts reuse the forward
    and backward bodies' graphs (a recompilation per block ran into Dynamo's recompile limit
    on a GPU and fell back to eager)."""
    from torch._dynamo.utils import counters

    counters.clear()
    options = LossOptions(plan="compiled", columns=6)
    for n, s in [(6, 14), (9, 20), (13, 17)]:  # last blocks of 2, 2 and 5 columns
        tensors, target = _inputs(4, s, 30, n=n, seed=n)
        _outputs_and_grads(options, tensors, target, 0.3, want_sum=False)
    assert counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])


def test_a_compiled_model_traces_the_blocks_into_one_graph():
    """Under a compiled model the bodies inline into its graph (gate noise kept from the
    forward, no generator state to trace): no graph break."""
    make = partial(MixtapeHead, HIDDEN, VOCAB, num_components=4, frequent_ratio=0.5,
                   gate_embedding_size=3, embedding_size=5, gate_noise=0.3)  # fmt: skip
    check_compiles_without_graph_breaks(make, LossOptions(plan="compiled", columns=5))


@pytest.mark.gpu
def test_cuda_bf16_blocks_against_float64_without_a_sync():
    """On CUDA under bf16 autocast, within bf16's error of the float64 plan, and no host
    sync in the forward and backward (after the bodies compiled)."""
    tensors, target = _inputs(4, 700, 1000, n=512, d=64, e=16, seed=2)
    cuda = [t.detach().cuda().requires_grad_(True) for t in tensors]
    target = target.cuda()
    options = LossOptions(plan="compiled", columns=256)

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = mixtape.mixtape_frequent_lse(*cuda, target, True, 0.0, options)
        return [out.lse, *torch.autograd.grad((out.lse - out.target_logit).sum(), cuda)]

    run()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    exact = [t.detach().cuda().double().requires_grad_(True) for t in tensors]
    out = mixtape.mixtape_frequent_lse(*exact, target, True, 0.0, EAGER)
    want = [out.lse, *torch.autograd.grad((out.lse - out.target_logit).sum(), exact)]
    for g, w in zip(got, want, strict=True):
        scale = w.abs().max().clamp_min(1.0)
        torch.testing.assert_close(g.double() / scale, w / scale, rtol=0, atol=3e-2)


def test_inductor_fuses_each_body_into_one_kernel_besides_its_products():
    """What the plan is for: the sigmoids, the tree (both ways), the bias, the exponentials
    and the reductions of a block become 1 generated kernel per body around its products
    (2 forward: the gates and the leaves; 6 backward: those recomputed, then the 4 gradient
    products, the bias gradient folded into the ``dW`` one), where the hand-written CPU plan
    runs ~20 passes over ``[N, K, w]``. And what it stores of the block's size: forward the
    products' outputs and the logits ``[N, w]``; backward the products' outputs and their
    inputs ``dL/dpre``, ``dL/dleaves`` (no float32 tree levels, no ``dz`` for a bias sum)."""
    import re

    from torch._inductor.utils import run_and_get_code

    from heads.kernels.compiled_lse import with_ones
    from heads.kernels.compiled_mixtape import frequent_backward_block, frequent_forward_block

    n, k, s, d, e = 64, 4, 48, 16, 8
    inputs, contexts = torch.randn(n, k - 1, e), torch.randn(n * k, d)
    gate_w, w, b = torch.randn(s, e), torch.randn(s, d), torch.randn(s)
    local, rows = torch.randint(-1, s, (n,)), torch.randn(n)
    bodies = {
        frequent_forward_block: (contexts, gate_w, w, b, None, 0.0, local, rows - 1e9,
                                 rows.abs(), rows, None),
        frequent_backward_block: (with_ones(contexts, torch.float32), gate_w, w, b, None, 0.0,
                                  local, rows + 5, rows, rows, None,
                                  torch.zeros(n * (k - 1), e), torch.zeros(n * k, d)),
    }  # fmt: skip
    products, block_sized = {}, {}
    for dynamic in (True, False):  # as the plan compiles them; then sizes to read
        for body, tail in bodies.items():
            compiled = torch.compile(body, dynamic=dynamic)
            _, code = run_and_get_code(compiled, inputs, *tail)
            source = "\n".join(code)
            torch._dynamo.reset()
            if dynamic:
                kernels = set(re.findall(r"\b(cpp_fused_\w+?_\d+)\b", source))
                assert len(kernels) == 1, sorted(kernels)
                products[body.__name__] = len(re.findall(r"extern_kernels\.(?:mm|addmm)\(",
                                                         source))  # fmt: skip
                continue
            shapes = [[int(x) for x in shape.split(", ")] for shape in
                      re.findall(r"empty_strided_cpu\(\((\d+, \d+)\)", source)]  # fmt: skip
            block_sized[body.__name__] = sorted((a, c) for a, c in shapes
                                                if a % n == 0 and c % s == 0)  # fmt: skip
    assert products == {"frequent_forward_block": 2, "frequent_backward_block": 6}
    # [rows, columns] of the block: products' outputs [(K-1) N, w], [K N, w]; then the
    # forward's logits [N, w], the backward's dL/dpre [N, (K-1) w] and dL/dleaves [N, K w]
    assert block_sized == {
        "frequent_forward_block": [(64, 48), (192, 48), (256, 48)],
        "frequent_backward_block": [(64, 144), (64, 192), (192, 48), (256, 48)],
    }
