"""MoS's latent dropout locked over a sequence (``locked_dropout``), as the MoS code's
``latent = self.lockdrop(latent, self.dropoutl)``: one Bernoulli mask ``[B, 1, K d]`` per
sequence, shared by its T steps, scaled by ``1 / (1 - p)``.

The head exposes nothing extra: each test draws the mask the reference draws (the same
generator calls, ``torch.empty(S, 1, K d).bernoulli_(1 - p)``, as LockedDropout does) from
the same seed, and compares the head's loss, NLL and every gradient with a float64 mixture
written plainly with that mask."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from heads import MoSHead
from heads.fused_cross_entropy import LossOptions
from heads.graphs import GRAPH_DEVICES, GraphedTrainingLoss
from tests.heads.contract import check_empty_batch

HIDDEN, VOCAB, K, D = 6, 23, 3, 5
B, T, P = 3, 4, 0.4

pytestmark = pytest.mark.usefixtures("one_thread")


def make_head(**options) -> MoSHead:
    torch.manual_seed(0)
    options = {"num_components": K, "embedding_size": D, "context_dropout": P,
               "locked_dropout": True, **options}  # fmt: skip
    return MoSHead(HIDDEN, VOCAB, **options).double().train()


def batch(rows: int = B * T, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=gen, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (rows,), generator=gen)
    target[5] = -100
    return hidden, target


def locked_rows(rows: int, sequences: int, p: float = P) -> torch.Tensor:
    """``[rows, K D]``: LockedDropout's draw, one mask per sequence of T rows."""
    mask = torch.empty(sequences, 1, K * D, dtype=torch.float64).bernoulli_(1 - p) / (1 - p)
    return mask.expand(sequences, T, K * D).reshape(sequences * T, K * D)[:rows]


def per_row(rows: int, p: float = P) -> torch.Tensor:
    """``[rows, K D]``: nn.Dropout's draw over ``[N, K, D]``, a mask per row."""
    return F.dropout(torch.ones(rows, K, D, dtype=torch.float64), p, True).view(rows, K * D)


def reference(head: MoSHead, hidden, target, mask, label_smoothing: float = 0.0):
    """``(loss, nll)`` of Eq. 1 with ``h_{c,k} = mask * tanh(H_k g)``, in log space over the
    whole ``[N, K, V]`` (float64)."""
    n = hidden.size(0)
    contexts = torch.tanh(F.linear(hidden, head.context.weight, head.context.bias)) * mask
    logits = F.linear(contexts.view(n, K, D), head.weight, head.bias)  # [N, K, V]
    log_pi = torch.log_softmax(hidden @ head.prior.weight.T, dim=-1)
    log_p = torch.logsumexp(log_pi.unsqueeze(-1) + torch.log_softmax(logits, -1), dim=1)
    keep = target != -100
    nll = torch.where(keep, -log_p.gather(1, target.clamp_min(0)[:, None])[:, 0], 0.0)
    smooth = torch.where(keep, -log_p.mean(-1), 0.0)
    loss = ((1 - label_smoothing) * nll + label_smoothing * smooth).sum() / keep.sum()
    return loss, nll


def outputs(loss, nll, hidden, head) -> list[torch.Tensor]:
    return [loss, nll, *torch.autograd.grad(loss, [hidden, *head.parameters()])]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("plan", ["rows", "eager", "checkpoint", "compiled"])
def test_one_mask_per_sequence_as_the_mos_codes_lockdrop(plan, smoothing, monkeypatch):
    """Every plan (rows: token tiles, the gradient in the forward; eager and checkpoint:
    column chunks; compiled: CUDA's, here through aot_eager) trains with the contexts masked
    once per sequence: loss, NLL and gradients equal the plain mixture's with LockedDropout's
    mask; a mask per row (the head without the option) does not."""
    import heads.kernels.compiled_lse as compiled_lse

    monkeypatch.setattr(compiled_lse, "COMPILE_BACKEND", "aot_eager")
    head = make_head()
    head.loss_options = LossOptions(plan=plan, rows=6, columns=7)
    hidden, target = batch()
    hidden.requires_grad_(True)
    torch.manual_seed(2)
    out = head(hidden, target, label_smoothing=smoothing, sequence_length=T)
    got = outputs(out.loss, out.nll, hidden, head)
    torch.manual_seed(2)
    mask = locked_rows(B * T, B)
    assert not torch.equal(mask[0], mask[T]) and not torch.equal(mask[T], mask[2 * T])
    assert_same(got, outputs(*reference(head, hidden, target, mask, smoothing), hidden, head))
    torch.manual_seed(2)
    row_loss, _ = reference(head, hidden, target, per_row(B * T), smoothing)
    assert not torch.allclose(row_loss, got[0])
    torch._dynamo.reset()


def test_padded_rows_leave_the_real_rows_loss_and_gradients_alone():
    """Rows padded to a static count (zero hidden, ignored targets: ``static_rows``) are
    sequences past the real B: the real rows' loss and gradients are the reference's on the
    real rows alone, their masks the first B of LockedDropout's draw."""
    head = make_head()
    hidden, target = batch()
    rows = B * T + 3
    padded = F.pad(hidden, (0, 0, 0, 3)).requires_grad_(True)
    padded_target = F.pad(target, (0, 3), value=-100)
    torch.manual_seed(3)
    out = head(padded, padded_target, sequence_length=T)
    got = outputs(out.loss, out.nll, padded, head)
    assert torch.equal(out.nll[B * T :], torch.zeros(3, dtype=torch.float64))
    torch.manual_seed(3)
    mask = locked_rows(rows, B + 1)[: B * T]
    real = hidden.clone().requires_grad_(True)
    want = outputs(*reference(head, real, target, mask), real, head)
    got[1], got[2] = got[1][: B * T], got[2][: B * T]  # the real rows' NLL and gradient
    assert_same(got, want)


