"""A head's training step as CUDA graphs: the forward and backward of its loss captured once per
batch shape and replayed (opt-in: a task's ``cuda_graphs``, the benchmark's ``+graphs``).

Why: at the sizes of a PTB language model a head's step is launch-bound on a GPU. On an H100
(docs/results/profile_gpu_heads_10k.json, V = 10k, 16,384 tokens) Mixtape's rows plan spent
5.3 ms on the host dispatching 119 kernels that ran 4.0 ms, and softmax's 2.6 ms for 1.5 ms;
the whole PTB LM's step (700 tokens) 5.7 ms on the host for 2.0 ms of kernels
(profile_gpu_lm_ptb_step.json). A replayed graph launches all of a step's kernels at once: the
host's share of the head's step becomes two copies in, one replay, three small copies out.

How: the head's training loss, ``(hidden, target) -> (loss, nll, aux_loss)``, warmed up on a
side stream, then its forward and its backward each captured as a graph (:func:`capture_cuda`),
replayed through an autograd function (:class:`_Replay`) that takes the head's parameters as
inputs, so that autograd still accumulates their gradients (and DDP's hooks still fire) outside
the graphs. A head can be captured when its step is a function of its batch's shape alone: no
host reads (the sync sentinels of ``tests/lightning_modules/test_host_sync.py`` prove it on the
CPU for every head) and no sizes read from the data. DS-Softmax (its experts' sizes) is not:
:func:`check_capturable` refuses it. The adaptive softmax is where it runs every classifier on
every row (a dense step: ``Head.step_capturable``), and over that budget where its clusters'
sizes are counted on the host (the tasks do: ``Head.expect_targets``) and its plan is the
whole-loss ``rows``: each tail cluster then runs on a fixed number of row slots, a margin over
the sizes seen, which the head names as part of the graph's key (``Head.capture_key``); a
batch whose cluster outgrows its slots gets wider ones, captured anew (the graph they replace
dropped). Other steps over the budget run eagerly.

Why not :func:`torch.cuda.make_graphed_callables`, which does the same: on an H100 (2026-11-27)
it failed every language model with tied embeddings. Its capture differentiates the head's own
parameters, and a tied weight's gradient accumulator was made on the default stream by the
step's embedding lookup, still alive: autograd made the default stream wait on the capturing
one (``cudaErrorStreamCaptureImplicit``). This capture differentiates fresh leaves that share
the parameters' storage (the same memory, so the graphs read the parameters as they are
updated). And its backward hands autograd the graph's own gradient buffers, which a parameter
with no gradient yet keeps as its ``.grad``: accumulating over two steps
(``accumulate_grad_batches``) then read the second step's gradient twice and the first one's
never. :class:`_Replay` copies such a gradient out before the next replay writes over it.

What a user sees:

- Graphs are kept for at most :data:`MAX_SHAPES` batch shapes (a language model's windows and
  an epoch's shorter last one); any other shape, or one whose step the head says depends on
  the batch, runs eagerly (logged once). Each holds its step's memory for good, as a private
  pool.
- The first step of each shape runs the loss 3 times (warm-up) and captures it: runs seeded
  alike with and without graphs then draw different dropout masks.
- Evaluation, ``no_grad`` steps and devices other than CUDA run eagerly, as do steps whose
  parameters were replaced (new storage: the graphs are captured again) or whose options
  changed (label smoothing, precision, loss plan, the rows' sequence length: each is part of
  the shape's key). A locked dropout's masks (MoS, Mixtape: ``locked_dropout``) are drawn
  inside the graph from the generator, one per sequence, as any dropout's.
- The outputs are copies: a graph's own outputs are overwritten by its next replay. A step is
  one forward then its backward, as the tasks run it: a second loss of the same shape before
  the first one's backward would overwrite what that backward reads, and is refused; so is a
  step's second backward (``retain_graph``) or one after a later step's forward: the backward
  graph consumes what its forward left (the rows plans scale their stored gradients in place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable

import torch

from heads.base import Head, HeadOutput
from heads.errors import HeadConfigError

log = logging.getLogger(__name__)

# batch shapes captured per head; further ones run eagerly
MAX_SHAPES = 2
# where steps are captured (the tests add "cpu" with a stand-in for capture_cuda)
GRAPH_DEVICES: set[str] = {"cuda"}


def check_capturable(head: Head) -> None:
    """Refuse, in one line naming the fix, a head whose training step cannot be a CUDA graph
    (``Head.capturable``)."""
    if not head.capturable:
        raise HeadConfigError(
            f"cuda_graphs: {type(head).__name__}'s training step cannot be captured as a CUDA "
            f"graph: {head.capture_blocker}; set cuda_graphs false for this head"
        )


@dataclasses.dataclass(frozen=True)
class CapturedStep:
    """A function's forward and backward as graphs over fixed tensors: ``inputs`` (written
    before a replay), ``outputs`` and ``grads`` (rewritten by each replay), ``grad_outputs``
    (where the backward's incoming gradients go; None for an output with none)."""

    replay_forward: Callable[[], None]
    replay_backward: Callable[[], None]
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    grad_outputs: tuple[torch.Tensor | None, ...]
    grads: tuple[torch.Tensor | None, ...]  # per input: None where none flows (or none wanted)
    held_bytes: int = 0  # device memory kept for the replays: the pool, the static copies


Grads = tuple[torch.Tensor | None, ...]


def _differentiate(outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
                   grad_outputs: Grads) -> Grads:  # fmt: skip
    """The gradients of ``outputs`` (those with a gradient) for each of ``inputs``: None for an
    input that wants none or that they do not use."""
    wanted = [i for i in inputs if i.requires_grad]
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if g is not None]
    found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                     allow_unused=True) if pairs and wanted else ())  # fmt: skip
    return tuple(next(found, None) if i.requires_grad else None for i in inputs)


