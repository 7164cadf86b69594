"""Checks every head must pass (DESIGN.md, "The head contract"). Used by each head's tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

from heads import IGNORE_INDEX, Head

HIDDEN, VOCAB, ROWS = 6, 23, 9


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


ALL_CHECKS = [
    check_log_prob_normalised,
    check_nll_matches_log_prob,
    check_ignored_positions,
    check_gradients,
    check_topk,
    check_bf16_autocast,
]
