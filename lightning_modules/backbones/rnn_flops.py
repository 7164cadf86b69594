"""FLOP formulas for the fused LSTM kernels, so that ``torch.utils.flop_counter`` (Lightning's
model summary, ``app.bench``) counts the recurrence instead of 0.

``nn.LSTM`` runs as one oneDNN op on a CPU (``mkldnn_rnn_layer``) and one cuDNN op on a GPU
(``_cudnn_rnn``), which PyTorch's counter has no formula for; other devices decompose it into
matrix products that it counts already. Each time step multiplies the input by ``W_ih`` and
the previous state by ``W_hh`` (``[4H, I]``, ``[4H, H]``; ``W_hr`` with projections): 2 FLOPs
per multiply-add, ``2 T B sum(rows x cols)`` for the forward and twice that for the backward
(the input's and the weights' gradients). Registered once, at import.
"""

from __future__ import annotations

from math import prod
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

aten = torch.ops.aten


def recurrent_flops(input_shape: Any, weight_shapes: list[Any]) -> int:
    """Forward FLOPs of an RNN layer stack over an input ``[T, B, I]`` (or ``[B, T, I]``):
    every 2-D weight is applied once per time step and sequence."""
    steps = prod(input_shape[:2]) if len(input_shape) == 3 else input_shape[0]
    return 2 * steps * sum(s[0] * s[1] for s in weight_shapes if s is not None and len(s) == 2)


@register_flop_formula(aten.mkldnn_rnn_layer)
def _mkldnn_rnn_layer_flop(input_shape, w_ih, w_hh, *args, out_shape=None, **kwargs) -> int:
    return recurrent_flops(input_shape, [w_ih, w_hh])


@register_flop_formula(aten.mkldnn_rnn_layer_backward)
def _mkldnn_rnn_layer_backward_flop(input_shape, w_ih, w_hh, *args, out_shape=None, **kwargs):
    return 2 * recurrent_flops(input_shape, [w_ih, w_hh])


@register_flop_formula(aten._cudnn_rnn)
def _cudnn_rnn_flop(input_shape, weights, *args, out_shape=None, **kwargs) -> int:
    return recurrent_flops(input_shape, weights)


@register_flop_formula(aten._cudnn_rnn_backward)
def _cudnn_rnn_backward_flop(input_shape, weights, *args, out_shape=None, **kwargs) -> int:
    return 2 * recurrent_flops(input_shape, weights)