def capture_cuda(function: Callable[..., tuple[torch.Tensor, ...]],
                 inputs: tuple[torch.Tensor, ...], warmup: int = 3) -> CapturedStep:  # fmt: skip
    """``function(*inputs)`` and its backward captured as two CUDA graphs sharing one private
    memory pool, after ``warmup`` runs on a side stream (lazy initialisation, autotuning and
    compilation stay out of the graphs), as :func:`torch.cuda.make_graphed_callables` does.
    The capture is thread-local: a data loader's pinning thread or DDP's watchdog may use
    CUDA meanwhile."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(warmup):
            outputs = function(*inputs)
            ones = tuple(torch.ones_like(o) if o.requires_grad else None for o in outputs)
            _differentiate(outputs, inputs, ones)
        del outputs, ones
    torch.cuda.synchronize()
    forward, backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(forward, capture_error_mode="thread_local"):
            outputs = function(*inputs)
        grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in outputs)
        with torch.cuda.graph(backward, pool=forward.pool(), capture_error_mode="thread_local"):
            grads = _differentiate(outputs, inputs, grad_outputs)
    except BaseException:
        # the failed graphs go now, not with the traceback that holds this frame (a newer
        # torch's graph gives its generator states back as it goes)
        forward = backward = outputs = None
        _release_generator(inputs[0].device)
        raise
    # the pool's segments (as torch's own cudagraph trees find them) and the static copies
    # made outside it (the parameters' leaves share the parameters' memory)
    pool = forward.pool()
    held = sum(
        s["total_size"] for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] == pool
    )
    held += sum(t.nbytes for t in (*inputs[:2], *grad_outputs) if t is not None)
    return CapturedStep(forward.replay, backward.replay, inputs,
                        tuple(o.detach() for o in outputs), grad_outputs, grads, held)  # fmt: skip


def _release_generator(device: torch.device) -> None:
    """After a failed capture: the device's default random generator out of capture mode. A
    capture whose end fails (torch 2.11, an H100) leaves it there, and every later random op
    of the process (a dropout, the next test's) raised "Offset increment outside graph
    capture encountered unexpectedly"; a clone of its state (its seed and offset) takes its
    place, outside any capture."""
    try:
        torch.empty(1, device=device).uniform_()  # draws: raises while the generator is stuck
    except RuntimeError:
        index = device.index if device.index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        generator.graphsafe_set_state(generator.clone_state())


class _Replay(torch.autograd.Function):
    """One replay of a captured loss: ``(graph, hidden, target, *parameters) -> (loss, nll,
    aux)``, copies of the graph's outputs; the backward replays the backward graph and hands
    out its gradients. A parameter (or a leaf ``hidden``) whose ``.grad`` is still the graph's
    own buffer, kept by autograd from the last backward, gets a copy of it first: the next
    replay writes over that buffer."""

    @staticmethod
    def forward(ctx, graph: _Graph, *inputs: torch.Tensor):
        step, (hidden, _, *parameters) = graph.step, inputs
        graph.release_gradients(parameters)
        for static, given in zip(step.inputs[:2], inputs[:2], strict=True):
            if given.data_ptr() != static.data_ptr():
                static.copy_(given)
        step.replay_forward()
        graph.replays += 1
        loss, nll, aux = (o.clone() for o in step.outputs)
        ctx.graph, ctx.hidden_keeps_grad = graph, hidden.is_leaf or hidden.retains_grad
        ctx.replay = graph.replays
        ctx.mark_non_differentiable(nll, *(() if graph.aux_requires_grad else (aux,)))
        return loss, nll, aux

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_loss: torch.Tensor, d_nll: torch.Tensor, d_aux: torch.Tensor):
        graph = ctx.graph
        step = graph.step
        if ctx.replay != graph.replays or not graph.pending:
            # the backward graph reads what the last forward replay left and consumes it (the
            # rows plans scale their stored gradients in place: rows_ce.scaled_gradients):
            # a second backward (retain_graph) or one after a later step would be wrong
            raise RuntimeError(
                "cuda_graphs: a graphed step's backward runs once, right after its forward; "
                "this one ran again (retain_graph) or after a later step's forward: set "
                "cuda_graphs false to differentiate a step's loss more than once"
            )
        for static, grad in zip(step.grad_outputs, (d_loss, d_nll, d_aux), strict=True):
            if static is not None:
                static.copy_(grad)
        step.replay_backward()
        graph.pending = False
        d_hidden, d_target, *d_parameters = (None if g is None else g.detach() for g in step.grads)
        if d_hidden is not None and ctx.hidden_keeps_grad:  # as .grad: not the graph's buffer
            d_hidden = d_hidden.clone()
        return None, d_hidden, d_target, *d_parameters


class _Graph:
    """One captured shape: its :class:`CapturedStep` over ``(hidden, target, *parameters)``,
    whether its aux loss is differentiable (the head's may not be) and whether its last
    replay's backward is still to run (``pending``: a replay before it would overwrite what
    that backward reads, and give it the new batch's gradient)."""

    def __init__(self, step: CapturedStep, aux_requires_grad: bool) -> None:
        self.step = step
        self.aux_requires_grad = aux_requires_grad
        self.pending = False
        self.replays = 0  # forward replays so far: which step a backward belongs to

    def replay(self, hidden: torch.Tensor, target: torch.Tensor, head: Head,
               parameters: tuple[torch.Tensor, ...]) -> HeadOutput:  # fmt: skip
        """The loss of this batch, as copies (the graph's outputs are its static buffers,
        rewritten by its next replay)."""
        if self.pending:
            raise RuntimeError(
                f"cuda_graphs: {type(head).__name__}'s training loss was computed again for a "
                f"batch of this shape before the last one's backward ran; a graph holds one "
                f"step at a time (forward, then its backward): set cuda_graphs false to "
                f"compute several losses before a backward"
            )
        loss, nll, aux = _Replay.apply(self, hidden, target, *parameters)
        self.pending = loss.requires_grad
        return HeadOutput(loss=loss, nll=nll, aux_loss=aux)

    def release_gradients(self, parameters: list[torch.Tensor]) -> None:
        """A copy for each parameter's ``.grad`` that is the graph's gradient buffer."""
        for parameter, buffer in zip(parameters, self.step.grads[2:], strict=True):
            grad = parameter.grad
            if grad is not None and buffer is not None and grad.data_ptr() == buffer.data_ptr():
                parameter.grad = grad.clone()


def _capture_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """The caller's autocast without its cast cache, which a capture must not use (casts
    cached outside a graph would be freed under it)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


class GraphedTrainingLoss:
    """``head(hidden, target, label_smoothing=eps)`` in training, by CUDA graphs (module
    docstring); called like the head. ``capture``: what captures (the tests' stand-in; by
    default :func:`capture_cuda`)."""

    def __init__(self, head: Head, max_shapes: int = MAX_SHAPES,
                 capture: Callable[..., CapturedStep] | None = None) -> None:  # fmt: skip
        check_capturable(head)
        self.head = head
        self.max_shapes = max_shapes
        self.capture = capture
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

    @property
    def held_bytes(self) -> int:
        """Device memory the captured shapes keep between steps (their pools and copies)."""
        return sum(graph.step.held_bytes for graph in self._graphs.values())

    def applies(self, hidden: torch.Tensor) -> bool:
        """Whether this call is one graphs run: a training step with gradients, on a device
        that captures, outside ``torch.compile``'s tracing."""
        return (
            self.head.training
            and torch.is_grad_enabled()
            and hidden.device.type in GRAPH_DEVICES
            and not torch.compiler.is_compiling()
        )

    def __call__(self, hidden: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                 sequence_length: int | None = None) -> HeadOutput:  # fmt: skip
        """The head's loss; ``sequence_length``, the rows' layout (``Head.forward``), is
        given to the head where not None (the task gives it only to a head that takes it) and
        is part of the graph's key: a locked dropout's masks are drawn in the graph for it."""
        options = {"label_smoothing": label_smoothing}
        if sequence_length is not None:
            options["sequence_length"] = sequence_length
        if not self.applies(hidden):
            return self.head(hidden, target, **options)
        parameters = tuple(self.head.parameters())  # walked once a step: a host-bound path
        self._forget_replaced_parameters(parameters)
        head_key = self.head.capture_key(hidden, label_smoothing)
        key = (*self._key(hidden, target, label_smoothing, sequence_length), head_key)
        graph = self._graphs.get(key)
        if graph is None:
            if key in self._eager_shapes or not self._may_capture(key, hidden, head_key):
                return self.head(hidden, target, **options)
            graph = self._capture(hidden, target, options, head_key)
            self._graphs[key] = graph
        return graph.replay(hidden, target, self.head, parameters)

    def _key(self, hidden: torch.Tensor, target: torch.Tensor, label_smoothing: float,
             sequence_length: int | None = None) -> tuple:  # fmt: skip
        device = hidden.device.type
        autocast = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device)
        return (tuple(hidden.shape), hidden.dtype, hidden.requires_grad, hidden.device,
                tuple(target.shape), target.dtype, float(label_smoothing), autocast,
                self.head.loss_options, sequence_length)  # fmt: skip

    def _forget_replaced_parameters(self, parameters: tuple[torch.Tensor, ...]) -> None:
        """Drop every graph once a parameter's storage or trainability changed (a graph
        reads the storage it was captured with)."""
        now = tuple((p.data_ptr(), p.requires_grad) for p in parameters)
        if now != self._parameters:
            self._graphs.clear()
            self._eager_shapes.clear()
            self._parameters = now

    def _may_capture(self, key: tuple, hidden: torch.Tensor, head_key: tuple | None) -> bool:
        """Whether a new shape is captured: a step the head can build for its shape
        (``Head.capture_key`` not None) within :data:`MAX_SHAPES` (a graph the head's key
        supersedes, built for this shape with other static sizes, is dropped first: its
        memory held for a layout the head no longer builds); else it runs eagerly from now
        on, each reason said once."""
        if head_key is None:
            why = f"{type(self.head).__name__}'s step of this shape depends on the batch"
        else:
            for old in [k for k in self._graphs if k[:-1] == key[:-1]]:
                del self._graphs[old]
            if len(self._graphs) < self.max_shapes:
                return True
            why = f"{self.max_shapes} batch shapes are captured already"
        self._eager_shapes.add(key)
        if why not in self._reasons_said:  # once a reason: varying shapes would say it a lot
            self._reasons_said.add(why)
            log.warning("cuda_graphs: %s; hidden %s and such shapes run eagerly", why,
                        tuple(hidden.shape))  # fmt: skip
        return False

    def _capture(self, hidden: torch.Tensor, target: torch.Tensor, options: dict,
                 head_key: tuple) -> _Graph:  # fmt: skip
        """Warm up and capture the loss's forward and backward on copies of this batch and
        on fresh leaves sharing the parameters' storage (the graphs' static inputs), the head
        building the step its ``head_key`` names; ``options``: the head's keywords (label
        smoothing, the rows' layout)."""
        names = [name for name, _ in self.head.named_parameters()]
        head, aux_requires_grad = self.head, []

        def training_loss(hidden: torch.Tensor, target: torch.Tensor, *parameters: torch.Tensor):
            # the NLL detached: it feeds metrics, and the backward would otherwise run its own
            # pass with zeros
            swapped = dict(zip(names, parameters, strict=True))
            with head.captured_as(head_key):  # the step the head's key names
                out = torch.func.functional_call(head, swapped, (hidden, target), options)
            aux_requires_grad.append(out.aux_loss.requires_grad)
            return out.loss, out.nll.detach(), out.aux_loss

        leaves = tuple(p.detach().requires_grad_(p.requires_grad) for p in head.parameters())
        inputs = (hidden.detach().clone().requires_grad_(hidden.requires_grad), target.clone(),
                  *leaves)  # fmt: skip
        capture = self.capture or capture_cuda
        try:
            with _capture_autocast(hidden.device.type):
                step = capture(training_loss, inputs, warmup=3)
        except Exception as error:  # noqa: BLE001 - named, with the option to turn off
            raise HeadConfigError(
                f"cuda_graphs: capturing {type(self.head).__name__}'s training step failed "
                f"({type(error).__name__}: {error}); set cuda_graphs false to run it eagerly"
            ) from error
        log.info("cuda_graphs: captured %s's training step for hidden %s",
                 type(self.head).__name__, tuple(hidden.shape))  # fmt: skip
        return _Graph(step, aux_requires_grad[-1])
