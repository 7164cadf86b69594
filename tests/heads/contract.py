"""Checks every head must pass (docs/design.md, "The head contract"), run on every head of the
registry ``HEADS`` by ``tests/heads/test_contract.py``; a new head joins them with a line there."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from functools import partial

import pytest
import torch

from heads import (
    IGNORE_INDEX,
    AdaptiveSoftmaxHead,
    DSSoftmaxHead,
    Head,
    MixtapeHead,
    MoSHead,
    SoftmaxHead,
)
from heads.fused_cross_entropy import LossOptions

HIDDEN, VOCAB, ROWS = 6, 23, 9
# the fused loss over several chunks: 5 columns (V = 23 is not a multiple of 5), row tiles of
# 4, recomputed in the backward; and the same with the first chunks kept
# the column plan at its edges (the chunks of a CPU's default plan for every block that is
# not a whole mean loss), and the rows plan in tiles of 4 rows (a CPU's default for them)
CHUNKED = LossOptions(plan="eager", columns=5, rows=4, saved_bytes=0)
PARTLY_KEPT = LossOptions(plan="eager", columns=5, rows=4, saved_bytes=600)
ROW_TILES = LossOptions(plan="rows", rows=4)


def chunked(make: Callable[[], Head], options: LossOptions = CHUNKED) -> Callable[[], Head]:
    """``make`` with its head's fused loss chunked (``options``)."""

    def make_chunked() -> Head:
        head = make()
        head.loss_options = options
        return head

    return make_chunked


def _inputs(seed: int = 0, dtype: torch.dtype = torch.float64):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=gen, dtype=dtype)
    target = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    return hidden, target


def check_log_prob_normalised(make: Callable[[], Head]) -> None:
    head = make().double().eval()
    hidden, _ = _inputs()
    log_probs = head.log_prob(hidden)
    assert log_probs.shape == (ROWS, VOCAB)
    torch.testing.assert_close(
        log_probs.logsumexp(-1), torch.zeros(ROWS, dtype=log_probs.dtype), atol=1e-10, rtol=0
    )


def check_nll_matches_log_prob(make: Callable[[], Head]) -> None:
    head = make().double().eval()
    hidden, target = _inputs()
    output = head(hidden, target)
    expected = -head.log_prob(hidden).gather(1, target[:, None]).squeeze(1)
    torch.testing.assert_close(output.nll, expected)
    torch.testing.assert_close(output.loss, expected.mean())
    assert output.aux_loss.shape == ()


def check_ignored_positions(make: Callable[[], Head]) -> None:
    head = make().double().eval()
    hidden, target = _inputs()
    hidden.requires_grad_(True)
    target[[1, 4]] = IGNORE_INDEX
    output = head(hidden, target)
    keep = target != IGNORE_INDEX
    assert torch.all(output.nll[~keep] == 0)
    torch.testing.assert_close(output.loss, output.nll[keep].mean())
    output.loss.backward()
    assert torch.all(hidden.grad[~keep] == 0)
    assert hidden.grad[keep].abs().sum() > 0
    # changing the ignored targets changes nothing
    other = target.clone()
    other[~keep] = IGNORE_INDEX
    torch.testing.assert_close(head(hidden, other).loss, output.loss)


def check_gradients(make: Callable[[], Head]) -> None:
    head = make().double().eval()
    hidden, target = _inputs()
    hidden.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h: head(h, target).loss, (hidden,))
    assert torch.autograd.gradcheck(lambda h: head.log_prob(h)[:, :5], (hidden,))
    # and through every parameter (one scalar probe per parameter tensor)
    for name, param in head.named_parameters():
        base = param.detach().clone()

        def loss_of(p, name=name, base=base):
            with torch.no_grad():
                dict(head.named_parameters())[name].copy_(base)
            params = {n: (p if n == name else q) for n, q in head.named_parameters()}
            return torch.func.functional_call(head, params, (hidden.detach(), target)).loss

        probe = base.clone().requires_grad_(True)
        assert torch.autograd.gradcheck(loss_of, (probe,)), name


