"""The head contract shared by every output layer (docs/design.md, "The head contract").

A head maps context vectors ``hidden [N, hidden_size]`` to a distribution over
``vocab_size`` class ids. It never assumes a backbone, a task or a vocabulary type.

Beyond ``forward`` / ``log_prob`` / ``topk``, a task asks a head everything head-specific
through the hooks below, which have defaults here; it never tests a head's type:

- ``setup(context)``: once the training device is known (rank 0 decides what must be equal on
  every DDP rank, e.g. adaptive cut-offs timed on that device);
- ``check_state_dict(state)``: can this checkpoint's head state be loaded here (names the
  option to fix when not);
- ``load_pretrained(state)``: start from another trained head's weights where that makes sense;
- ``training_log_prob(hidden)``: the distribution the loss trains, when it differs from the
  inference one (DS-Softmax);
- ``forward(..., label_smoothing=eps)``: the smoothed training loss, computed by each head
  without a ``[N, V]`` tensor where it can; auxiliary losses stay in ``aux_loss``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch
from torch import nn

from heads.cross_entropy import HALF_DTYPES, IGNORE_INDEX
from heads.errors import CheckpointMismatchError, HeadConfigError
from heads.fused_cross_entropy import LossOptions

T = TypeVar("T")


@dataclass
class HeadOutput:
    """What ``Head.forward`` returns.

    loss: the training loss, averaged over the positions that are not ignored: the mean
        negative log-likelihood, or with label smoothing ``eps`` the mean of
        ``(1 - eps) nll + eps * mean_x(-log p_x)`` (Szegedy et al. 2016).
    nll: ``[N]`` per-position negative log-likelihood (never smoothed), 0 where ignored:
        what perplexity and other metrics are computed from.
    aux_loss: scalar regulariser to add to the training loss (0 when the head has none).
    """

    loss: torch.Tensor
    nll: torch.Tensor
    aux_loss: torch.Tensor


def _run_here(decide: Callable[[], T]) -> T:
    return decide()


@dataclass
class HeadSetup:
    """What a head may need to know about the run it trains in (see :meth:`Head.setup`).

    device: where the model trains.
    decide_once: runs a function once (on rank 0 under DDP) and returns its result on every
        rank, so that whatever a head decides from timings or other local facts is the same
        everywhere. Outside DDP it simply calls the function.
    token_counts: training count of every class id (``[vocab_size]``), when the data knows it.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    decide_once: Callable[[Callable[[], Any]], Any] = _run_here
    token_counts: np.ndarray | None = None


def zipf_log_prior(vocab_size: int) -> torch.Tensor:
    """Centred ``log p(x)`` of a Zipf law over ids sorted by decreasing frequency (rank x + 1):
    the output bias's start (``zipf_bias_init``) for every head with one.

    The initial logits then carry the unigram's shape, so the first gradients are about the
    context, not about the one direction every context shares. With a zero bias that shared
    direction is fitted through the contexts: Mixtape's and MoS's bounded ``tanh(H_k g_c)``
    saturate and training stalls on a context-free plateau, and the softmax's LSTM saturates
    too before it recovers. Measured on PTB (tied LSTM 64, dropouts 0.4/0.3/0.4, Adam 5e-3, 20
    updates): mean |g_c| 0.88-0.95 with a zero bias, 0.09-0.12 with this prior, for all three
    heads (docs/results/mixtape_stability_cpu.json).
    """
    log_prior = -torch.arange(1, vocab_size + 1, dtype=torch.float64).log()
    return (log_prior - log_prior.mean()).float()


def output_bias(vocab_size: int, zipf_bias_init: bool) -> nn.Parameter:
    """A head's per-class output bias, started at :func:`zipf_log_prior` or at zero."""
    start = zipf_log_prior(vocab_size) if zipf_bias_init else torch.zeros(vocab_size)
    return nn.Parameter(start)


