"""A weighted mean over an epoch's updates that reads nothing back to the host."""

from __future__ import annotations

import torch
from torchmetrics import Metric


class WeightedMean(Metric):
    """``sum(w x) / sum(w)`` over the updates, reduced over the DDP ranks (the tasks' token-
    weighted mean NLL, the share of hits over the tokens not ignored).

    Why not torchmetrics' ``MeanMetric``: its default ``nan_strategy`` tests ``isnan(x).any()``
    in every update (a host sync per step), and ``"disable"``, the one setting that does not,
    replaces the given weights by ones in torchmetrics 1.9 (``BaseAggregator.
    _cast_and_nan_check_input``): a mean of batch means, where a 5-token last window or a short
    translation batch counts as much as a full one. NaNs are not looked for here either: a NaN
    loss stops the run (``check_finite_loss``).

    ``weight``: a tensor broadcast against ``value`` (counts, 0/1 masks), or a number, which
    multiplies on the device with no host-to-device copy.
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("weighted_sum", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("weight", torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, weight: torch.Tensor | float = 1.0) -> None:
        value = value.detach().to(self.weighted_sum.dtype)
        if isinstance(weight, torch.Tensor):
            value, weight = torch.broadcast_tensors(value, weight.detach().to(value.dtype))
            self.weighted_sum += (value * weight).sum()
            self.weight += weight.sum()
        else:
            self.weighted_sum += value.sum() * weight
            self.weight += value.numel() * weight

    def compute(self) -> torch.Tensor:
        return self.weighted_sum / self.weight
