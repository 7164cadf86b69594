"""What the benchmark times: heads, the peer and limit rows, and whole language models.

A subject is named ``<head>[@<backend>][+compile][+graphs]``: one of our heads (``HEADS``)
with its fused loss on a given backend (``heads/fused_cross_entropy.py``; default
``--loss-backend``), under ``torch.compile`` and/or with its training step as CUDA graphs
(``heads/graphs.py``; eager on a CPU), e.g. ``softmax@cce``, ``mixtape+compile`` or
``mixtape@rows+graphs``; or a peer
(``PEERS``): PyTorch's adaptive softmax, the bare matmul (the machine's limit), and on CUDA
the field's fused linear cross-entropy kernels on the softmax, Apple's cut-cross-entropy
(``cce``) and Liger-Kernel's (``liger``).

Our heads are built from the CLI's head fragments (``configs/heads/<head>.yaml``, e.g. Mixtape
with its dropouts, gate noise and weight norm) through jsonargparse, as ``cli.py`` builds
``--model.head``: the benchmark times the head users train.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import ArgumentError, ArgumentParser
from torch import nn

from heads import Head
from heads.fused_cross_entropy import (
    BACKENDS,
    FUSED,
    LossOptions,
    external_loss_function,
    measured_options,
)
from heads.graphs import GraphedTrainingLoss
from lightning_modules.backbones import LSTMBackbone

HEADS = ("softmax", "mixtape", "mos", "adaptive")
PEERS = ("torch_adaptive", "matmul", "cce", "liger")
# @checkpoint: plain maths per chunk under torch.utils.checkpoint (no hand-written backward).
# @eager: the torch backend's CPU-tuned chunk loop wherever it runs (on CUDA the default is
# the compiled chunk plan): the two plans side by side on a GPU.
# @rows: a single softmax's mean loss with its gradient in the forward, by row tiles.
# @compiled: the GPU plan (compiled chunk and block bodies) wherever it runs (a CPU: Inductor's
# C++ code). @plain: an adaptive softmax's classifiers as plain maths (CUDA's auto where small).
# @fused: @rows with its Triton tiles as fused products (heads/kernels/triton_gemm.py; CUDA).
PLAN_SUBJECTS = ("eager", "checkpoint", "rows", "compiled", "plain", FUSED)
DEFAULT_SUBJECTS = ("softmax", "mixtape", "mos", "adaptive", "torch_adaptive", "matmul")


# each of our heads (and torch's adaptive softmax, for its cut-offs) is built from the CLI's
# head fragment, as a user trains it: ``--model.head configs/heads/<name>.yaml``
FRAGMENTS = {"softmax": "softmax", "mixtape": "mixtape", "mos": "mos", "adaptive": "adaptive",
             "torch_adaptive": "adaptive"}  # fmt: skip
FRAGMENT_DIR = Path(__file__).resolve().parents[2] / "configs" / "heads"


@dataclass
class BenchOptions:
    """How subjects are built: ``init_args`` overrides each fragment's (by fragment name, e.g.
    ``{"mos": {"num_components": 4}}``); the fused loss's backend and kept chunk bytes."""

    init_args: dict[str, dict[str, Any]] = field(default_factory=dict)
    loss_backend: str = "auto"  # for our heads without an explicit @backend
    saved_bytes: int | None = None  # the fused loss's kept chunks; None: LossOptions' default


def head_config(name: str, options: BenchOptions) -> dict[str, Any]:
    """``configs/heads/<fragment>.yaml`` of a head or peer (``class_path`` + ``init_args``), with
    ``options.init_args`` of that fragment over its own."""
    fragment = FRAGMENTS[name]
    config = yaml.safe_load((FRAGMENT_DIR / f"{fragment}.yaml").read_text())
    init_args = {**(config.get("init_args") or {}), **options.init_args.get(fragment, {})}
    return {"class_path": config["class_path"], "init_args": init_args}


@functools.cache
def _head_parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--head", type=Head)  # as the CLI's --model.head
    return parser


def parse_head(config: dict[str, Any], hidden: int, vocab: int):
    """A head's config checked by jsonargparse as the CLI checks ``--model.head`` (unknown or
    mistyped ``init_args`` named), with the case's sizes (the CLI links them from the
    backbone and the data); a ``ValueError`` otherwise."""
    sizes = {"hidden_size": hidden, "vocab_size": vocab}
    value = {"class_path": config["class_path"], "init_args": {**config["init_args"], **sizes}}
    try:
        return _head_parser().parse_object({"head": value})
    except ArgumentError as error:
        detail = " ".join(str(error).split())  # one line
        raise ValueError(f"head {config['class_path']}: {detail}") from error