def _sorted_with_counts(labels: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices stably sorted by ``labels`` and each group's count, on the device (a
    fixed-length count: no data-dependent shape)."""
    order = torch.argsort(labels, stable=True)
    counts = torch.zeros(num_groups, dtype=torch.long, device=labels.device)
    return order, counts.scatter_add_(0, labels, torch.ones_like(labels))


def sort_into_groups(
    labels: torch.Tensor, num_groups: int, sizes: list[int] | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Row indices sorted by ``labels`` (in ``[0, num_groups)``) and each group's size, so
    that group g is one contiguous slice of ``order``. The sizes come from a fixed-length
    count: under ``torch.compile`` they are the only data-dependent values (no data-dependent
    output shapes).

    The ``tolist`` of all sizes is one host sync: the only one a training or validation step
    may make, and only in heads whose work has a data-dependent shape (adaptive clusters, DS
    experts), which call this once per forward (``tests/lightning_modules/test_host_sync.py``
    counts it). Given ``sizes`` (counted on the host from the batch before it reached the
    device: :meth:`Head.expect_targets`) nothing is read back: the device's count is checked
    against them by a device-side assert instead, which fails the step (at its next sync on a
    GPU), never silently, should they be another batch's."""
    order, counts = _sorted_with_counts(labels, num_groups)
    if sizes is not None:
        given = torch.tensor(sizes)
        if labels.is_cuda:  # pinned: the copy is queued, the host does not wait for it
            given = given.pin_memory()
        given = given.to(labels.device, non_blocking=True)
        torch._assert_async((counts == given).all(), "group sizes given for another batch")
        return order, list(sizes)
    sizes = counts.tolist()
    if torch.compiler.is_compiling():
        # what the counts are, told to the compiler: Inductor must prove every slice of
        # ``order`` by them in bounds, for a batch size that is itself symbolic once a second
        # size was seen (validation's); bounds on the sizes alone do not prove a slice's end
        end = 0
        for size in sizes:
            torch._check(size >= 0)
            end = end + size
            torch._check(end <= labels.numel())
        torch._check(end == labels.numel())
    return order, sizes


def sort_into_slots(
    labels: torch.Tensor, num_groups: int, first: int, capacities: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups ``first, first + 1, ...`` (``labels`` in ``[0, num_groups)``) as fixed-size
    slots: ``(rows, valid)``, ``[sum(capacities)]`` each, group ``first + i``'s rows (in
    order, as :func:`sort_into_groups` sorts them) in the ``capacities[i]`` slots after those
    of the groups before it, ``valid`` false in the slots past its size (they hold some other
    row: a caller zeroes their weight). Every shape is the capacities', none a group's size:
    nothing is read back, and a CUDA graph of a step that uses them holds for every batch
    whose groups fit. One that does not fails a device-side assert (at the next sync on a
    GPU): never silently."""
    if not capacities:
        empty = torch.zeros(0, dtype=torch.long, device=labels.device)
        return empty, empty.bool()
    order, counts = _sorted_with_counts(labels, num_groups)
    starts = counts.cumsum(0) - counts
    positions, valid, fits = [], [], []
    for i, capacity in enumerate(capacities):
        slot = torch.arange(capacity, device=labels.device)  # made on the device: no copy
        positions.append(starts[first + i] + slot)
        valid.append(slot < counts[first + i])
        fits.append(counts[first + i] <= capacity)
    torch._assert_async(torch.stack(fits).all(), "a group outgrew its slots' capacity")
    where = torch.cat(positions).clamp_max(max(labels.numel() - 1, 0))
    return order.index_select(0, where), torch.cat(valid)


def check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise HeadConfigError(f"{name} must be a positive integer, got {value!r}")


def check_dropout(name: str, value: float) -> None:
    """A dropout probability in [0, 1) (``nn.Dropout`` takes 1, which zeroes the values)."""
    if not 0.0 <= value < 1.0:
        raise HeadConfigError(f"{name} must be in [0, 1), got {value!r}")


def check_label_smoothing(value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise HeadConfigError(f"label_smoothing must be in [0, 1), got {value!r}")


def float32_no_autocast(device: torch.device) -> torch.autocast:
    """Context where normalisations and reductions stay in float32 under mixed precision."""
    return torch.autocast(device_type=device.type, enabled=False)


def upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision tensors to float32 for reductions; float32/float64 unchanged."""
    return x.float() if x.dtype in HALF_DTYPES else x


