"""Mixtape's dropouts on ``h_{c,k}`` (Eq. 5) and ``tanh(U_k g)`` (Eq. 4) locked over a
sequence (``locked_dropout``): one mask per sequence for each, shared by its T steps, as the
MoS code's latent dropout whose regularisation the paper follows for language modelling.

As for MoS (``test_mos_locked_dropout.py``): the test draws LockedDropout's masks from the
same seed, in the head's order (contexts, then gates), and compares loss, NLL and gradients
with Eq. 2-6 written plainly over the whole ``[N, V, K]`` in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from heads import MixtapeHead
from heads.fused_cross_entropy import LossOptions
from tests.heads.contract import check_empty_batch

HIDDEN, VOCAB, K, D, D2 = 6, 23, 4, 5, 3
B, T, P_CONTEXT, P_GATE = 3, 4, 0.4, 0.3

pytestmark = pytest.mark.usefixtures("one_thread")


def make_head(**options) -> MixtapeHead:
    torch.manual_seed(0)
    options = {"num_components": K, "frequent_ratio": 0.3, "gate_embedding_size": D2,
               "embedding_size": D, "context_dropout": P_CONTEXT, "gate_dropout": P_GATE,
               "locked_dropout": True, **options}  # fmt: skip
    return MixtapeHead(HIDDEN, VOCAB, **options).double().train()


def batch(rows: int = B * T, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, HIDDEN, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, VOCAB, (rows,), generator=gen)
    target[5] = -100
    return hidden, target


def locked_rows(rows: int, features: int, p: float) -> torch.Tensor:
    """``[rows, features]``: LockedDropout's draw, one mask per sequence of T rows."""
    sequences = -(-rows // T)
    mask = torch.empty(sequences, 1, features, dtype=torch.float64).bernoulli_(1 - p) / (1 - p)
    return mask.expand(sequences, T, features).reshape(sequences * T, features)[:rows]


def reference(head: MixtapeHead, hidden, target, context_mask, gate_mask, smoothing=0.0):
    """``(loss, nll)`` of Eq. 2-6 for K = 4 with the masked ``h_{c,k}`` and ``tanh(U_k g)``:
    the sigmoid tree's priors written out (Eq. 3), every token's gates over ``[N, V, K-1]``."""
    n, s = hidden.size(0), head.num_frequent
    h = torch.tanh(F.linear(hidden, head.context.weight, head.context.bias)) * context_mask
    gate = torch.tanh(F.linear(hidden, head.gate_projection.weight, head.gate_projection.bias))
    gate = (gate * gate_mask).view(n, K - 1, D2)
    shared = hidden @ head.gate_context.weight.T  # [N, K-1]: u_k . g (Eq. 6)
    frequent = torch.einsum("njd,xd->nxj", gate, head.gate_embedding)
    frequent = frequent + shared[:, None] + head.gate_bias[None]  # Eq. 4
    rare = shared[:, None].expand(n, VOCAB - s, K - 1)
    g1, g2, g3 = torch.sigmoid(torch.cat((frequent, rare), 1)).unbind(-1)
    priors = torch.stack((g1 * g2, g1 * (1 - g2), (1 - g1) * g3, (1 - g1) * (1 - g3)), -1)
    values = torch.einsum("nkd,xd->nxk", h.view(n, K, D), head.weight)  # h_{c,k} . w_x
    log_p = torch.log_softmax((priors * values).sum(-1) + head.bias, dim=-1)  # Eq. 2
    keep = target != -100
    nll = torch.where(keep, -log_p.gather(1, target.clamp_min(0)[:, None])[:, 0], 0.0)
    smooth = torch.where(keep, -log_p.mean(-1), 0.0)
    return ((1 - smoothing) * nll + smoothing * smooth).sum() / keep.sum(), nll


def outputs(loss, nll, hidden, head) -> list[torch.Tensor]:
    return [loss, nll, *torch.autograd.grad(loss, [hidden, *head.parameters()])]


def assert_same(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize(
    "plan", ["plain", "rows", "eager", pytest.param("compiled", marks=pytest.mark.slow)]
)  # compiled: ~15 s of tracing on 2 cores
def test_one_mask_per_sequence_for_contexts_and_gates(plan, smoothing, monkeypatch):
    """Every plan (plain maths; rows: the whole softmax by row tiles; eager: the frequent
    block by columns; compiled: CUDA's compiled pieces, here through aot_eager) equals Eq. 2-6
    with LockedDropout's masks; masks per row do not."""
    import heads.kernels.compiled_lse as compiled_lse

    monkeypatch.setattr(compiled_lse, "COMPILE_BACKEND", "aot_eager")
    head = make_head()
    head.loss_options = LossOptions(plan=plan, rows=6, columns=4)
    hidden, target = batch()
    torch.manual_seed(2)
    out = head(hidden, target, label_smoothing=smoothing, sequence_length=T)
    got = outputs(out.loss, out.nll, hidden, head)
    torch.manual_seed(2)
    contexts = locked_rows(B * T, K * D, P_CONTEXT)
    gates = locked_rows(B * T, (K - 1) * D2, P_GATE)
    assert not torch.equal(contexts[0], contexts[T]) and torch.equal(contexts[0], contexts[1])
    want = outputs(*reference(head, hidden, target, contexts, gates, smoothing), hidden, head)
    assert_same(got, want)
    torch.manual_seed(2)
    per_row = F.dropout(torch.ones(B * T, K * D, dtype=torch.float64), P_CONTEXT, True)
    per_row_gates = F.dropout(torch.ones(B * T, (K - 1) * D2, dtype=torch.float64), P_GATE, True)
    row_loss, _ = reference(head, hidden, target, per_row, per_row_gates, smoothing)
    assert not torch.allclose(row_loss, got[0])
    torch._dynamo.reset()


@pytest.mark.parametrize("plan", ["plain", "rows"])
def test_padded_rows_leave_the_real_rows_loss_and_gradients_alone(plan):
    head = make_head()
    head.loss_options = LossOptions(plan=plan, rows=6, columns=4)
    hidden, target = batch()
    rows = B * T + 5
    padded = F.pad(hidden.detach(), (0, 0, 0, 5)).requires_grad_(True)
    torch.manual_seed(3)
    out = head(padded, F.pad(target, (0, 5), value=-100), sequence_length=T)
    got = outputs(out.loss, out.nll, padded, head)
    got[1], got[2] = got[1][: B * T], got[2][: B * T]
    torch.manual_seed(3)
    contexts = locked_rows(rows, K * D, P_CONTEXT)[: B * T]
    gates = locked_rows(rows, (K - 1) * D2, P_GATE)[: B * T]
    assert_same(got, outputs(*reference(head, hidden, target, contexts, gates), hidden, head))


def test_evaluation_draws_no_mask():
    head = make_head().eval()
    twin = make_head(context_dropout=0.0, gate_dropout=0.0).eval()
    hidden, target = batch()
    state = torch.random.get_rng_state()
    out = head(hidden, target, sequence_length=T)
    assert torch.equal(torch.random.get_rng_state(), state)
    want = twin(hidden, target)
    assert torch.equal(out.loss, want.loss) and torch.equal(out.nll, want.nll)


@pytest.mark.parametrize("plan", ["plain", "rows", "eager"])
def test_by_default_and_without_a_layout_a_mask_per_row_as_before(plan):
    """``locked_dropout`` false with a layout, or true without one (translation): the masks
    per row of ``F.dropout``, bit for bit the same step, gate noise included."""
    hidden, target = batch()
    results = []
    for locked, layout in [(False, T), (False, None), (True, None)]:
        head = make_head(locked_dropout=locked, gate_noise=0.1)
        head.loss_options = LossOptions(plan=plan, rows=6, columns=4)
        torch.manual_seed(5)
        h = hidden.detach().clone().requires_grad_(True)
        options = {} if layout is None else {"sequence_length": layout}
        out = head(h, target, label_smoothing=0.1, **options)
        results.append(outputs(out.loss, out.nll, h, head))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def test_a_batch_of_no_rows():
    """N = 0 with the rows' layout (an empty batch), both dropouts locked and gate noise on:
    loss 0 and zero gradients on every plan (the contract's ``check_empty_batch``)."""
    check_empty_batch(lambda: make_head(gate_noise=0.1))