def instantiate_head(config: dict[str, Any], hidden: int, vocab: int) -> Head:
    """A head from its config through jsonargparse, as the CLI builds ``model.head``."""
    return _head_parser().instantiate(parse_head(config, hidden, vocab)).head


# a subject name's modifiers, after its head and backend: +compile, +graphs (either or both)
MODIFIERS = ("compile", "graphs")


@dataclass(frozen=True)
class Subject:
    """A parsed subject name: ``head`` (ours or a peer), ``backend``, ``compiled`` (under
    ``torch.compile``) and ``graphs`` (its training step as CUDA graphs: heads/graphs.py)."""

    head: str
    backend: str | None = None
    compiled: bool = False
    graphs: bool = False


def parse_subject(name: str) -> Subject:
    """``<head>[@<backend>][+compile][+graphs]`` -> :class:`Subject`; one clear error
    otherwise."""
    base, *modifiers = name.split("+")
    head, _, backend = base.partition("@")
    known = head in HEADS + PEERS and set(modifiers) <= set(MODIFIERS)
    if not known or len(set(modifiers)) < len(modifiers):
        raise ValueError(
            f"unknown subject {name!r}: a head ({', '.join(HEADS)}) with an optional "
            f"@backend ({', '.join(BACKENDS + PLAN_SUBJECTS)}), +compile and +graphs, or a peer "
            f"({', '.join(PEERS)})"
        )
    if backend and (head not in HEADS or backend not in BACKENDS + PLAN_SUBJECTS):
        raise ValueError(f"subject {name!r}: @backend applies to {', '.join(HEADS)} only, "
                         f"and must be one of {', '.join(BACKENDS + PLAN_SUBJECTS)}")  # fmt: skip
    if modifiers and head in PEERS:
        raise ValueError(f"subject {name!r}: +compile and +graphs apply to {', '.join(HEADS)} "
                         f"only")  # fmt: skip
    return Subject(head, backend or None, "compile" in modifiers, "graphs" in modifiers)


def eager_twin(name: str) -> str:
    """The subject without its modifiers: the same head and plan, run as written."""
    return name.split("+")[0]


class TorchAdaptive(nn.Module):
    """``torch.nn.AdaptiveLogSoftmaxWithLoss`` behind ``(hidden, target) -> loss``."""

    def __init__(self, hidden: int, vocab: int, cutoffs: list[int], div_value: float) -> None:
        super().__init__()
        self.layer = nn.AdaptiveLogSoftmaxWithLoss(hidden, vocab, cutoffs, div_value=div_value)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(hidden.device.type):
            # CPU autocast keeps log_softmax in the products' dtype (CUDA's makes it float32);
            # torch's layer then copies bf16 log-probs into a float32 buffer and fails. Handing
            # it the input in that dtype is what a user would do, and costs nothing measurable.
            probe = torch.log_softmax(hidden[:1] @ self.layer.head.weight[:1].T, dim=1)
            hidden = hidden.to(probe.dtype)
        return self.layer(hidden, target).loss.float()


class BareMatmul(nn.Module):
    """The machine's limit: the three products of a full softmax's forward and backward
    (``h W^T``, ``dL W``, ``dL^T h``) with nothing else."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, hidden) * hidden**-0.5)

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _BareMatmul.apply(hidden, self.weight)


class _BareMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight):
        logits = hidden @ weight.T  # under autocast: in the autocast dtype, as a head's would be
        # kept in the product's dtype (autocast's linear saves cast copies the same way)
        ctx.save_for_backward(hidden.to(logits.dtype), weight.to(logits.dtype))
        ctx.logits = logits  # kept so the backward has a [N, V] gradient to use
        ctx.dtypes = hidden.dtype, weight.dtype
        return logits.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad_logits = ctx.logits  # stands in for dL/dlogits: same shape, no extra work
        hidden_dtype, weight_dtype = ctx.dtypes
        return (grad_logits @ weight).to(hidden_dtype), (grad_logits.T @ hidden).to(weight_dtype)


def loss_of(module: nn.Module, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = module(hidden, target)
    return out.loss if not isinstance(out, torch.Tensor) else out


class ExternalFusedSoftmax(nn.Module):
    """A full softmax's ``W``, ``b`` and mean loss through CCE's or Liger's fused linear
    cross-entropy (CUDA): the field's kernels as peers of our softmax head."""

    def __init__(self, hidden: int, vocab: int, which: str) -> None:
        super().__init__()
        self.function = external_loss_function(which)  # one clear error when not installed
        self.which = which
        self.weight = nn.Parameter(torch.randn(vocab, hidden) * hidden**-0.5)
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        device = hidden.device.type
        if torch.is_autocast_enabled(device):  # both kernels want one dtype for h and W
            dtype = torch.get_autocast_dtype(device)
            hidden, weight, bias = hidden.to(dtype), weight.to(dtype), bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return self.function(hidden, weight, bias, target).float().mean()


