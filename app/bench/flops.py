"""Matrix-product FLOPs of one step, counted from the operators it runs (not a formula).

PyTorch's ``FlopCounterMode`` sees every aten op under the dispatcher, hand-written backwards
included, but its registry only knows the out-of-place products. The heads' loss functions
accumulate block products in place (``addmm_``) and reduce with ``mv``, so those are added
here; without them a Mixtape step counts 20% fewer FLOPs than it runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils import flop_counter

from heads.fused_cross_entropy import FUSED

aten = torch.ops.aten


def _addmm_flop(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    (rows, inner), (_, cols) = a_shape, b_shape
    return 2 * rows * inner * cols


def _baddbmm_flop(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    (batch, rows, inner), (_, _, cols) = a_shape, b_shape
    return 2 * batch * rows * inner * cols


def _mv_flop(matrix_shape, vector_shape, out_shape=None, **kwargs) -> int:
    rows, cols = matrix_shape
    return 2 * rows * cols


def _addmv_flop(self_shape, matrix_shape, vector_shape, out_shape=None, **kwargs) -> int:
    return _mv_flop(matrix_shape, vector_shape)


# The products the registry lacks, as raw shape formulas (the registry's own are already
# wrapped, and FlopCounterMode would wrap them a second time).
_EXTRA_FORMULAS = {
    aten.addmm_: _addmm_flop,
    aten.baddbmm_: _baddbmm_flop,
    aten.mv: _mv_flop,
    aten.addmv: _addmv_flop,
    aten.addmv_: _addmv_flop,
}


def matmul_flops(step: Callable[[], object]) -> int | None:
    """FLOPs (2 per multiply-add) of the matrix products that ``step()`` runs, forward and
    backward: ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv`` and their in-place forms.
    Elementwise work (softmax, tanh, the sigmoid tree) is not counted. Compiled functions
    inside the step (the GPU plan's chunk bodies) run eagerly here, so that their products
    are seen. None where the counter cannot read an operator's arguments (Liger's
    ``addmm(..., out=)`` trips PyTorch's formula)."""
    mode = flop_counter.FlopCounterMode(display=False, custom_mapping=_EXTRA_FORMULAS)
    try:
        with torch._dynamo.config.patch(disable=True), mode as counter:
            step()
    except TypeError:
        return None
    return int(counter.get_total_flops())


# products the FLOP counter (torch's FlopCounterMode) does not see: Triton's or the field's
# fused kernels (a count there is 0 or a fraction: the torch products around them)
OPAQUE_PRODUCTS = ("cce", "liger", FUSED)


def counted_products(name: str) -> bool:
    """Whether a subject's matrix products are torch's, which the FLOP counter counts."""
    head, _, backend = name.split("+")[0].partition("@")
    return head not in OPAQUE_PRODUCTS and backend not in OPAQUE_PRODUCTS
