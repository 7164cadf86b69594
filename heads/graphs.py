"""A head's training step as CUDA graphs: the forward and backward of its loss captured once per
batch shape and replayed (opt-in: a task's ``cuda_graphs``, the benchmark's ``+graphs``).

Why: at the sizes of a PTB language model a head's step is launch-bound on a GPU. On an H100
(docs/results/profile_gpu_heads_10k.json, V = 10k, 16,384 tokens) Mixtape's rows plan spent
5.3 ms on the host dispatching 119 kernels that ran 4.0 ms, and softmax's 2.6 ms for 1.5 ms;
the whole PTB LM's step (700 tokens) 5.7 ms on the host for 2.0 ms of kernels
(profile_gpu_lm_ptb_step.json). A replayed graph launches all of a step's kernels at once: the
host's share of the head's step becomes two copies in, one replay, three small copies out.

How: :func:`torch.cuda.make_graphed_callables` on the head's training loss, ``(hidden, target)
-> (loss, nll, aux_loss)``, with the head's parameters as the graphs' inputs, so that autograd
still accumulates their gradients (and DDP's hooks still fire) outside the graphs. A head can
be captured when its step is a function of its batch's shape alone: no host reads (the sync
sentinels of ``tests/lightning_modules/test_host_sync.py`` prove it on the CPU for every head)
and no sizes read from the data. DS-Softmax (its experts' sizes) is not: :func:`check_capturable`
refuses it. The adaptive softmax is where it runs every classifier on every row (a dense
step: ``Head.step_capturable``); a step of a shape over that budget, whose clusters are sized
from each batch, runs eagerly.

What a user sees:

- Graphs are kept for at most :data:`MAX_SHAPES` batch shapes (a language model's windows and
  an epoch's shorter last one); any other shape, or one whose step the head says depends on
  the batch, runs eagerly (logged once). Each holds its step's memory for good, as a private
  pool.
- The first step of each shape runs the loss 3 times (warm-up) and captures it: runs seeded
  alike with and without graphs then draw different dropout masks.
- Evaluation, ``no_grad`` steps and devices other than CUDA run eagerly, as do steps whose
  parameters were replaced (new storage: the graphs are captured again) or whose options
  changed (label smoothing, precision, loss plan: each is part of the shape's key).
- The outputs are copies: a graph's own outputs are overwritten by its next replay. A step is
  one forward then its backward, as the tasks run it: a second loss of the same shape before
  the first one's backward would overwrite what that backward reads, and is refused.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from heads.base import Head, HeadOutput
from heads.errors import HeadConfigError

log = logging.getLogger(__name__)

# batch shapes captured per head; further ones run eagerly
MAX_SHAPES = 2
# where steps are captured (the tests add "cpu" with a stand-in for make_graphed_callables)
GRAPH_DEVICES: set[str] = {"cuda"}


def check_capturable(head: Head) -> None:
    """Refuse, in one line naming the fix, a head whose training step cannot be a CUDA graph
    (``Head.capturable``)."""
    if not head.capturable:
        raise HeadConfigError(
            f"cuda_graphs: {type(head).__name__}'s training step cannot be captured as a CUDA "
            f"graph: {head.capture_blocker}; set cuda_graphs false for this head"
        )


class _TrainingLoss(nn.Module):
    """The head's training loss as :func:`torch.cuda.make_graphed_callables` takes it: tensors
    in, tensors out, the head's parameters its own. The NLL is detached: it feeds metrics,
    and a graph's backward would otherwise run the NLL's own backward pass with zeros."""

    def __init__(self, head: Head, label_smoothing: float) -> None:
        super().__init__()
        self.head = head
        self.label_smoothing = label_smoothing
        self.aux_requires_grad = False  # set as the capture runs the head

    def forward(self, hidden: torch.Tensor, target: torch.Tensor):
        out = self.head(hidden, target, label_smoothing=self.label_smoothing)
        self.aux_requires_grad = out.aux_loss.requires_grad
        return out.loss, out.nll.detach(), out.aux_loss


class _Graph:
    """One captured shape: its graphed loss, whether its aux loss is differentiable (a
    graphed function's outputs all carry its backward; the head's may not) and whether its
    last replay's backward is still to run (``pending``: a replay before it would overwrite
    what that backward reads, and give it the new batch's gradient)."""

    def __init__(self, graphed: Callable, aux_requires_grad: bool) -> None:
        self.graphed = graphed
        self.aux_requires_grad = aux_requires_grad
        self.pending = False

    def replay(self, hidden: torch.Tensor, target: torch.Tensor, head: Head) -> HeadOutput:
        """The loss of this batch, as copies (the graph's outputs are its static buffers,
        rewritten by its next replay)."""
        if self.pending:
            raise RuntimeError(
                f"cuda_graphs: {type(head).__name__}'s training loss was computed again for a "
                f"batch of this shape before the last one's backward ran; a graph holds one "
                f"step at a time (forward, then its backward): set cuda_graphs false to "
                f"compute several losses before a backward"
            )
        loss, nll, aux = self.graphed(hidden, target)
        aux = aux.clone() if self.aux_requires_grad else aux.detach().clone()
        loss = loss.clone()
        if loss.requires_grad:
            self.pending = True
            loss.register_hook(self._backward_reached)
        return HeadOutput(loss=loss, nll=nll.detach().clone(), aux_loss=aux)

    def _backward_reached(self, grad: torch.Tensor) -> None:
        self.pending = False


