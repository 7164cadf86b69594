"""heads/kernels/locked_dropout.py: one dropout mask per sequence of rows (the MoS code's
LockedDropout, in the rows' batch-major layout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from heads.kernels.locked_dropout import locked_dropout

B, T, FEATURES = 5, 7, 64


def test_one_mask_per_sequence_shared_by_its_steps_scaled_by_one_over_keep():
    torch.manual_seed(0)
    x = torch.rand(B * T, 4, FEATURES // 4, dtype=torch.float64) + 0.5  # no zero entries
    out = locked_dropout(x, 0.3, True, T)
    assert out.shape == x.shape
    ratio = (out / x).view(B, T, FEATURES)
    # every step of a sequence: the same mask
    torch.testing.assert_close(ratio, ratio[:, :1].expand(B, T, FEATURES), rtol=0, atol=1e-12)
    kept = ratio != 0
    assert kept.any() and (~kept).any()
    torch.testing.assert_close(ratio[kept], torch.full_like(ratio[kept], 1 / 0.7))
    # and sequences of their own
    masks = ratio[:, 0]
    assert all(not torch.equal(masks[a], masks[b]) for a in range(B) for b in range(a))


def test_the_mask_is_lockeddropouts_draw_in_the_rows_layout():
    """The MoS code draws ``x.data.new(1, B, F).bernoulli_(1 - p)`` over ``[T, B, F]``; here
    ``[B, 1, F]`` over rows ``b T + t``: the same generator calls, the same masks."""
    x = torch.randn(B * T, FEATURES)
    torch.manual_seed(3)
    out = locked_dropout(x, 0.4, True, T)
    torch.manual_seed(3)
    mask = torch.empty(B, 1, FEATURES).bernoulli_(0.6) / 0.6
    torch.testing.assert_close(out, (x.view(B, T, FEATURES) * mask).view(B * T, FEATURES))


def test_rows_past_whole_sequences_get_masks_of_their_own():
    """Padded rows (a static row count, ``lightning_modules/static_rows.py``) fall into
    sequences past the real ones: the real rows keep the masks of the first B sequences."""
    n = B * T + 3
    x = torch.randn(n, FEATURES)
    torch.manual_seed(4)
    out = locked_dropout(x, 0.5, True, T)
    torch.manual_seed(4)
    mask = torch.empty(B + 1, 1, FEATURES).bernoulli_(0.5) / 0.5
    rows = mask.expand(B + 1, T, FEATURES).reshape(-1, FEATURES)[:n]
    torch.testing.assert_close(out, x * rows)


def test_without_a_layout_it_is_pytorchs_dropout_and_in_evaluation_nothing():
    x = torch.randn(B * T, FEATURES)
    torch.manual_seed(5)
    out = locked_dropout(x, 0.3, True, None)
    torch.manual_seed(5)
    assert torch.equal(out, F.dropout(x, 0.3, True))
    assert locked_dropout(x, 0.3, False, T) is x
    assert locked_dropout(x, 0.0, True, T) is x
    assert torch.equal(locked_dropout(x, 1.0, True, T), torch.zeros_like(x))


def test_half_precision_rows_are_scaled_in_float32_and_rounded_once():
    x = torch.randn(B * T, FEATURES, dtype=torch.bfloat16)
    torch.manual_seed(6)
    out = locked_dropout(x, 0.29, True, T)
    torch.manual_seed(6)
    mask = torch.empty(B, 1, FEATURES).bernoulli_(0.71) / 0.71
    want = (x.float().view(B, T, FEATURES) * mask).to(torch.bfloat16).view(B * T, FEATURES)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)


def test_gradients_flow_through_the_kept_entries_only():
    x = torch.randn(B * T, FEATURES, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(7)
    out = locked_dropout(x, 0.5, True, T)
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(grad, (out / x).detach())


def test_compiled_locked_dropout_is_one_graph_whether_or_not_t_divides_the_rows():
    """A compiled head's padded row count N with AWD-LSTM's varying T: after the first T,
    one graph symbolic in T, whether T divides N (no partial sequence) or not; the masks
    those of the eager function. The rows padded to whole sequences only where T did not
    divide N were a guard, a second compilation of the loss per padded row count."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(locked_dropout)
    x = torch.randn(288, 6)
    for t in (64, 65, 66, 72, 70, 96, 71, 48):  # 288 = 4 x 72 = 3 x 96 = 6 x 48
        torch.manual_seed(0)
        got = compiled(x, 0.3, True, t)
        torch.manual_seed(0)
        want = locked_dropout(x, 0.3, True, t)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    torch._dynamo.reset()
