"""Inputs shared by the loss kernels' tests."""

import torch

from heads.cross_entropy import IGNORE_INDEX


def float64_case(rows=11, classes=23, dim=6, seed=0, bias=True):
    """``(hidden, W, b, target)`` in float64 needing gradients; rows 2 and 7 ignored."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(classes, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(classes, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, classes, (rows,), generator=gen)
    target[[2, 7] if rows > 7 else []] = IGNORE_INDEX
    return hidden, weight, b if bias else None, target