def _capture_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """The caller's autocast without its cast cache, which a capture must not use (casts
    cached outside a graph would be freed under it)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


class GraphedTrainingLoss:
    """``head(hidden, target, label_smoothing=eps)`` in training, by CUDA graphs (module
    docstring); called like the head. ``grapher``: what captures (the tests' stand-in; by
    default :func:`torch.cuda.make_graphed_callables`)."""

    def __init__(self, head: Head, max_shapes: int = MAX_SHAPES,
                 grapher: Callable[..., Any] | None = None) -> None:  # fmt: skip
        check_capturable(head)
        self.head = head
        self.max_shapes = max_shapes
        self.grapher = grapher
        self._graphs: dict[tuple, _Graph] = {}
        self._parameters: tuple = ()
        self._eager_shapes: set[tuple] = set()
        self._reasons_said: set[str] = set()

    def __getstate__(self) -> dict:
        """Copied or pickled (a weight-averaging callback's deepcopy, a spawned process)
        without its graphs: the copy captures its own, for its own parameters."""
        return {**self.__dict__, "_graphs": {}, "_parameters": (), "_eager_shapes": set(),
                "_reasons_said": set()}  # fmt: skip

    @property
    def captured(self) -> int:
        """How many shapes are captured now."""
        return len(self._graphs)

    def applies(self, hidden: torch.Tensor) -> bool:
        """Whether this call is one graphs run: a training step with gradients, on a device
        that captures, outside ``torch.compile``'s tracing."""
        return (
            self.head.training
            and torch.is_grad_enabled()
            and hidden.device.type in GRAPH_DEVICES
            and not torch.compiler.is_compiling()
        )

    def __call__(self, hidden: torch.Tensor, target: torch.Tensor,
                 label_smoothing: float = 0.0) -> HeadOutput:  # fmt: skip
        if not self.applies(hidden):
            return self.head(hidden, target, label_smoothing=label_smoothing)
        self._forget_replaced_parameters()
        key = self._key(hidden, target, label_smoothing)
        graph = self._graphs.get(key)
        if graph is None:
            if key in self._eager_shapes or not self._may_capture(key, hidden):
                return self.head(hidden, target, label_smoothing=label_smoothing)
            graph = self._graphs[key] = self._capture(hidden, target, label_smoothing)
        return graph.replay(hidden, target, self.head)

    def _key(self, hidden: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> tuple:
        device = hidden.device.type
        autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
        return (tuple(hidden.shape), hidden.dtype, hidden.requires_grad, hidden.device,
                tuple(target.shape), target.dtype, float(label_smoothing), autocast,
                self.head.loss_options)  # fmt: skip

    def _forget_replaced_parameters(self) -> None:
        """Drop every graph once a parameter's storage or trainability changed (a graph
        reads the storage it was captured with)."""
        now = tuple((p.data_ptr(), p.requires_grad) for p in self.head.parameters())
        if now != self._parameters:
            self._graphs.clear()
            self._eager_shapes.clear()
            self._parameters = now

    def _may_capture(self, key: tuple, hidden: torch.Tensor) -> bool:
        """Whether a new shape is captured: within :data:`MAX_SHAPES`, and a step the head
        says is its shape's alone (``Head.step_capturable``); else it runs eagerly from now
        on, each reason said once."""
        if len(self._graphs) >= self.max_shapes:
            why = f"{self.max_shapes} batch shapes are captured already"
        elif not self.head.step_capturable(hidden):
            why = f"{type(self.head).__name__}'s step of this shape depends on the batch"
        else:
            return True
        self._eager_shapes.add(key)
        if why not in self._reasons_said:  # once a reason: varying shapes would say it a lot
            self._reasons_said.add(why)
            log.warning("cuda_graphs: %s; hidden %s and such shapes run eagerly", why,
                        tuple(hidden.shape))  # fmt: skip
        return False

    def _capture(self, hidden: torch.Tensor, target: torch.Tensor,
                 label_smoothing: float) -> _Graph:  # fmt: skip
        """Warm up and capture the loss's forward and backward on copies of this batch (the
        graphs' static inputs)."""
        module = _TrainingLoss(self.head, label_smoothing)
        sample = (hidden.detach().clone().requires_grad_(hidden.requires_grad), target.clone())
        grapher = self.grapher or torch.cuda.make_graphed_callables
        try:
            with _capture_autocast(hidden.device.type):
                graphed = grapher(module, sample, num_warmup_iters=3, allow_unused_input=True)
        except Exception as error:  # noqa: BLE001 - named, with the option to turn off
            raise HeadConfigError(
                f"cuda_graphs: capturing {type(self.head).__name__}'s training step failed "
                f"({type(error).__name__}: {error}); set cuda_graphs false to run it eagerly"
            ) from error
        log.info("cuda_graphs: captured %s's training step for hidden %s",
                 type(self.head).__name__, tuple(hidden.shape))  # fmt: skip
        return _Graph(graphed, module.aux_requires_grad)