def build_head(name: str, hidden: int, vocab: int, options: BenchOptions) -> nn.Module:
    subject = parse_subject(name)
    head = _build(subject.head, hidden, vocab, options)
    if subject.head in HEADS:
        backend = subject.backend or options.loss_backend
        saved = {} if options.saved_bytes is None else {"saved_bytes": options.saved_bytes}
        # a backend, a plan of the torch one, or fused (rows with the fused products)
        head.loss_options = measured_options(LossOptions(**saved), backend)
        if subject.compiled:
            torch._dynamo.config.capture_scalar_outputs = True  # adaptive's cluster sizes
            head.compile()
        if subject.graphs:
            return GraphedHead(head)
    return head


class GraphedHead(nn.Module):
    """One of our heads with its training step as CUDA graphs (``+graphs``; on a CPU it runs
    eagerly): ``(hidden, target) -> HeadOutput``."""

    def __init__(self, head: Head) -> None:
        super().__init__()
        self.head = head
        self.graphs = GraphedTrainingLoss(head)  # a plain object: the head registered once

    def forward(self, hidden: torch.Tensor, target: torch.Tensor):
        return self.graphs(hidden, target)

    def expect_targets(self, target: torch.Tensor) -> None:
        """Told to the head, as a task tells it (the adaptive softmax's graphs need it)."""
        self.head.expect_targets(target)


def graphs_held_bytes(module: nn.Module) -> int:
    """Device memory the CUDA graphs of ``module``'s ``+graphs`` heads keep between steps:
    allocated at the capture, before any step a benchmark measures, and never freed."""
    return sum(m.graphs.held_bytes for m in module.modules() if isinstance(m, GraphedHead))


def _build(name: str, hidden: int, vocab: int, options: BenchOptions) -> nn.Module:
    if name in FRAGMENTS:
        head = instantiate_head(head_config(name, options), hidden, vocab)
        if name == "torch_adaptive":  # torch's layer with our fragment's cut-offs
            return TorchAdaptive(hidden, vocab, head.cutoffs[:-1], head.div_value)
        return head
    if name == "matmul":
        return BareMatmul(hidden, vocab)
    if name in ("cce", "liger"):
        return ExternalFusedSoftmax(hidden, vocab, name)
    raise ValueError(f"unknown head {name!r}")


class WholeLM(nn.Module):
    """A 2-layer LSTM language model around a head: tokens ``[B, T]`` -> loss."""

    def __init__(self, head: nn.Module, hidden: int, vocab: int) -> None:
        super().__init__()
        self.backbone = LSTMBackbone(vocab, hidden, hidden, 2, input_dropout=0.0,
                                     hidden_dropout=0.0, output_dropout=0.0)  # fmt: skip
        self.head = head

    def forward(self, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.backbone(tokens)
        return loss_of(self.head, hidden.reshape(-1, hidden.size(-1)), target.reshape(-1))


# Lightning's precision names -> the autocast dtype of the forward (None: float32 throughout).
# 16-mixed's GradScaler is left out: it scales one scalar and the gradients, a small cost.
PRECISIONS: dict[str, torch.dtype | None] = {
    "32-true": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
}  # fmt: skip


class Step:
    """One forward + backward (gradients are dropped each time, as zero_grad(None) does), the
    forward under autocast for the mixed precisions, as Lightning runs a training step: the
    head first told the targets as the data loader gives them, on the host (the tasks'
    ``on_before_batch_transfer``: ``Head.expect_targets``). ``clear()`` drops the gradients
    the last step left (before a memory baseline)."""

    def __init__(self, module: nn.Module, inputs: torch.Tensor, target: torch.Tensor,
                 precision: str = "32-true") -> None:  # fmt: skip
        self.module, self.inputs, self.target = module, inputs, target
        self.autocast_dtype = PRECISIONS[precision]
        head = module.head if isinstance(module, WholeLM) else module
        self.expect_targets = getattr(head, "expect_targets", None)  # ours, not the peers
        self.host_target = target.cpu()

    def clear(self) -> None:
        for p in self.module.parameters():
            p.grad = None
        if self.inputs.is_floating_point():
            self.inputs.grad = None

    def __call__(self) -> None:
        self.clear()
        if self.expect_targets is not None:
            self.expect_targets(self.host_target)
        dtype = self.autocast_dtype
        with torch.autocast(self.inputs.device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_of(self.module, self.inputs, self.target)
        loss.backward()


def step_fn(
    module: nn.Module, inputs: torch.Tensor, target: torch.Tensor, precision: str = "32-true"
) -> Callable[[], None]:
    return Step(module, inputs, target, precision)