def check_label_smoothing(make: Callable[[], Head]) -> None:
    """``label_smoothing=eps``: the loss is ``(1 - eps) nll + eps mean_x(-log p_x)`` over the
    rows kept, of the distribution the head trains; ``nll`` stays the plain NLL; gradients
    (input and every parameter) equal those of that formula written on ``training_log_prob``."""
    head = make().double().eval()
    hidden, target = _inputs(seed=3)
    target[[2, 5]] = IGNORE_INDEX
    hidden.requires_grad_(True)
    eps = 0.2
    output = head(hidden, target, label_smoothing=eps)
    log_probs = head.training_log_prob(hidden)
    keep = target != IGNORE_INDEX
    nll = -log_probs.gather(1, target.clamp_min(0)[:, None]).squeeze(1)
    expected = ((1 - eps) * nll - eps * log_probs.mean(-1))[keep].mean()
    torch.testing.assert_close(output.loss, expected)
    torch.testing.assert_close(output.nll, torch.where(keep, nll, torch.zeros_like(nll)))
    params = [hidden, *(p for p in head.parameters() if p.requires_grad)]
    got = torch.autograd.grad(output.loss, params, allow_unused=True)
    want = torch.autograd.grad(expected, params, allow_unused=True)
    for param, g, w in zip(params, got, want, strict=True):
        g = torch.zeros_like(param) if g is None else g
        w = torch.zeros_like(param) if w is None else w
        torch.testing.assert_close(g, w)
    assert torch.autograd.gradcheck(
        lambda h: head(h, target, label_smoothing=eps).loss, (hidden.detach().requires_grad_(),)
    )
    with pytest.raises(ValueError, match="label_smoothing"):
        head(hidden, target, label_smoothing=1.0)


def check_checkpoint_hooks(make: Callable[[], Head]) -> None:
    """A head's own state passes ``check_state_dict`` and loads through ``load_pretrained``;
    a state with another parameter name is refused naming it."""
    torch.manual_seed(0)
    head, other = make().double(), make().double()
    state = other.state_dict()
    head.check_state_dict(state)
    assert head.load_pretrained(state)
    hidden, _ = _inputs()
    torch.testing.assert_close(head.log_prob(hidden), other.log_prob(hidden))
    with pytest.raises(ValueError, match="unexpected"):
        head.check_state_dict({**state, "no_such_parameter": torch.zeros(1)})


def check_topk(make: Callable[[], Head]) -> None:
    head = make().double().eval()
    hidden, _ = _inputs()
    values, indices = head.topk(hidden, 4)
    ref_values, _ = head.log_prob(hidden).topk(4)
    torch.testing.assert_close(values, ref_values)
    torch.testing.assert_close(head.log_prob(hidden).gather(1, indices), values)


def check_bf16_autocast(make: Callable[[], Head]) -> None:
    """Under CPU bf16 autocast, losses stay float32 and a few SGD steps stay finite."""
    torch.manual_seed(0)
    head = make().train()
    hidden, target = _inputs(dtype=torch.float32)
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5)
    for _ in range(5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = head(hidden * 10, target)  # large activations stress the normalisation
        assert output.loss.dtype == torch.float32
        assert torch.isfinite(output.loss)
        optimizer.zero_grad()
        (output.loss + output.aux_loss).backward()
        assert all(torch.isfinite(p.grad).all() for p in head.parameters() if p.grad is not None)
        optimizer.step()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log_probs = head.log_prob(hidden)
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(ROWS), atol=1e-5, rtol=0)


# float64 losses and gradients against their plain formula: equal to rounding, not to float32's
# tolerance (torch's default for float64, 1e-7, let a float32 step inside pass)
FLOAT64 = {"rtol": 1e-12, "atol": 1e-12}