class Head(nn.Module):
    """Base class of every output layer: ``Head(hidden_size, vocab_size, **options)``.

    Subclasses implement :meth:`log_prob`; they override :meth:`forward` when the loss
    can be computed without the full ``[N, vocab_size]`` distribution, and :meth:`topk`
    when they have a faster search than ``log_prob(hidden).topk(k)``.

    ``loss_options`` (:class:`~heads.fused_cross_entropy.LossOptions`): how the training loss
    runs its fused linear + log-sum-exp blocks (backend, chunk sizes); a task sets it from its
    ``loss_backend`` option. Not part of the state: it never changes the results' meaning.

    ``capturable``: whether a training step can be a function of its batch's shape alone (no
    host reads, no sizes taken from the data), so that it can be captured as a CUDA graph
    (``heads/graphs.py``); ``capture_blocker`` says why not; :meth:`step_capturable` whether
    a given step is, :meth:`capture_key` what else its graph is built for (and
    :meth:`captured_as` builds it so).

    ``takes_sequence_length``: whether :meth:`forward` takes the rows' layout
    (``sequence_length``), read from its signature.
    """

    capturable: ClassVar[bool] = False
    capture_blocker: ClassVar[str] = (
        "it does not declare its step a function of the batch's shape alone (Head.capturable)"
    )
    # whether forward takes ``sequence_length`` (set for each subclass from its signature: a
    # head written before the keyword keeps working, the task then gives it no layout)
    takes_sequence_length: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        parameters = inspect.signature(cls.forward).parameters.values()
        cls.takes_sequence_length = any(
            p.name == "sequence_length" or p.kind is inspect.Parameter.VAR_KEYWORD
            for p in parameters
        )

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("vocab_size", vocab_size)
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.loss_options = LossOptions()

    # -- the contract -------------------------------------------------------------------
    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact normalised log-probabilities ``[N, vocab_size]`` in float32."""
        raise NotImplementedError

    def forward(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float = 0.0,
        sequence_length: int | None = None,
    ) -> HeadOutput:
        """Loss of ``target`` (``-100`` ignored) from the full distribution; heads built for
        speed override this.

        ``sequence_length``: the rows' layout where a task knows it, ``T`` when they are
        sequences of ``T`` consecutive steps (row ``b T + t``; rows a task appends past the
        ``B T`` real ones are padding, their targets ignored), else None. Only a head that draws
        dropout masks over its rows uses it (MoS and Mixtape with ``locked_dropout``: one mask
        a sequence); the others ignore it. A head whose ``forward`` does not take it
        (:attr:`takes_sequence_length` false) is never given it."""
        self.check_inputs(hidden, target)
        check_label_smoothing(label_smoothing)
        log_probs = self.training_log_prob(hidden)
        smoothing = -log_probs.mean(-1) if label_smoothing else None
        nll = -self.gather_target(log_probs, target)
        return self.output(nll, target, smoothing=smoothing, label_smoothing=label_smoothing)

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` most likely classes per row: ``(log_probs [N, k], indices [N, k])``."""
        check_positive_int("k", k)
        if k > self.vocab_size:
            raise HeadConfigError(f"top-k with k={k} exceeds the vocabulary size {self.vocab_size}")
        return self.log_prob(hidden).topk(k, dim=-1)

    def tie_output_embedding(self, weight: nn.Parameter) -> None:
        """Share the output token embeddings with an input embedding ``[vocab_size, d]``."""
        raise HeadConfigError(f"{type(self).__name__} does not support weight tying")

    # -- hooks a task calls; the defaults fit a head with a fixed structure ----------------
    def setup(self, context: HeadSetup) -> None:
        """Called by the task once the training device is known, before the optimizer and
        the DDP wrapper are built and before a checkpoint is loaded. A head may change its
        structure here (decided through ``context.decide_once``). Default: nothing."""

    def expect_targets(self, target: torch.Tensor) -> None:
        """Called by the task with the next training or evaluation batch's targets while they
        are still on the host, before they are copied to the device and the step runs: a head
        may take from them now what its :meth:`forward` would otherwise read back from the
        device (a GPU sync). Default: nothing."""

    def step_capturable(self, hidden: torch.Tensor) -> bool:
        """Whether a training step on ``hidden`` (its shape, device and the loss options) is
        a function of the batch's shape alone, so that a CUDA graph of it holds for every
        batch of that shape. Default: ``capturable``."""
        return self.capturable

    def capture_key(self, hidden: torch.Tensor, label_smoothing: float = 0.0) -> tuple | None:
        """What a CUDA graph of a training step on ``hidden`` is built for besides the batch's
        shape, device and the loss options: ``None`` where this step cannot be captured, else
        a key (default ``()``: nothing more). A head whose captured step has static sizes it
        picks from the batch (the adaptive softmax's clusters' slots) names them here; a
        batch they do not fit gets another key, so another graph. Default: ``()`` where
        :meth:`step_capturable`."""
        return () if self.step_capturable(hidden) else None

    def captured_as(self, key: tuple) -> contextlib.AbstractContextManager:
        """The context a step is warmed up and captured in, for :meth:`capture_key`'s
        ``key``: within it the head builds the step that key names. Default: nothing."""
        return contextlib.nullcontext()

    def training_log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """The distribution the loss trains, ``[N, vocab_size]``; equals :meth:`log_prob`
        unless the head infers from another one (DS-Softmax's sparse inference)."""
        return self.log_prob(hidden)

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Refuse, with a message naming what to configure, a checkpoint's head state (keys
        without the ``head.`` prefix) that :meth:`load_state_dict` could not load.
        Default: the same names and shapes."""
        expected = self.state_dict()
        if set(state) != set(expected):
            raise CheckpointMismatchError(
                f"the checkpoint's head has other parameters than this {type(self).__name__} "
                f"(missing {sorted(set(expected) - set(state))[:3]}, unexpected "
                f"{sorted(set(state) - set(expected))[:3]}): configure the head it was trained with"
            )
        for name, value in expected.items():
            saved = state[name]
            if isinstance(saved, torch.Tensor) and saved.shape != value.shape:
                raise CheckpointMismatchError(
                    f"the checkpoint's {type(self).__name__} has {name} of shape "
                    f"{tuple(saved.shape)}, this one {tuple(value.shape)}: set the head "
                    f"options (sizes, components, cut-offs) the checkpoint was trained with"
                )

    def load_pretrained(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Start from another trained head's state (``pretrained_checkpoint``): loaded when it
        has this head's names and shapes. Returns whether anything was loaded."""
        own = self.state_dict()
        if set(state) != set(own) or any(
            isinstance(v, torch.Tensor) and state[k].shape != v.shape for k, v in own.items()
        ):
            return False
        self.load_state_dict(state)
        return True

    # -- helpers for subclasses ---------------------------------------------------------
    def _tie(self, param_name: str, weight: nn.Parameter) -> None:
        own = getattr(self, param_name)
        if weight.shape != own.shape:
            raise HeadConfigError(
                f"cannot tie {type(self).__name__}.{param_name} of shape {tuple(own.shape)} "
                f"to an embedding of shape {tuple(weight.shape)}: set the head's embedding_size "
                f"to the backbone's embedding size ({weight.size(-1)})"
            )
        setattr(self, param_name, weight)

    def check_inputs(self, hidden: torch.Tensor, target: torch.Tensor | None = None) -> None:
        if hidden.dim() != 2 or hidden.size(-1) != self.hidden_size:
            raise ValueError(
                f"{type(self).__name__} expects hidden of shape [N, {self.hidden_size}], "
                f"got {tuple(hidden.shape)}"
            )
        if target is not None and target.shape != hidden.shape[:1]:
            raise ValueError(
                f"target must have shape [{hidden.size(0)}], got {tuple(target.shape)}"
            )

    @staticmethod
    def gather_target(log_probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``log_probs[n, target[n]]``, 0 at ignored positions."""
        safe_target = target.clamp_min(0).unsqueeze(-1)
        return log_probs.gather(-1, safe_target).squeeze(-1)

    @staticmethod
    def output(
        nll: torch.Tensor,
        target: torch.Tensor,
        aux_loss: torch.Tensor | None = None,
        smoothing: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
    ) -> HeadOutput:
        """A :class:`HeadOutput` from the per-row NLL ``-log P(target)`` and, with label
        smoothing, the per-row ``mean_x(-log p_x)``; both float32 (or float64), any value at
        ignored rows (they are zeroed here)."""
        keep = target != IGNORE_INDEX
        nll = upcast(nll)
        nll = torch.where(keep, nll, 0.0)
        # clamp: an all-ignored batch gives loss 0, not NaN
        count = keep.sum().clamp_min(1)
        if label_smoothing:
            smoothing = torch.where(keep, upcast(smoothing), 0.0)
            loss = ((1 - label_smoothing) * nll + label_smoothing * smoothing).sum() / count
        else:
            loss = nll.sum() / count
        if aux_loss is None:
            aux_loss = nll.new_zeros(())
        return HeadOutput(loss=loss, nll=nll, aux_loss=aux_loss)


class SingleSoftmaxHead(Head):
    """A head whose distribution is one softmax over ``logits(hidden) [N, V]``.

    Subclasses implement :meth:`logits` (and a fused training ``forward``); normalisation runs
    here, in float32. Their output embeddings live in ``self.weight`` ``[V, d]`` and can be
    tied.
    """

    weight: nn.Parameter

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        self.check_inputs(hidden)
        logits = self.logits(hidden)
        with float32_no_autocast(hidden.device):
            return upcast(logits).log_softmax(dim=-1)

    def tie_output_embedding(self, weight: nn.Parameter) -> None:
        self._tie("weight", weight)
