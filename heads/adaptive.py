"""Adaptive softmax (Grave, Joulin, Cisse, Grangier, Jegou, ICML 2017; adaptive-softmax.txt).

A head short-list of the ``k_h`` most frequent words plus one logit per tail cluster; tail
cluster i projects the hidden state to ``d / div^i`` before its own classifier (Sec. 4.2,
"Adapting the classifier capacity", reduces the one tail's to ``d / 4``; the geometric
``div^i`` over several tails is PyTorch's ``AdaptiveLogSoftmaxWithLoss``'s, which this head
matches weight for weight). ``log P(w) = log P_head(cluster(w)) + log P_i(w)`` (Sec. 3.3's
``p1(C(w) | h) p2(w | C(w), h)``, the short-list's words their own clusters, Sec. 4.3), and
the loss evaluates each tail cluster on the batch's rows
whose targets fall in it (none for a cluster the batch misses: its parameters still get a zero
gradient, as DDP without ``find_unused_parameters`` needs). Sorting the rows into clusters
needs their sizes on the host: counted there from the batch before it reaches the device when
the task says so (:meth:`expect_targets`), else read back from the device (a GPU sync); on
CUDA a step small enough for its logits to fit the saved budget (a PTB step) needs neither:
every classifier runs on every row, its targets ignored outside it (``dense_loss_fits``).
Plan ``rows`` there runs the whole loss as one function, its gradients computed in the
forward (``heads/kernels/adaptive_rows.py``); captured as a CUDA graph (``cuda_graphs``), it
runs each tail cluster on a fixed number of row slots instead (:meth:`capture_key`), so that
one graph serves every batch whose clusters fit them.

``cutoffs="auto"`` chooses the cut-offs by the paper's dynamic program (Eq. 8) on a cost model
of the device the model trains on: at construction a fixed reference model (the same on every
process, no timing), then in :meth:`setup` the model timed on the training device by rank 0
and shared with every rank; a checkpoint's cut-offs are adopted when it is loaded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from heads.adaptive_cutoffs import CostModel, calibrate, optimal_cutoffs, zipf_probabilities
from heads.base import (
    Head,
    HeadOutput,
    HeadSetup,
    check_label_smoothing,
    float32_no_autocast,
    sort_into_groups,
    sort_into_slots,
    upcast,
)
from heads.cross_entropy import IGNORE_INDEX
from heads.errors import CheckpointMismatchError, HeadConfigError
from heads.fused_cross_entropy import (
    dense_loss_fits,
    linear_lse,
    mean_cross_entropy,
    mean_loss_plan,
    mean_weights,
    plain_log_probs,
    plain_loss_fits,
    plain_nll,
    row_tile,
)
from heads.kernels.adaptive_rows import TilePlan, adaptive_rows_loss
from heads.kernels.chunks import gpu_plans

log = logging.getLogger(__name__)
_REBUILD_SEED_OFFSET = 0xADA  # a stream apart from the backbone's first draws
# a captured step's tail-cluster slots (``capture_key``): this much over the sizes seen, in
# multiples of SLOT_ALIGN rows (a language model's batches vary by a few percent a cluster)
SLOT_MARGIN = 0.125
SLOT_ALIGN = 64

_EXTRA_STATE = "_extra_state"


def reference_cost_model(hidden_size: int) -> CostModel:
    """The cost model ``auto`` uses before :meth:`AdaptiveSoftmaxHead.setup` times the real
    device: 0.05 ms per product, 10^12 multiply-adds per second, no saving below 2^15 output
    entries. Deterministic, so every process builds the same head."""
    return CostModel(c=0.05, lam=hidden_size / 1e9, k0b0=float(2**15))


class AdaptiveSoftmaxHead(Head):
    """Adaptive softmax with given or automatically chosen cut-offs.

    Args:
        hidden_size: size ``d`` of the context vectors.
        vocab_size: number of classes; ids sorted by decreasing frequency.
        cutoffs: increasing word positions ending the head and every tail cluster but the
            last, e.g. ``[2000, 10000]`` (the last cluster ends at ``vocab_size``), or
            ``"auto"``: the paper's dynamic program on the computation-time model.
        div_value: tail cluster i works in ``d // div_value**i`` dimensions.
        head_bias: learn a bias for the head classifier.
        num_clusters: for ``auto``: the number of tail clusters J (the paper uses 2 to 5), or
            ``None`` for the J in 1..4 with the least modelled cost. Where the vocabulary or
            ``d / div^J`` is too small for J clusters, fewer are used (with a warning).
        cost_model: for ``auto``: ``{c, lam, k0b0}`` of ``g(k, B)`` in ms, or ``None`` to time
            the training device in :meth:`setup` (cached per device and hidden size).
        calibration_batch: for ``auto``: the batch size B (tokens per step) the cost is for.
        token_counts: for ``auto``: training counts per id; default the counts the data
            module reports in :meth:`setup`, else a Zipf law over the frequency-sorted ids.
    """

    # a CUDA graph of a dense step (every classifier on every row) holds for any batch of its
    # shape; a step over the budget sizes its clusters from each batch (step_capturable)
    capturable = True

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        cutoffs: Sequence[int] | Literal["auto"] = "auto",
        div_value: float = 4.0,
        head_bias: bool = False,
        num_clusters: int | None = 2,
        cost_model: dict[str, float] | None = None,
        calibration_batch: int = 2048,
        token_counts: Sequence[int] | None = None,
    ) -> None:
        super().__init__(hidden_size, vocab_size)
        if div_value < 1:
            raise HeadConfigError(f"AdaptiveSoftmaxHead div_value must be >= 1, got {div_value}")
        if token_counts is not None and len(token_counts) != vocab_size:
            raise HeadConfigError(
                f"token_counts has {len(token_counts)} entries for {vocab_size} classes"
            )
        self.div_value = div_value
        self.head_bias = head_bias
        self.auto = cutoffs == "auto"
        self.num_clusters_wanted = num_clusters
        self.cost_model = CostModel(**cost_model) if cost_model else None
        self.calibration_batch = calibration_batch
        self._expected: tuple[int, list[int]] | None = None  # (targets, sizes): expect_targets
        # the slots of the step being captured now (captured_as)
        self._capturing_slots: tuple[int, ...] | None = None
        self.token_counts = None if token_counts is None else list(token_counts)
        if self.auto:
            model = self.cost_model or reference_cost_model(hidden_size)
            cutoffs = self._choose_cutoffs(
                model, self._probabilities(self.token_counts), level=logging.DEBUG
            )  # provisional: setup decides
        self._build(self._check_cutoffs(list(cutoffs), vocab_size))

    def _build(self, cutoffs: list[int], like: torch.Tensor | None = None) -> None:
        """(Re)create the classifiers for ``cutoffs`` (ending in ``vocab_size``), on the device
        and dtype of ``like`` when given."""
        self.cutoffs = cutoffs
        # a captured step's tail-cluster slots per batch size (capture_key), for these clusters
        self._slots: dict[int, tuple[int, ...]] = {}
        self.shortlist_size = cutoffs[0]
        self.num_clusters = len(cutoffs) - 1
        factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
        # The group starts (``_groups``) and each group's head target (the word itself in the
        # short-list, at index 1: unused), as buffers: they move with the module
        device = factory.get("device")
        starts = torch.tensor([0, *cutoffs[:-1]], device=device)
        self.register_buffer("group_starts", starts, persistent=False)
        entries = range(self.shortlist_size, self.shortlist_size + self.num_clusters)
        head_target = torch.tensor([IGNORE_INDEX, 0, *entries], device=device)
        self.register_buffer("group_head_target", head_target, persistent=False)
        # how often each head row counts in sum_x log P(x) (``_smoothing``): once per
        # short-list word, |C_i| times for cluster i's entry; integers, which no dtype cast of
        # the module rounds
        sizes = [stop - start for start, stop in zip(cutoffs, cutoffs[1:], strict=False)]
        counts = torch.tensor([1] * self.shortlist_size + sizes, device=factory.get("device"))
        self.register_buffer("head_counts", counts, persistent=False)
        d = self.hidden_size
        self.head = nn.Linear(d, self.shortlist_size + self.num_clusters, self.head_bias, **factory)
        self.tail = nn.ModuleList()
        for i in range(1, self.num_clusters + 1):
            reduced = int(d // self.div_value**i)
            if reduced < 1:
                raise HeadConfigError(
                    f"AdaptiveSoftmaxHead tail cluster {i} would have hidden_size // div_value^{i}"
                    f" = 0 dimensions: use fewer clusters or a smaller div_value"
                )
            self.tail.append(
                nn.Sequential(
                    nn.Linear(d, reduced, bias=False, **factory),
                    nn.Linear(reduced, cutoffs[i] - cutoffs[i - 1], bias=False, **factory),
                )
            )

    @staticmethod
    def _check_cutoffs(cutoffs: list[int], vocab_size: int) -> list[int]:
        if cutoffs and cutoffs[-1] == vocab_size:
            cutoffs = cutoffs[:-1]
        ok = (
            len(cutoffs) >= 1
            and all(isinstance(c, int) for c in cutoffs)
            and all(0 < a < b for a, b in zip(cutoffs, cutoffs[1:], strict=False))
            and 0 < cutoffs[0]
            and cutoffs[-1] < vocab_size
        )
        if not ok:
            raise HeadConfigError(
                f"AdaptiveSoftmaxHead cutoffs must be increasing positive integers below the "
                f"vocabulary size {vocab_size}, got {cutoffs}"
            )
        return [*cutoffs, vocab_size]

    # -- "auto": the dynamic program on a cost model ---------------------------------------
    def _probabilities(self, counts: Sequence[int] | np.ndarray | None) -> np.ndarray:
        if counts is None:
            return zipf_probabilities(self.vocab_size)
        probs = np.asarray(counts, dtype=np.float64) + 1e-12
        return probs / probs.sum()

    def _choose_cutoffs(self, model: CostModel, probs: np.ndarray,
                        level: int = logging.INFO) -> list[int]:  # fmt: skip
        """Eq. 8's least-cost cut-offs for the wanted number of clusters, or for fewer where
        the vocabulary or the reduced tail dimensions leave no room for that many; logged at
        ``level``."""
        feasible = [
            j
            for j in range(
                1, 5 if self.num_clusters_wanted is None else self.num_clusters_wanted + 1
            )
            if j <= self.vocab_size - 1 and self.hidden_size // self.div_value**j >= 1
        ]
        if not feasible:
            raise HeadConfigError(
                f"AdaptiveSoftmaxHead has no room for a tail cluster: it needs vocab_size >= 2 "
                f"(got {self.vocab_size}) and hidden_size // div_value >= 1 (got "
                f"{self.hidden_size} // {self.div_value}); use SoftmaxHead"
            )
        wanted = self.num_clusters_wanted
        if wanted is not None and wanted not in feasible:
            log.warning(
                "adaptive softmax: %d tail clusters do not fit vocab_size %d and hidden_size %d "
                "(div_value %s); using %d",
                wanted, self.vocab_size, self.hidden_size, self.div_value, max(feasible),
            )  # fmt: skip
            feasible = [max(feasible)]
        elif wanted is not None:
            feasible = [wanted]
        batch = float(self.calibration_batch)
        options = [optimal_cutoffs(probs, j, model, batch) for j in feasible]
        cuts, cost = min(options, key=lambda option: option[1])
        log.log(level, "adaptive softmax cut-offs %s (modelled %.3f ms/step, %s)", cuts, cost,
                model)  # fmt: skip
        return cuts

    def setup(self, context: HeadSetup) -> None:
        """``auto``: the cut-offs for the training device (timed there by rank 0 only, unless a
        ``cost_model`` is given) and the data's token counts; rebuilt if they differ from the
        provisional ones. Given cut-offs: nothing."""
        if not self.auto:
            return
        counts = self.token_counts if self.token_counts is not None else context.token_counts
        if counts is not None and len(counts) != self.vocab_size:
            counts = None  # counts of another vocabulary (e.g. words under codes): Zipf

        def decide() -> list[int]:
            model = self.cost_model or calibrate(self.hidden_size, context.device)
            return self._choose_cutoffs(model, self._probabilities(counts))

        cutoffs = [int(c) for c in context.decide_once(decide)]
        if cutoffs != self.cutoffs:
            # Initialised from the run's seed, not from wherever the global stream stands: DDP
            # re-seeds before setup and a single process does not, and both must start alike.
            devices = [self.head.weight.device] if self.head.weight.is_cuda else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(torch.initial_seed() + _REBUILD_SEED_OFFSET)
                self._build(cutoffs, like=self.head.weight)

    # -- checkpoints: the cut-offs are structure ---------------------------------------------
    def get_extra_state(self) -> dict:
        return {"cutoffs": self.cutoffs, "div_value": self.div_value}

    def set_extra_state(self, state: dict) -> None:
        if list(state["cutoffs"]) != self.cutoffs or state["div_value"] != self.div_value:
            raise CheckpointMismatchError(self._mismatch(state))

    def _mismatch(self, state: Mapping[str, Any]) -> str:
        return (
            f"the checkpoint's AdaptiveSoftmaxHead has cutoffs {list(state['cutoffs'])[:-1]} and "
            f"div_value {state['div_value']}, this one {self.cutoffs[:-1]} and {self.div_value}: "
            f"pass --model.head.init_args.cutoffs '{list(state['cutoffs'])[:-1]}' (or auto) and "
            f"the same div_value"
        )

    def _adopt(self, state: Mapping[str, Any] | None) -> None:
        """``auto`` takes a checkpoint's cut-offs: it may have been decided on another device."""
        if state is None or not self.auto or state["div_value"] != self.div_value:
            return
        if list(state["cutoffs"]) != self.cutoffs:
            self._build(self._check_cutoffs(list(state["cutoffs"]), self.vocab_size),
                        like=self.head.weight)  # fmt: skip

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        extra = state.get(_EXTRA_STATE)
        if extra is not None and (
            list(extra["cutoffs"]) != self.cutoffs or extra["div_value"] != self.div_value
        ):
            if not self.auto or extra["div_value"] != self.div_value:
                raise CheckpointMismatchError(self._mismatch(extra))
            return  # auto adopts them when loading
        super().check_state_dict(state)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        # adopt the saved cut-offs before the classifiers' weights are loaded (children load
        # after their parent)
        self._adopt(state_dict.get(prefix + _EXTRA_STATE))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # -- the contract -------------------------------------------------------------------
    def forward(
        self, hidden: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0
    ) -> HeadOutput:
        self.check_inputs(hidden, target)
        check_label_smoothing(label_smoothing)
        expected = self._take_expected(target)  # the group sizes, counted on the host
        group = _groups(target, self.group_starts)
        # Head: the word itself if in the short-list, else its cluster's entry (or ignored).
        head_target = torch.where(group == 1, target, self.group_head_target[group])
        # a small step on CUDA: every classifier on every row, nothing read back
        if self._dense(hidden):
            return self._dense_loss(hidden, target, group, head_target, label_smoothing)
        # One sort groups the rows by cluster (ignored and short-list rows first), so each
        # tail cluster is a contiguous slice of one gather: one index_select (and one
        # scatter in its backward) for all tail clusters instead of one per cluster. The
        # group sizes: counted on the host where the task told the targets (expect_targets),
        # else the step's one read-back (``sort_into_groups``), taken before any product is
        # queued: the host waits for the backbone and this sort only, and the head
        # classifier's product then keeps the GPU busy while the tail clusters are launched
        # (taken after it, the GPU would idle from the read-back to the first tail kernel).
        slots = self._capturing_slots
        if slots is not None:  # a step being captured: each tail cluster in its fixed slots
            tail_rows, valid = sort_into_slots(group, self.num_clusters + 2, 2, slots)
            loss, nll = adaptive_rows_loss(hidden, target, head_target, tail_rows, slots,
                                           self.cutoffs, self.head, self.tail, valid,
                                           self._rows_tile(hidden))  # fmt: skip
            return HeadOutput(loss, nll, loss.new_zeros(()))
        order, sizes = sort_into_groups(group, self.num_clusters + 2, expected)  # ignored first
        if self._whole_rows(hidden, label_smoothing):  # the whole loss in one function
            loss, nll = adaptive_rows_loss(hidden, target, head_target,
                                           order[sizes[0] + sizes[1] :], sizes[2:],
                                           self.cutoffs, self.head, self.tail, None,
                                           self._rows_tile(hidden))  # fmt: skip
            return HeadOutput(loss, nll, loss.new_zeros(()))
        compiling = torch.compiler.is_compiling()
        # Where the rows plan may pay for some classifier (eagerly, without smoothing), each
        # classifier gives its part of the mean loss (token weights 1 / count over the whole
        # batch); otherwise the NLL is reduced once at the end, as before
        largest = max(self.head.weight.size(0), *(t[1].weight.size(0) for t in self.tail))
        by_rows = not (label_smoothing or compiling)
        by_rows = by_rows and mean_loss_plan(self.loss_options, hidden, largest) == "rows"
        weights = mean_weights(group > 0, hidden) if by_rows else None
        # per classifier: fused product and loss (no [N, C]), or plain where small on CUDA
        loss, nll, head_lse = self._classify(
            hidden, self.head.weight, self.head.bias, head_target, weights,
            want_lse=bool(label_smoothing),
        )  # fmt: skip
        smoothing = None
        if label_smoothing:
            smoothing = self._smoothing(hidden, head_lse)
        tail_rows = order[sizes[0] + sizes[1] :]
        tail_hidden = hidden.index_select(0, tail_rows)
        tail_target = target.index_select(0, tail_rows)
        tail_weights = None if weights is None else weights.rows(tail_rows)
        cluster_nll, start = [], 0
        # Every cluster runs, one without a target in this batch on zero rows: its parameters
        # get a (zero) gradient all the same, which DDP without find_unused_parameters needs
        # on every rank (a rank whose batch misses a cluster would leave the all-reduce of the
        # other ranks waiting); the cost is a few launches on empty tensors.
        for i, (tail, size) in enumerate(zip(self.tail, sizes[2:], strict=True), start=1):
            rows = slice(start, start + size)
            projected = tail[0](tail_hidden[rows])  # d -> d / div^i
            weight = tail[1].weight
            if compiling and weight.size(1) == 1:
                # a [rows, 1] projection has strides (1, 1), so autograd's mm backward asks
                # whether its rows == 1 (its column-major test, mm_mat1_backward), a guard on
                # the cluster's data-dependent size that Inductor cannot compile; a zero
                # column more changes no logit and no gradient
                projected = torch.nn.functional.pad(projected, (0, 1))
                weight = torch.nn.functional.pad(weight, (0, 1))
            relative = tail_target[rows] - self.cutoffs[i - 1]  # all in the cluster
            part, part_nll, _ = self._classify(
                projected, weight, None, relative,
                None if weights is None else tail_weights.rows(rows),
                row_bound=hidden.size(0) if compiling else None,
            )  # fmt: skip
            loss = None if weights is None else loss + part
            cluster_nll.append(part_nll)
            start += size
        nll = nll.index_add(0, tail_rows, torch.cat(cluster_nll).to(nll.dtype))
        if weights is not None:
            return HeadOutput(loss, nll, loss.new_zeros(()))
        return self.output(nll, target, smoothing=smoothing, label_smoothing=label_smoothing)

    def _whole_rows(self, hidden: torch.Tensor, label_smoothing: float) -> bool:
        """Whether a step runs :func:`~heads.kernels.adaptive_rows.adaptive_rows_loss`: plan
        ``rows`` of the torch backend on the GPU plans' devices (CUDA), a training step with
        gradients, without label smoothing, outside ``torch.compile``'s tracing."""
        options = self.loss_options
        return (
            options.plan == "rows"
            and options.backend in ("auto", "torch")
            and not options.fused_products
            and gpu_plans(hidden.device)
            and torch.is_grad_enabled()
            and not label_smoothing
            and not torch.compiler.is_compiling()
        )

    def _rows_tile(self, hidden: torch.Tensor) -> TilePlan:
        """How :func:`~heads.kernels.adaptive_rows.adaptive_rows_loss` tiles each classifier's
        rows: as the other rows plans tile theirs (:func:`row_tile`: ``chunk_bytes`` of
        float32 logits where given, else a share of the device's memory). Untiled, the head
        classifier held ``[N, k_h + J]`` logits and each tail cluster ``[R_i, |C_i|]`` at
        once, the previous classifier's ``dz`` still alive beside them: at 32k tokens and a
        20k short list, 1.3 GB in bf16 (several times that by the torch operators)."""
        device, options = hidden.device, self.loss_options
        return lambda rows, columns, held: row_tile(rows, columns, device, options, held)

    def _dense(self, hidden: torch.Tensor) -> bool:
        """Whether a step on ``hidden`` runs every classifier on every row
        (:func:`dense_loss_fits`)."""
        return dense_loss_fits(self.loss_options, hidden.device, hidden.size(0),
                               self.vocab_size + self.num_clusters)  # fmt: skip

    def step_capturable(self, hidden: torch.Tensor) -> bool:
        """A dense step: its shapes are the batch's alone (others may be captured in slots:
        :meth:`capture_key`)."""
        return self._dense(hidden)

    def capture_key(self, hidden: torch.Tensor, label_smoothing: float = 0.0) -> tuple | None:
        """``()`` for a dense step; for a step of the whole-loss ``rows`` plan whose cluster
        sizes were counted on the host (:meth:`expect_targets`), ``("slots", slots)``: each
        tail cluster's fixed number of row slots, :data:`SLOT_MARGIN` over the largest size
        seen for this batch size (kept while the batches fit, widened when one does not);
        else None (the step reads its sizes from the batch: eager)."""
        if self._dense(hidden):
            return ()
        rows = hidden.size(0)
        expected = self._expected_for(rows)
        if expected is None or not self._whole_rows(hidden, label_smoothing):
            return None
        sizes = expected[2:]
        slots = self._slots.get(rows, (0,) * len(sizes))
        if any(size > slot for size, slot in zip(sizes, slots, strict=True)):
            wider = (-(-int(size * (1 + SLOT_MARGIN)) // SLOT_ALIGN) * SLOT_ALIGN for size in sizes)
            slots = tuple(min(rows, max(slot, w, SLOT_ALIGN))
                          for slot, w in zip(slots, wider, strict=True))  # fmt: skip
            self._slots[rows] = slots
        return ("slots", slots)

    @contextlib.contextmanager
    def captured_as(self, key: tuple):
        """Within: the forward builds the step :meth:`capture_key` named (its slots)."""
        self._capturing_slots = key[1] if key else None
        try:
            yield
        finally:
            self._capturing_slots = None

    def expect_targets(self, target: torch.Tensor) -> None:
        """The next forward's group sizes, counted here on the host from the batch's targets
        (CPU), so that the forward reads nothing back from the device (it checks them there
        with a device-side assert); used by that forward only, under eager execution."""
        self._expected = None
        if target.device.type == "cpu" and not target.is_floating_point():
            group = _groups(target.reshape(-1), torch.tensor([0, *self.cutoffs[:-1]]))
            counts = torch.bincount(group, minlength=self.num_clusters + 2)
            self._expected = (target.numel(), counts.tolist())

    def _take_expected(self, target: torch.Tensor) -> list[int] | None:
        """The group sizes :meth:`expect_targets` counted, if they were counted for as many
        targets as ``target`` holds (then no longer kept), else None (always under
        ``torch.compile``, where the read-back is a captured data-dependent size)."""
        if torch.compiler.is_compiling():
            return None
        sizes = self._expected_for(target.numel())
        self._expected = None
        return sizes

    def _expected_for(self, targets: int) -> list[int] | None:
        """The group sizes :meth:`expect_targets` counted, if counted for ``targets`` targets
        (kept: :meth:`capture_key` reads them too), else None."""
        expected = self._expected
        return expected[1] if expected is not None and expected[0] == targets else None

    def _dense_loss(self, hidden: torch.Tensor, target: torch.Tensor, group: torch.Tensor,
                    head_target: torch.Tensor, label_smoothing: float) -> HeadOutput:  # fmt: skip
        """Every classifier over every row as plain maths (:func:`dense_loss_fits`: small steps
        on CUDA): no sort, no gather, no read-back. A row's NLL is the head classifier's over
        its word or cluster entry plus its own cluster's (Sec. 3.3), each tail cluster's targets
        ignored outside it, so that the other rows take no gradient from it. Label smoothing:
        ``sum_x log P(x) = sum_j c_j log P_head(j) + sum_i sum_{x in C_i} log P_i(x)``, the
        head's entry j counted ``c_j`` times (once a word, ``|C_i|`` for cluster i's)."""
        smoothing = label_smoothing > 0
        nll, log_probs = plain_log_probs(hidden, self.head.weight, self.head.bias, head_target)
        total = None
        if smoothing:  # in float32: a half-precision product overflows float16 (|sum| > 65504)
            with float32_no_autocast(hidden.device):
                log_probs = upcast(log_probs)
                total = log_probs @ self.head_counts.to(log_probs.dtype)
        for i, tail in enumerate(self.tail, start=1):
            inside = torch.where(group == i + 1, target - self.cutoffs[i - 1], IGNORE_INDEX)
            part, log_probs = plain_log_probs(tail[0](hidden), tail[1].weight, None, inside)
            nll = nll + part
            total = total + log_probs.sum(1) if smoothing else None
        mean = None if total is None else -total / self.vocab_size
        return self.output(nll, target, smoothing=mean, label_smoothing=label_smoothing)

    def _classify(self, hidden, weight, bias, target, weights, row_bound=None, want_lse=False):
        """One classifier's ``(part of the mean loss, NLL, log-sum-exp)``: the part (``sum_n
        w_n nll_n``) only with ``weights``; NLL 0 where ``target`` is ignored (``IGNORE_INDEX``).
        Plainly where the classifier's logits fit the saved budget and, under plan ``rows``,
        are few enough for its launches to dominate (:func:`plain_loss_fits`:
        ``ROWS_PLAIN_LOGITS``; no log-sum-exp unless ``want_lse``), else by the rows plan where
        :func:`mean_loss_plan` picks it (no log-sum-exp either), else by a column plan."""
        rows = hidden.size(0) if row_bound is None else row_bound  # eager: the cluster's own
        plain = plain_loss_fits(self.loss_options, hidden.device, rows, weight.size(0),
                                classifier=True)  # fmt: skip
        if not want_lse and plain:
            nll = plain_nll(hidden, weight, bias, target)
            return None if weights is None else weights.total(nll), nll, None
        if weights is not None:
            mean = mean_cross_entropy(hidden, weight, bias, target, weights=weights,
                                      options=self.loss_options)  # fmt: skip
            if mean is not None:
                return mean.loss, mean.nll, None
        valid = target >= 0
        parts = linear_lse(hidden, weight, bias, torch.where(valid, target, -1),
                           options=self.loss_options, row_bound=row_bound)  # fmt: skip
        nll = torch.where(valid, parts.lse - parts.target_logit, 0.0)
        loss = None if weights is None else weights.total(nll)
        return loss, nll, parts.lse

    def _smoothing(self, hidden: torch.Tensor, head_lse: torch.Tensor) -> torch.Tensor:
        """``mean_x(-log P(x))`` per row, every cluster for every row but no ``[N, V]``:
        ``sum_x log P(x) = sum_{x in head} z_x + sum_i |C_i| z_{c_i} - V log Z_head
        + sum_i (sum_{x in C_i} y_{i,x} - |C_i| log Z_i)``; logits are linear, so each sum of
        logits is one product with a weighted sum of weight rows."""
        head = self.head
        sizes = [stop - start for start, stop in zip(self.cutoffs, self.cutoffs[1:], strict=False)]
        with float32_no_autocast(hidden.device):
            dtype = head_lse.dtype
            h, w = hidden.to(dtype), head.weight.to(dtype)
            counts = self.head_counts.to(dtype)
            total = h @ (counts @ w)
            if head.bias is not None:
                total = total + counts @ head.bias.to(dtype)
            total = total - self.vocab_size * head_lse
            for tail, size in zip(self.tail, sizes, strict=True):
                projected = tail[0](hidden)
                weight = tail[1].weight
                parts = linear_lse(projected, weight, logit_sum=True, options=self.loss_options)
                total = total + parts.logit_sum.to(dtype) - size * parts.lse.to(dtype)
        return -total / self.vocab_size

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        self.check_inputs(hidden)
        head_logits = self.head(hidden)
        tail_logits = [tail(hidden) for tail in self.tail]
        with float32_no_autocast(hidden.device):
            head_lp = upcast(head_logits).log_softmax(-1)
            parts = [head_lp[:, : self.shortlist_size]]
            for i, logits in enumerate(tail_logits):
                cluster_lp = head_lp[:, self.shortlist_size + i : self.shortlist_size + i + 1]
                parts.append(upcast(logits).log_softmax(-1) + cluster_lp)
            return torch.cat(parts, dim=-1)


def _groups(target: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Each target's group: 0 ignored (negative), 1 the short-list, i + 1 tail cluster i, by a
    comparison per group start (far cheaper than bucketize for a handful)."""
    return (target.unsqueeze(-1) >= starts).sum(-1)