def check_loss_matches_reference(
    make: Callable[[], Head],
    reference: Callable[[Head, torch.Tensor], torch.Tensor] | None = None,
    options: tuple[LossOptions, ...] = (CHUNKED, PARTLY_KEPT, ROW_TILES, LossOptions()),
    inference: bool = True,
) -> None:
    """The training loss against a plain reference in float64, at the fused loss's edges:
    chunked (V not a multiple of the chunk, row tiles), kept and recomputed chunks; one row,
    every row ignored, ignored rows mixed in, no row at all; with and without label smoothing.
    ``loss``, ``nll`` and the gradients of the input and of every parameter equal those of the
    formula written on ``reference(head, hidden)`` (``[N, V]`` log-probabilities; default the head's
    ``training_log_prob``). ``log_prob`` and ``topk`` equal a given ``reference``'s too unless
    ``inference=False`` (a head whose inference distribution is another one, DS-Softmax)."""
    head = make().double().eval()
    given = reference is not None and inference
    reference = reference or (lambda h, x: h.training_log_prob(x))
    gen = torch.Generator().manual_seed(11)
    cases = {
        "mixed": (ROWS, [1, 4]),
        "one_row": (1, []),
        "all_ignored": (4, [0, 1, 2, 3]),
        "no_rows": (0, []),
    }
    params = [p for p in head.parameters() if p.requires_grad]
    for loss_options in options:
        head.loss_options = loss_options
        for rows, ignored in cases.values():
            hidden = torch.randn(rows, HIDDEN, generator=gen, dtype=torch.float64)
            hidden.requires_grad_(True)
            target = torch.randint(0, VOCAB, (rows,), generator=gen)
            target[ignored] = IGNORE_INDEX
            keep = target != IGNORE_INDEX
            for eps in (0.0, 0.2):
                output = head(hidden, target, label_smoothing=eps)
                log_probs = reference(head, hidden)
                nll = -log_probs.gather(1, target.clamp_min(0)[:, None]).squeeze(1)
                nll = torch.where(keep, nll, torch.zeros_like(nll))
                per_row = (1 - eps) * nll - eps * log_probs.mean(-1)
                expected = torch.where(keep, per_row, torch.zeros_like(per_row))
                expected = expected.sum() / keep.sum().clamp_min(1)
                torch.testing.assert_close(output.loss, expected, **FLOAT64)
                torch.testing.assert_close(output.nll, nll, **FLOAT64)
                # the task loss's gradients (aux_loss, a regulariser, is checked elsewhere)
                got = torch.autograd.grad(output.loss, [hidden, *params], allow_unused=True)
                # a reference written row by row has no graph at all without rows: zero
                want = [None] * (1 + len(params))
                if expected.requires_grad:
                    want = torch.autograd.grad(expected, [hidden, *params], allow_unused=True)
                for g, w, p in zip(got, want, [hidden, *params], strict=True):
                    g = torch.zeros_like(p) if g is None else g
                    w = torch.zeros_like(p) if w is None else w
                    torch.testing.assert_close(g, w, **FLOAT64)
            if given and rows > 1:
                with torch.no_grad():
                    torch.testing.assert_close(head.log_prob(hidden), reference(head, hidden))
                    k = min(4, VOCAB)
                    values, indices = head.topk(hidden, k)
                    torch.testing.assert_close(values, reference(head, hidden).topk(k).values)
                    torch.testing.assert_close(reference(head, hidden).gather(1, indices), values)


# every plan a CPU runs (the compiled one: test_contract's GPU-plan tests, and slow below)
CPU_PLANS = tuple(
    LossOptions(plan=plan) for plan in ("auto", "eager", "checkpoint", "rows", "plain")
)


def check_empty_batch(make: Callable[[], Head], options: tuple[LossOptions, ...] = CPU_PLANS):
    """A batch of no rows (N = 0: an empty batch, or every row dropped before the head), in
    evaluation and training (dropout, gate noise), with and without label smoothing, given the
    rows' layout where the head takes it, on every plan of ``options``: ``loss`` is 0 (the mean
    over no kept row, as for an all-ignored batch: ``Head.output``), ``nll`` is ``[0]``,
    ``aux_loss`` finite; the loss reaches every parameter a batch with rows reaches, with a zero
    gradient in the parameter's dtype (DDP reduces them all: a rank's empty batch may leave
    none out); ``log_prob`` is ``[0, V]`` and ``topk`` ``[0, k]``."""
    torch.manual_seed(0)
    head = make().double()
    params = {name: p for name, p in head.named_parameters() if p.requires_grad}
    layout = {"sequence_length": 3} if head.takes_sequence_length else {}
    gen = torch.Generator().manual_seed(5)
    for loss_options, training, eps in itertools.product(options, (False, True), (0.0, 0.2)):
        head.loss_options = loss_options
        head.train(training)
        reached = set()
        for rows in (5, 0):
            hidden = torch.randn(rows, HIDDEN, generator=gen, dtype=torch.float64)
            hidden.requires_grad_(True)
            target = torch.randint(0, VOCAB, (rows,), generator=gen)
            output = head(hidden, target, label_smoothing=eps, **layout)
            grads = torch.autograd.grad(output.loss, [hidden, *params.values()], allow_unused=True)
            got = {name for name, g in zip(params, grads[1:], strict=True) if g is not None}
            if rows:
                reached = got
                continue
            case = (loss_options.plan, training, eps)
            assert output.loss.shape == () and output.loss.dtype == torch.float64, case
            assert output.loss.item() == 0, case
            assert output.nll.shape == (0,) and output.nll.dtype == torch.float64, case
            assert output.aux_loss.shape == () and torch.isfinite(output.aux_loss), case
            assert got >= reached, (case, reached - got)
            for g, p in zip(grads, [hidden, *params.values()], strict=True):
                assert g is None or (g.dtype == p.dtype and g.shape == p.shape), case
                assert g is None or not g.any(), case
    head.eval()
    with torch.no_grad():
        hidden = torch.zeros(0, HIDDEN, dtype=torch.float64)
        assert head.log_prob(hidden).shape == (0, VOCAB)
        values, indices = head.topk(hidden, 4)
        assert values.shape == (0, 4) and indices.shape == (0, 4)
        assert indices.dtype == torch.long


