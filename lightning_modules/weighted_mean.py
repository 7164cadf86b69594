"""A weighted mean over an epoch's updates that reads nothing back to the host, and the sums'
dtype rule the tasks' metrics share (:class:`FloatSums`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torchmetrics import Metric


def sums_dtype(*dtypes: torch.dtype | None) -> torch.dtype:
    """The dtype an epoch's sums accumulate in: float64 if any of ``dtypes`` is, else float32
    (never bfloat16 or float16: a bfloat16 sum stops growing once it is 256 times a term)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


class FloatSums(Metric):
    """A metric whose states are sums kept in float32, or float64 where the model is.

    torchmetrics converts a metric's states on ``module.to(dtype=...)``, which is how Lightning
    makes a model ``bf16-true`` or ``16-true`` (``HalfPrecision.convert_module``): the epoch's
    sums were then accumulated in bfloat16 (1,000 updates of 5.3 x 700 tokens gave a mean of
    4.0 over 262,144 tokens). It ignores ``module.double()``, how Lightning makes a model
    ``64-true`` (``DoublePrecision.convert_module``): the float64 run's losses were summed in
    float32 and its ``val/ppl`` could not differ from a float32 run's. Here every conversion of
    the module leaves the states in :func:`sums_dtype` of the dtype it converts floats to and
    theirs: float32 under half precisions, float64 once the model is made float64 (on every
    DDP rank alike, before any update), and an update with float64 values promotes them too.
    """

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any):
        this = super()._apply(fn, *args, **kwargs)
        probe = fn(torch.zeros(()))  # the dtype this conversion gives a float32 tensor
        converted = probe.dtype if isinstance(probe, torch.Tensor) else None
        self.accumulate_in(sums_dtype(converted, self._sums_dtype()))
        return this

    def _sums_dtype(self) -> torch.dtype | None:
        states = [getattr(self, name) for name in self._defaults]
        return next((s.dtype for s in states if isinstance(s, torch.Tensor)), None)

    def accumulate_in(self, dtype: torch.dtype) -> None:
        """States (and the defaults ``reset`` restores) in ``dtype``; nothing if they are."""
        states = [*self._defaults.values(), *(getattr(self, n) for n in self._defaults)]
        if any(isinstance(s, torch.Tensor) and s.dtype != dtype for s in states):
            self.set_dtype(dtype)  # re-enters _apply, which then finds them converted

    def promote_for(self, value: torch.Tensor) -> None:
        """Before an update with ``value``: float64 values (a float64 model not converted by
        ``double()``) are summed in float64, and sums restored in a half dtype (an older
        mid-epoch checkpoint's) in float32 at least."""
        self.accumulate_in(sums_dtype(value.dtype, self._sums_dtype()))


class WeightedMean(FloatSums):
    """``sum(w x) / sum(w)`` over the updates, reduced over the DDP ranks (the tasks' token-
    weighted mean NLL, the share of hits over the tokens not ignored).

    Why not torchmetrics' ``MeanMetric``: its default ``nan_strategy`` tests ``isnan(x).any()``
    in every update (a host sync per step), and ``"disable"``, the one setting that does not,
    replaces the given weights by ones in torchmetrics 1.9 (``BaseAggregator.
    _cast_and_nan_check_input``): a mean of batch means, where a 5-token last window or a short
    translation batch counts as much as a full one. NaNs are not looked for here either: a NaN
    loss stops the run (``check_finite_loss``). The sums are float32, float64 under ``64-true``
    (:class:`FloatSums`).

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
        self.promote_for(value)
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