def test_evaluation_draws_no_mask():
    head = make_head().eval()
    twin = make_head(context_dropout=0.0).eval()
    hidden, target = batch()
    torch.manual_seed(4)
    state = torch.random.get_rng_state()
    out = head(hidden, target, sequence_length=T)
    assert torch.equal(torch.random.get_rng_state(), state)
    want = twin(hidden, target)
    assert torch.equal(out.loss, want.loss) and torch.equal(out.nll, want.nll)


@pytest.mark.parametrize("plan", ["rows", "eager"])
def test_by_default_and_without_a_layout_a_mask_per_row_as_before(plan):
    """``locked_dropout`` false (the default) with a layout, or true without one (translation,
    the model summary): nn.Dropout's mask per row over ``[N, K, d]``, bit for bit what the
    head without the option computes."""
    hidden, target = batch()
    results = []
    for locked, layout in [(False, T), (False, None), (True, None)]:
        head = make_head(locked_dropout=locked)
        head.loss_options = LossOptions(plan=plan, rows=6, columns=7)
        torch.manual_seed(5)
        h = hidden.clone().requires_grad_(True)
        options = {} if layout is None else {"sequence_length": layout}
        out = head(h, target, **options)
        results.append(outputs(out.loss, out.nll, h, head))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
    torch.manual_seed(5)
    mask = per_row(B * T)
    head = make_head(locked_dropout=False)
    h = hidden.clone().requires_grad_(True)
    assert_same(results[0], outputs(*reference(head, h, target, mask), h, head))


@pytest.mark.slow  # Inductor's code generation: ~25 s on 2 cores
def test_a_compiled_head_draws_the_same_masks_with_inductors_random_fallback():
    """The task's ``compile`` (the whole head through Inductor): with Inductor drawing its
    random numbers as eager does (``fallback_random``), the masks and the loss are the
    reference's; its locked mask comes from shapes only (no graph break)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    head = make_head()
    head.loss_options = LossOptions(plan="eager", columns=7)
    hidden, target = batch()
    hidden.requires_grad_(True)
    compiled = torch.compile(head, fullgraph=True)
    try:
        with inductor_config.patch(fallback_random=True):
            torch.manual_seed(6)
            out = compiled(hidden, target, sequence_length=T)
            got = outputs(out.loss, out.nll, hidden, head)
    finally:
        torch._dynamo.reset()
    torch.manual_seed(6)
    mask = locked_rows(B * T, B)
    assert_same(got, outputs(*reference(head, hidden, target, mask), hidden, head))


# -- CUDA graphs (heads/graphs.py), with the CPU stand-in for a capture -----------------------
@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr("heads.graphs.GRAPH_DEVICES", GRAPH_DEVICES | {"cpu"})


def test_a_captured_step_draws_its_locked_mask_in_the_graph(on_cpu):
    """The layout reaches the head inside the captured function and is part of the graph's
    key (another T, the same shape: another graph); a replay draws a new mask from the
    generator, one per sequence (the stand-in runs the loss once to capture, once a replay)."""
    from tests.heads.test_graphs import Rerun

    head = make_head()
    capturer = Rerun()
    graphed = GraphedTrainingLoss(head, capture=capturer)
    hidden, target = batch()
    torch.manual_seed(7)
    out = graphed(hidden, target, sequence_length=T)
    torch.manual_seed(7)
    locked_rows(B * T, B)  # the capture's draw
    mask = locked_rows(B * T, B)  # the replay's
    loss, nll = reference(head, hidden, target, mask)
    torch.testing.assert_close(out.loss, loss)
    torch.testing.assert_close(out.nll, nll)
    out.loss.backward()
    graphed(hidden, target, sequence_length=2 * T).loss.backward()
    assert capturer.captures == [(B * T, HIDDEN), (B * T, HIDDEN)]


def _dispatched(head, hidden, target) -> list[tuple[str, list]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        head(hidden, target, label_smoothing=0.1, sequence_length=T).loss.backward()
    return [(e.name, e.input_shapes) for e in prof.events() if e.name.startswith("aten::")]


@pytest.mark.parametrize("plan", ["rows", "eager"])
def test_the_locked_step_is_the_same_operators_on_the_same_shapes_for_any_batch(plan):
    """What a graph replays holds for every batch of its shape: the mask depends on the
    shapes and the generator only (batches differing in values and ignored rows)."""
    head = make_head()
    head.loss_options = LossOptions(plan=plan, rows=6, columns=7)
    steps = []
    for seed in range(3):  # the first warms up: the next two are compared
        hidden, target = batch(seed=seed + 10)
        target[: 1 + 4 * seed] = -100
        head.zero_grad(set_to_none=True)
        steps.append(_dispatched(head, hidden.requires_grad_(True), target))
    assert steps[1] == steps[2]
    assert ("aten::bernoulli_", [[B, 1, K * D], [], []]) in steps[1]


def test_a_copy_of_the_head_keeps_the_option():
    head = make_head()
    assert copy.deepcopy(head).locked_dropout and MoSHead.takes_sequence_length


def test_a_batch_of_no_rows():
    """N = 0 with the rows' layout (an empty batch): the locked mask of no sequence reshaped
    rows of no size (``view(0, -1)``) and failed; now loss 0 and zero gradients, as the
    contract's ``check_empty_batch`` states, on every plan, in training and evaluation."""
    check_empty_batch(make_head)