def saved_tensor_sizes(fn: Callable[[], object]) -> list[int]:
    """Element counts of every tensor autograd saves for the backward while ``fn()`` runs."""
    sizes: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sizes


def check_training_keeps_no_vocabulary_rows(make_wide: Callable[[], Head], rows: int = 64):
    """docs/design.md: no head keeps a ``[N, V]`` (or ``[N, K, V]``) tensor for its training loss's
    backward. ``make_wide`` builds the head with a vocabulary wider than its other sizes; with
    the fused loss recomputing its chunks, nothing saved may reach ``N V / 4`` elements (the
    parameters themselves stay below that)."""
    torch.manual_seed(0)
    head = make_wide().train()
    head.loss_options = LossOptions(columns=32, saved_bytes=0)
    vocab = head.vocab_size
    hidden = torch.randn(rows, head.hidden_size, requires_grad=True)
    target = torch.randint(0, vocab, (rows,))
    assert max(p.numel() for p in head.parameters()) < rows * vocab / 4  # the check can fail

    def step() -> None:
        output = head(hidden, target, label_smoothing=0.1)
        (output.loss + output.aux_loss).backward()

    largest = max(saved_tensor_sizes(step))
    assert largest < rows * vocab / 4, (largest, rows * vocab)


def check_compiles_without_graph_breaks(
    make: Callable[[], Head], options: LossOptions = PARTLY_KEPT
) -> None:
    """The training loss (train mode, label smoothing, several chunks of ``options``' plan)
    traces into one graph under torch.compile: no graph break, no host sync in the hot path
    (Dynamo's explain: tracing only, no code generation)."""
    import torch._dynamo

    torch.manual_seed(0)
    head = chunked(make, options)().train()
    hidden, target = _inputs(dtype=torch.float32)
    target[2] = IGNORE_INDEX

    def step(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        output = head(h, t, label_smoothing=0.1)
        return output.loss + output.aux_loss

    with torch._dynamo.config.patch(capture_scalar_outputs=True):  # as HeadTask sets it
        explained = torch._dynamo.explain(step)(hidden.requires_grad_(), target)
    torch._dynamo.reset()
    reasons = [str(r.reason)[:200] for r in explained.break_reasons]
    assert explained.graph_break_count == 0 and explained.graph_count == 1, reasons


def check_inductor_compiles_every_batch_size(
    make: Callable[[], Head],
    options: LossOptions | None = None,
    label_smoothing: float = 0.0,
    runs: tuple[tuple[int, bool], ...] = ((13, False), (29, True), (13, False), (17, True)),
) -> None:
    """Compiled by Inductor as a task compiles it, the head gives the eager losses and input
    gradients over a run's sequence of batch sizes: a validation batch (inference mode), then
    training batches of other sizes, which Dynamo recompiles with a symbolic batch size. Code
    generation, not only tracing: Inductor must prove every slice by a data-dependent size in
    bounds for any batch size, and generate every scatter of the backward as a multi-core
    CPU gets it (vectorised atomic adds; one thread gets scalar ones). ``options``: the fused
    loss's plan (None: the head's default); ``label_smoothing`` in training; ``runs``: the
    batches' ``(rows, training)``."""
    import torch._dynamo
    import torch._inductor.config

    torch.manual_seed(0)
    eager = (make if options is None else chunked(make, options))().train()
    compiled = copy.deepcopy(eager)
    compiled.compile()
    gen = torch.Generator().manual_seed(1)
    try:
        with (
            torch._dynamo.config.patch(capture_scalar_outputs=True),  # as HeadTask sets it
            torch._inductor.config.patch({"cpp.threads": 2}),
        ):
            for rows, train in runs:
                hidden = torch.randn(rows, eager.hidden_size, generator=gen)
                target = torch.randint(0, VOCAB, (rows,), generator=gen)
                losses, grads = [], []
                for head in (eager, compiled):
                    x = hidden.clone().requires_grad_(train)
                    with torch.enable_grad() if train else torch.inference_mode():
                        output = head(x, target, label_smoothing=label_smoothing * train)
                    losses.append(output.loss.detach())
                    if train:
                        (output.loss + output.aux_loss).backward()
                        grads.append(x.grad)
                torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
                if train:
                    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()


def check_cuda_matches_cpu(make: Callable[[], Head]) -> None:
    """The same head on CUDA gives the CPU's losses, gradients, log-probs and top-k (float64).

    In eval mode: dropout and gate noise draw from generators that differ between devices,
    and the loss takes the same code path either way."""
    cpu_head = make().double().eval()
    cuda_head = copy.deepcopy(cpu_head).cuda()
    hidden, target = _inputs()
    target[2] = IGNORE_INDEX
    results = []
    for head, device in ((cpu_head, "cpu"), (cuda_head, "cuda")):
        h = hidden.to(device, copy=True).requires_grad_(True)
        output = head(h, target.to(device))
        (output.loss + output.aux_loss).backward()
        with torch.no_grad():
            log_probs = head.log_prob(h)
            values, indices = head.topk(h, 4)
            one_values, one_indices = head.topk(h[:1], 4)  # DS-Softmax has a batch-1 path
        grads = [p.grad for p in head.parameters() if p.grad is not None]
        results.append([output.nll, output.loss, output.aux_loss, h.grad, log_probs, values,
                        indices, one_values, one_indices, *grads])  # fmt: skip
    assert results[1][0].is_cuda
    assert len(results[0]) == len(results[1])
    for cpu_value, cuda_value in zip(*results, strict=True):
        torch.testing.assert_close(cuda_value.cpu(), cpu_value, rtol=1e-9, atol=1e-9)


def check_cuda_autocast(make: Callable[[], Head], dtype: torch.dtype) -> None:
    """Lightning's 16-mixed / bf16-mixed on CUDA: float32 losses near the float32 ones, finite
    gradients through a few steps (fp16 with a GradScaler, as Lightning runs it), normalised
    float32 log-probs."""
    torch.manual_seed(0)
    head = make().cuda().train()
    hidden, target = (t.cuda() for t in _inputs(dtype=torch.float32))
    reference = copy.deepcopy(head).eval()
    head.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        mixed = head(hidden, target).loss
    assert mixed.dtype == torch.float32
    torch.testing.assert_close(mixed, reference(hidden, target).loss, rtol=2e-2, atol=2e-2)
    head.train()
    # float16's range ends at 65504: the 10x stress and a large step (as in the CPU bf16
    # check) would overflow a growing head's logits, which no loss code can undo
    stress, lr = (10.0, 0.5) if dtype == torch.bfloat16 else (1.0, 0.1)
    optimizer = torch.optim.SGD(head.parameters(), lr=lr)
    # Lightning's 16-mixed GradScaler: it starts at 2^16, so the first steps' float16 gradients
    # may overflow; it then skips the step and halves the scale. It must settle: the last
    # steps all finite.
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    finite = []
    for _ in range(16):
        with torch.autocast("cuda", dtype=dtype):
            output = head(hidden * stress, target)
        assert output.loss.dtype == torch.float32 and torch.isfinite(output.loss)
        optimizer.zero_grad()
        scaler.scale(output.loss + output.aux_loss).backward()
        scaler.unscale_(optimizer)
        grads = [p.grad for p in head.parameters() if p.grad is not None]
        finite.append(all(bool(torch.isfinite(g).all()) for g in grads))
        scaler.step(optimizer)
        scaler.update()
    assert all(finite[-4:]) and (dtype == torch.float16 or all(finite)), finite
    assert all(torch.isfinite(p).all() for p in head.parameters())
    with torch.autocast("cuda", dtype=dtype):
        log_probs = head.log_prob(hidden)
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(
        log_probs.logsumexp(-1), torch.zeros(ROWS, device="cuda"), atol=1e-5, rtol=0
    )


def check_cuda_bf16_mixed(make: Callable[[], Head]) -> None:
    check_cuda_autocast(make, torch.bfloat16)


def check_cuda_16_mixed(make: Callable[[], Head]) -> None:
    check_cuda_autocast(make, torch.float16)


CPU_CHECKS = [
    check_log_prob_normalised,
    check_nll_matches_log_prob,
    check_ignored_positions,
    check_gradients,
    check_topk,
    check_bf16_autocast,
    check_label_smoothing,
    check_checkpoint_hooks,
    check_loss_matches_reference,
    check_empty_batch,
]
# Skipped (by tests/conftest.py) where no CUDA device is present; run with `pytest -m gpu`.
CUDA_CHECKS = [check_cuda_matches_cpu, check_cuda_bf16_mixed, check_cuda_16_mixed]
ALL_CHECKS = CPU_CHECKS + [
    pytest.param(check, marks=pytest.mark.gpu, id=check.__name__) for check in CUDA_CHECKS
]

# the contract as a parametrisation: ``@each_check`` then ``run_check(check, make, fused)``
each_check = pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)


def run_check(
    check: Callable[[Callable[[], Head]], None],
    make: Callable[[], Head],
    fused: Callable[[Callable[[], Head]], Callable[[], Head]] | None = None,
) -> None:
    """``check`` on the heads ``make`` builds (through ``fused`` when given), seeded."""
    torch.manual_seed(0)
    check(fused(make) if fused else make)


def _head(head_class: type[Head], **options) -> Callable[[], Head]:
    return partial(head_class, HIDDEN, VOCAB, **options)


_MOS = {"num_components": 3, "embedding_size": 5}
_MIXTAPE = {"num_components": 4, "frequent_ratio": 0.3, "gate_embedding_size": 3,
            "embedding_size": 5}  # fmt: skip

# The heads the contract runs on, one line each: ``id -> make`` (a head of HIDDEN x VOCAB;
# wrapped in ``chunked`` to run its fused loss over several chunks).
HEADS: dict[str, Callable[[], Head]] = {
    "softmax-no_projection": _head(SoftmaxHead),
    "softmax-projection": _head(SoftmaxHead, embedding_size=4),
    "softmax-projection_chunked": chunked(_head(SoftmaxHead, embedding_size=4)),
    "mos-one_chunk": _head(MoSHead, **_MOS),
    "mos-chunked": chunked(_head(MoSHead, **_MOS)),
    "mixtape-shared_gates": _head(MixtapeHead, **_MIXTAPE),
    "mixtape-no_sharing": _head(MixtapeHead, **{**_MIXTAPE, "frequent_ratio": 1.0}),
    "mixtape-k8_weight_norm": _head(
        MixtapeHead, **{**_MIXTAPE, "num_components": 8, "weight_norm_scale": 2.0}
    ),
    "mixtape-shared_gates_chunked": chunked(
        _head(MixtapeHead, **{**_MIXTAPE, "frequent_ratio": 0.5})
    ),
    "adaptive-one_cluster": _head(AdaptiveSoftmaxHead, cutoffs=[5], div_value=2.0),
    "adaptive-two_clusters": _head(AdaptiveSoftmaxHead, cutoffs=[4, 11], div_value=2.0),
    "adaptive-one_cluster_chunked": chunked(
        _head(AdaptiveSoftmaxHead, cutoffs=[12], div_value=2.0)
    ),
    "ds-k1": _head(DSSoftmaxHead, num_experts=1),
    "ds-k3_lasso": _head(DSSoftmaxHead, num_experts=3, lambda_lasso=0.01, lambda_expert=0.01),
    "ds-k2_bias": _head(DSSoftmaxHead, num_experts=2, bias=True),
    "ds-k3_bias_chunked": chunked(_head(DSSoftmaxHead, num_experts=3, bias=True, lambda_load=1.0)),
}
