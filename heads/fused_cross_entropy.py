"""The fused linear + log-sum-exp primitive under every head's training loss.

From hidden rows ``h [N, d]`` and an output matrix ``W [V, d]`` (+ bias ``b``), the per-row
log-sum-exp of the logits ``z = h W^T + b``, the target's logit and (for label smoothing) the
sum of the logits, without a ``[N, V]`` tensor:

- the forward walks the vocabulary in column chunks (and, when ``N`` is very large, the rows
  in tiles), each chunk's product followed by its row maximum and ``sum exp``; the chunks'
  results combine as an online log-sum-exp, ``lse = m + log sum_c exp(m_c - m) s_c``;
- the backward recomputes each chunk's product and writes ``dL/dz = g p + g_t onehot + g_s``
  for that chunk only (``p = exp(z - lse)``), straight into the two products
  ``dL/dh += dz W_c`` and ``dL/dW_c = dz^T h``: memory ``O(N chunk + N d)`` besides the
  gradients themselves.
- Chunk results may be kept for the backward instead of recomputed, up to a byte budget
  (``LossOptions.saved_bytes``): small problems then run three products, as an unfused loss
  does, and large ones four, in bounded memory.

Under autocast the products run in the autocast dtype and everything else (maximum, exp, sums,
log-sum-exp, the gradient of the logits) in float32; float64 stays float64. Rows are never
branched on by value (no host sync): the loops depend on shapes only, so the function traces
into one graph under ``torch.compile``.

The chunk loops live in ``heads/kernels/``: ``eager_lse.py`` (the CPU-tuned plan),
``compiled_lse.py`` (the GPU plan), both on the chunk passes of ``chunks.py``.

Backends (``LossOptions.backend``): ``torch`` (the portable path above, the default), and on
CUDA the optional ``cce`` (Apple's cut-cross-entropy) and ``liger`` (Liger-Kernel's fused
linear cross-entropy), imported on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from heads.cross_entropy import IGNORE_INDEX
from heads.errors import HeadConfigError, UserError
from heads.kernels.checkpointed_lse import checkpointed_lse
from heads.kernels.chunks import accumulation_dtype, compute_dtype, gpu_plans
from heads.kernels.chunks import spans as spans  # re-exported: callers plan chunks with it
from heads.kernels.compiled_lse import CompiledLinearLSE, own_targets
from heads.kernels.eager_lse import EagerLinearLSE
from heads.kernels.rows_ce import (
    RowsCrossEntropy,
    RowWeights,
    padded_columns,
    padded_weight,
    tile_bytes_per_logit,
)
from heads.kernels.rows_ce import fused_products_missing as fused_products_missing  # re-exported

BACKENDS = ("auto", "torch", "cce", "liger")
PLANS = ("auto", "eager", "compiled", "checkpoint", "rows", "plain")

# Working set of one chunk's logits (float32 entries): small enough on a CPU for the chunk's
# passes to run from cache and for glibc to reuse the freed memory; on a GPU large enough for
# the products to fill the device.
_CHUNK_BYTES = {"cpu": 16 << 20}
_ACCELERATOR_CHUNK_BYTES = 128 << 20
# CUDA: at most this many chunks per row tile (each chunk is a few kernel launches and a
# product; fewer, wider chunks fill the GPU), at least _CUDA_MIN_BYTES of logits per chunk,
# and no chunk over 1/_CUDA_MEMORY_SHARE of the device's memory (then rows are tiled).
_CUDA_MAX_CHUNKS = 32
_CUDA_MIN_BYTES = 256 << 20
_CUDA_MEMORY_SHARE = 16
# Chunk results kept for the backward instead of recomputed, per call (see LossOptions).
DEFAULT_SAVED_BYTES = 128 << 20
# Plan rows on CUDA: an adaptive softmax's classifier over at most this many logits runs as
# plain maths (plain_loss_fits), a larger one by the rows plan. Plain maths moves ~46 bytes a
# logit forward and backward (bf16 logits, a float32 copy, log-softmax and its backward, dz
# read by two products), the rows plan's Triton tiles ~8 (heads/kernels/rows_ce.py): ~38 bytes
# more, ~13 ps a logit at an H100's ~3 TB/s. The rows plan costs host time instead: 20 more
# top-level operators and 0.18-0.25 ms more a classifier on the launch-bound proxy (CUDA's
# plans on one CPU thread, V = 1,000, d = 32, 32 tokens, Triton's launches stubbed: 1.40 ms a
# step for three classifiers by rows, 0.67 plainly, on 2026-11-27's slower machine; 0.91 and
# 0.36 on the one before: docs/results/profile_cpu_cuda_plans_adaptive_rows_1k.json), which a
# host-bound step pays in full: the H100's plain step at V = 10k, d = 512, 16,384 tokens took
# 3.45 ms (docs/results/bench_gpu_heads_10k.json) for under 1 ms of device work by these figures
# (30M logits, 32 GFLOP). The two match near 14M logits: 2^24 (64 MiB of float32 logits,
# within the saved budget). At the benchmark's d = 512 and 16,384 tokens, V = 10k's
# classifiers (6.5M-12M logits) stay plain and V = 100k's (48M-106M) run by rows, as under the
# saved budget alone. Not yet timed on a GPU: adaptive@rows against adaptive@plain with
# --saved-mb 0 (every classifier by rows) at V = 10k would place it.
ROWS_PLAIN_LOGITS = 1 << 24
# On a CPU an adaptive softmax's classifier of at most this many logits (rows x columns) runs
# as plain maths under ``auto``: there the hand-written loop's fixed cost per classifier
# outweighs its saved traffic. Measured on 2 cores (bench_cpu_adaptive_small_plain_*): the
# classifiers of V = 2,000, d = 64, 256 tokens (26k-41k logits) ran plainly in 1.1 ms against
# 1.9 by the loop, PyTorch's layer 0.9; level at V = 10k, d = 200 and 512 (0.3M-1.5M); at
# V = 33k, d = 512, 4,096 tokens (4.6M-9.3M) the loop's 338 ms against 445 plainly.
CPU_PLAIN_LOGITS = 1 << 21
# the rows plan's tiles (row_tile)
_ROWS_MIN_CPU = 512
_ROWS_MAX_CPU_BYTES = 256 << 20
# a CUDA tile's memory (row_tile): 4,026 rows of Triton tiles (bf16 logits, dz written over
# them) at V = 100k; on an H200 (d = 512, 16,384 tokens) tiles of 2,684 / 4,096 / 16,384 rows
# took 12.9 / 12.1 / 11.8 ms a step for 631 / 902 / 3,259 MiB more than the inputs (2026-11-26)
_ROWS_CUDA_BYTES = 768 << 20
# a mixture's (MoS: K N rows, K times the products): wider tiles, fewer passes of the float32
# dW accumulator (208 MiB at V = 100k, read and written per tile); the H200's compiled tiles
# of MoS-15 at V = 100k took 219 ms at 2,684 rows, 205 at 32,768 (2026-11-26)
_ROWS_CUDA_MIXTURE_BYTES = 3 << 30
_MIN_COLUMNS = 128  # narrower chunks make the products inefficient: tile the rows instead
_ALIGN = 16  # chunk widths are multiples of 16 columns (MKL and tensor cores prefer them)


@dataclass(frozen=True)
class LossOptions:
    """How a head's training loss runs (a task's ``loss_backend`` sets ``backend``).

    backend: ``auto`` (= ``torch`` until other backends are measured faster), ``torch``,
        ``cce`` or ``liger`` (see the module docstring).
    chunk_bytes: bytes of one chunk's float32 logits; None: 16 MiB on a CPU, 128 MiB on a GPU.
    saved_bytes: chunk results the forward may keep for the backward instead of recomputing
        them, per call (default 128 MiB; 0: always recompute).
    columns, rows: force the chunk width and the row tile (tests, tuning); None: from bytes.
    fold: how the backward forms ``dL/dz``: True, chunk by chunk in one pass over the logits;
        False, by scaling ``[N, d]`` rows; None: True where ``V <= 4 d`` (tests, tuning).
    plan: ``eager`` (the hand-written chunk loop, tuned for CPUs), ``compiled`` (one
        compiled function per chunk, ``heads/kernels/compiled_lse.py``, tuned for GPUs),
        ``checkpoint`` (plain maths per chunk under ``torch.utils.checkpoint``: the yardstick
        the hand-written plans are measured against), ``rows`` (a whole mean loss, of a
        softmax, a mixture or Mixtape's rare block, with its gradient computed in the
        forward by row tiles over the whole vocabulary: three products instead of four,
        ``heads/kernels/rows_ce.py``; the heads' other blocks run as under ``auto``; on CUDA
        a step small enough to be launch-bound runs plainly: :func:`plain_loss_fits`; an
        adaptive softmax's training step there is its whole loss as one function,
        ``heads/kernels/adaptive_rows.py``),
        ``plain`` (an adaptive softmax's classifiers as one product and PyTorch's fused
        log-softmax and NLL: :func:`plain_nll`; the rest as under ``auto``), or ``auto``:
        compiled on CUDA, eager elsewhere (rows for a whole mean loss on a CPU:
        :func:`mean_loss_plan`; plain on CUDA for a classifier whose logits fit
        ``saved_bytes``: :func:`plain_loss_fits`).
    device_memory: bytes of device memory the CUDA chunks are planned for; None: the
        device's own (tests state one to check a plan on a CPU).
    fused_products: the rows plan's Triton tiles (CUDA, half-precision products) as three
        Triton products with the softmax inside them (``heads/kernels/triton_gemm.py``)
        instead of cuBLAS's with two kernels between them; a task's ``loss_backend: fused``.
    """

    backend: str = "auto"
    chunk_bytes: int | None = None
    saved_bytes: int = DEFAULT_SAVED_BYTES
    columns: int | None = None
    rows: int | None = None
    fold: bool | None = None
    plan: str = "auto"
    device_memory: int | None = None
    fused_products: bool = False

    def __post_init__(self) -> None:
        check_backend(self.backend)
        if self.plan not in PLANS:
            raise HeadConfigError(f"LossOptions.plan must be one of {', '.join(PLANS)}")
        for name in ("chunk_bytes", "columns", "rows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise HeadConfigError(f"LossOptions.{name} must be a positive integer or None")
        if not isinstance(self.saved_bytes, int) or self.saved_bytes < 0:
            raise HeadConfigError("LossOptions.saved_bytes must be a non-negative integer")


def check_backend(name: str) -> None:
    if name not in BACKENDS:
        raise HeadConfigError(
            f"loss backend {name!r} is not one of {', '.join(BACKENDS)}: set loss_backend to one"
        )


# the rows plan with its tiles as fused Triton products (LossOptions.fused_products): a loss
# choice of its own, so that a task's config, the benchmark's subjects and auto's measured
# table name it as they name a plan
FUSED = "fused"
# A task's ``loss_backend``: a backend, or a plan of the torch backend (LossOptions.plan)
LOSS_CHOICES = BACKENDS + tuple(plan for plan in PLANS if plan != "auto") + (FUSED,)


def check_loss_choice(name: str) -> None:
    """A task's ``loss_backend``: one of :data:`LOSS_CHOICES`, else one line naming them."""
    if name not in LOSS_CHOICES:
        raise HeadConfigError(
            f"loss_backend {name!r} is not one of {', '.join(BACKENDS)} (backends) or "
            f"{', '.join(LOSS_CHOICES[len(BACKENDS) :])} (plans of the torch backend; fused: "
            f"rows with the fused products): set "
            f"model.loss_backend to one"
        )


class MissingBackendError(UserError, ImportError):
    """An optional loss backend was asked for but its package (or device) is not there."""


# -- chunking ---------------------------------------------------------------------------------
def plan_tiles(
    rows: int, columns: int, device: torch.device, options: LossOptions, entries_per_column=1
) -> tuple[int | None, int]:
    """``(row tile, chunk width)`` for ``[rows, columns]`` logits with ``entries_per_column``
    float32 values held per entry (Mixtape's blocks hold ``2K``): the chunk's working set
    stays near ``options.chunk_bytes``. Both only depend on the shapes."""
    budget = options.chunk_bytes or _CHUNK_BYTES.get(device.type, _ACCELERATOR_CHUNK_BYTES)
    if gpu_plans(device) and options.chunk_bytes is None:
        budget = cuda_chunk_bytes(rows, columns, entries_per_column, device, options)
    entries = max(1, budget // (4 * entries_per_column))
    width = options.columns
    if width is None:
        width = max(entries // max(rows, 1) // _ALIGN * _ALIGN, _MIN_COLUMNS)
        # as many chunks, of even widths: no narrow last chunk (a slower product)
        count = math.ceil(columns / width)
        width = math.ceil(math.ceil(columns / count) / _ALIGN) * _ALIGN
    width = max(1, min(width, columns))
    tile = options.rows
    if tile is None:  # all rows, unless even the narrowest chunk of them is over budget
        tile = rows if rows * width <= entries else entries // width
    return max(1, min(tile, rows)), width


def cuda_chunk_bytes(
    rows: int, columns: int, entries_per_column: int, device: torch.device, options: LossOptions
) -> int:
    """A CUDA chunk's bytes: wide enough for at most ``_CUDA_MAX_CHUNKS`` chunks (MoS's K N
    rows get chunks as wide as the softmax's N rows), at least ``_CUDA_MIN_BYTES``, at most
    a ``1/_CUDA_MEMORY_SHARE`` of the device memory."""
    memory = options.device_memory or _device_memory(device)
    width = math.ceil(columns / _CUDA_MAX_CHUNKS)
    wanted = 4 * entries_per_column * max(rows, 1) * width
    return max(_CUDA_MIN_BYTES, min(wanted, memory // _CUDA_MEMORY_SHARE))


# what the GPU plans assume of a device that is no GPU (GPU_PLAN_DEVICES): an H100's memory
_PLANNED_GPU_MEMORY = 80 << 30


def _device_memory(device: torch.device) -> int:
    """The CUDA device's memory in bytes (a property query: no sync)."""
    if device.type != "cuda":
        return _PLANNED_GPU_MEMORY
    return torch.cuda.get_device_properties(device).total_memory


class LinearLSE(NamedTuple):
    """Per-row results of :func:`linear_lse` (float32; float64 for float64 inputs)."""

    lse: torch.Tensor  # log sum_x exp(z_x)
    target_logit: torch.Tensor  # z_target, 0 where the target is outside [0, V)
    logit_sum: torch.Tensor | None  # sum_x z_x, when asked for


def linear_lse(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    *,
    logit_sum: bool = False,
    options: LossOptions | None = None,
    row_bound: int | None = None,
) -> LinearLSE:
    """Log-sum-exp, target logit and (``logit_sum=True``) logit sum of ``hidden W^T + b`` per
    row, differentiable, without a ``[N, V]`` tensor (module docstring). A target outside
    ``[0, V)`` (another block of the vocabulary, or ignored) just has no target logit.

    ``row_bound``: the row count is data-dependent (rows gathered by value, e.g. an adaptive
    tail cluster's) and at most this: the chunks are planned for it and the rows are not
    tiled, so that under ``torch.compile`` nothing branches on the count."""
    options = options or LossOptions()
    _check_shapes(hidden, weight, bias, target)
    if target is None:
        target = torch.full((hidden.size(0),), -1, dtype=torch.long, device=hidden.device)
    backend = resolve_backend(options.backend, hidden)
    if backend in ("cce", "liger"):
        return _external_lse(backend, hidden, weight, bias, target, logit_sum)
    v = weight.size(0)
    if row_bound is None:
        tile, width = plan_tiles(hidden.size(0), v, hidden.device, options)
        saved = kept_bytes(options, hidden, weight, bias)
    else:
        (_, width), tile, saved = plan_tiles(row_bound, v, hidden.device, options), None, 0
    if options.plan == "checkpoint":  # plain maths per chunk: the hand-written plans' yardstick
        target = own_targets(target, v)
        dtype = compute_dtype(hidden, weight)
        lse, target_logit = checkpointed_lse(hidden, weight, bias, target, width, dtype)
        return LinearLSE(lse, target_logit, logit_sums(hidden, weight, bias) if logit_sum else None)
    if resolve_plan(options.plan, hidden) == "compiled":
        acc = accumulation_dtype(hidden, weight)
        lse, target_logit = CompiledLinearLSE.apply(
            hidden, weight, bias, target, compute_dtype(hidden, weight), acc, tile, width
        )
        return LinearLSE(lse, target_logit, logit_sums(hidden, weight, bias) if logit_sum else None)
    lse, target_logit, total = EagerLinearLSE.apply(
        hidden, weight, bias, target, logit_sum, compute_dtype(hidden, weight), tile, width,
        saved, options.fold,
    )  # fmt: skip
    return LinearLSE(lse, target_logit, total if logit_sum else None)


def kept_bytes(options: LossOptions, *inputs: torch.Tensor | None) -> int:
    """Bytes of chunk results the forward may keep for the backward: ``options.saved_bytes``
    where a backward can run (gradients enabled and an input that requires them), else 0. An
    evaluation forward (``torch.no_grad``: validation's perplexity) kept a prefix of chunks up
    to the whole budget that nothing read: 128 MiB more at its peak, and a pass over them."""
    wanted = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    return options.saved_bytes if wanted else 0


def resolve_plan(plan: str, hidden: torch.Tensor) -> str:
    """The column plan that runs: ``auto`` (and ``rows``, which only a single softmax's mean
    loss runs by rows: :func:`mean_cross_entropy`) is the compiled chunk plan on CUDA, the
    eager one (CPU-tuned) elsewhere."""
    if plan in ("auto", "rows", "plain"):
        return "compiled" if gpu_plans(hidden.device) else "eager"
    return plan


def row_tile(
    rows: int,
    columns: int,
    device: torch.device,
    options: LossOptions,
    bytes_per_logit: int = 4,
    mixture: bool = False,
    unit: int = 1,
) -> int:
    """Rows per tile of the ``rows`` plan (``options.rows``, or from ``options.chunk_bytes``
    of float32 logits over all ``columns``). A CPU tile has at least ``_ROWS_MIN_CPU`` rows
    (the ``dW`` product's inner size: measured 15% faster at V = 33k, d = 512 than the chunk
    budget's 127), within ``_ROWS_MAX_CPU_BYTES``; a CUDA tile takes at most
    ``_ROWS_CUDA_BYTES`` (a ``mixture``'s: ``_ROWS_CUDA_MIXTURE_BYTES``) and a
    ``1/_CUDA_MEMORY_SHARE`` of the device memory, at ``bytes_per_logit`` (what the tile body
    holds per logit: ``rows_ce.tile_bytes_per_logit``). A CUDA tile is then evened out: as
    many tiles as the budget needs, of equal rows (whole ``unit``s: a token's ``k`` rows), so
    that no short last tile holds the budget's memory for a few rows and runs its products
    nearly empty (V = 100k, 16,384 tokens: 5 tiles of 3,277 rows, not 4 of 4,026 and 280;
    the same passes of the ``dW`` accumulator, 19% less memory)."""
    if options.rows is not None:
        return max(1, min(options.rows, rows))
    if options.chunk_bytes is not None:
        tile = options.chunk_bytes // (4 * columns)
    elif gpu_plans(device):
        memory = options.device_memory or _device_memory(device)
        wanted = _ROWS_CUDA_MIXTURE_BYTES if mixture else _ROWS_CUDA_BYTES
        budget = min(wanted, memory // _CUDA_MEMORY_SHARE)
        tile = _even_tiles(rows, budget // (bytes_per_logit * columns), unit)
    else:
        wide = max(_CHUNK_BYTES["cpu"] // (4 * columns), _ROWS_MIN_CPU)
        tile = min(wide, _ROWS_MAX_CPU_BYTES // (4 * columns))
    return max(1, min(tile, rows))


def _even_tiles(rows: int, most: int, unit: int) -> int:
    """Rows a tile of the fewest tiles of whole ``unit``s over ``rows`` with at most ``most``
    rows each (``unit`` rows where not one unit fits)."""
    units, per_tile = -(-rows // unit), max(1, most // unit)
    tiles = -(-units // per_tile)
    return -(-units // tiles) * unit


def logit_sums(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``sum_x z_x = h . sum_x W_x + sum_x b_x`` per row, in the accumulation dtype: one
    ``[N, d]`` product instead of a pass over the logits (autograd differentiates it)."""
    acc = accumulation_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):
        total = hidden.to(acc) @ weight.to(acc).sum(0)
        return total if bias is None else total + bias.to(acc).sum()


class CrossEntropyRows(NamedTuple):
    """Per-row cross-entropy of :func:`linear_cross_entropy`, 0 at ignored rows."""

    nll: torch.Tensor  # -log p_target (never smoothed)
    smoothing: torch.Tensor | None  # mean_x(-log p_x), with label smoothing
    lse: torch.Tensor  # log Z (any value at ignored rows)

    def loss(self, label_smoothing: float = 0.0) -> torch.Tensor:
        """``(1 - eps) nll + eps smoothing`` per row: its gradient is ``p - q`` with
        ``q = (1 - eps) onehot + eps / V``."""
        if not label_smoothing:
            return self.nll
        return (1 - label_smoothing) * self.nll + label_smoothing * self.smoothing


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    options: LossOptions | None = None,
    row_bound: int | None = None,
) -> CrossEntropyRows:
    """Cross-entropy of ``softmax(hidden W^T + b)`` per row, fused and chunked (module
    docstring): ``nll``, and with ``label_smoothing`` the smoothing term, both 0 (and with
    zero gradient) where ``target == ignore_index``. Same values and gradients as
    ``F.cross_entropy(F.linear(hidden, weight, bias), target, reduction="none")`` (tested)."""
    if target is None:
        raise ValueError("linear_cross_entropy needs a target [N]")
    keep = target != ignore_index
    parts = linear_lse(
        hidden, weight, bias, torch.where(keep, target, -1),
        logit_sum=bool(label_smoothing), options=options, row_bound=row_bound,
    )  # fmt: skip
    zero = torch.zeros_like(parts.lse)
    nll = torch.where(keep, parts.lse - parts.target_logit, zero)
    smoothing = None
    if label_smoothing:
        mean_logit = parts.logit_sum / weight.size(0)
        smoothing = torch.where(keep, parts.lse - mean_logit, zero)
    return CrossEntropyRows(nll, smoothing, parts.lse)


class MeanCrossEntropy(NamedTuple):
    """A single softmax's training loss: the mean over kept rows of ``(1 - eps) nll + eps
    smoothing``, and the per-row ``nll`` (0 at ignored rows) for the metrics."""

    loss: torch.Tensor
    nll: torch.Tensor


def mean_loss_plan(options: LossOptions, hidden: torch.Tensor, columns: int) -> str:
    """The plan of a whole mean loss (a softmax's, a mixture's ``[N K, d]`` rows, a block's)
    over ``columns``: ``auto`` on a CPU, run eagerly, is ``rows`` where the column plan would
    recompute logits (``N x columns`` float32 over ``options.saved_bytes``; measured 16-19%
    faster for softmax and 4% for Mixtape at V = 33k, d = 512, 4,096 tokens, 19% for MoS-15 at
    V = 10k, d = 200, with less memory) and the column plan where it keeps them all (there 2-4%
    faster: V = 10k, d = 200, 700 tokens, softmax and Mixtape); docs/results/
    bench_cpu_rows_heads_*.json and bench_cpu_mos_rows_10k_d200.json. Under ``torch.compile``
    and on CUDA: the column plan of :func:`resolve_plan`, unless ``MEASURED_FASTEST`` names
    the rows plan for the head and size (measured faster on an H100 up to V = 100k)."""
    if resolve_backend(options.backend, hidden) != "torch":
        return options.backend
    if options.plan in ("auto", "plain"):
        # traced by torch.compile, the rows plan's backward always gets a tangent for its NLL
        # output (zeros) and runs its extra pass: the column plan runs fewer products there
        eager_cpu = not gpu_plans(hidden.device) and not torch.compiler.is_compiling()
        recomputes = 4 * hidden.size(0) * columns > options.saved_bytes
        return "rows" if eager_cpu and recomputes else resolve_plan("auto", hidden)
    return options.plan


def mean_weights(keep: torch.Tensor, like: torch.Tensor) -> RowWeights:
    """Each token's weight in a mean loss: ``1 / count`` where ``keep``, else 0 (in the
    accumulation dtype of ``like``: float64 stays float64)."""
    return RowWeights.mean(keep, accumulation_dtype(like))


def mean_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    *,
    log_prior: torch.Tensor | None = None,
    outside: tuple[torch.Tensor, torch.Tensor] | None = None,
    weights: RowWeights | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = IGNORE_INDEX,
    options: LossOptions | None = None,
) -> MeanCrossEntropy | None:
    """The whole mean loss of ``softmax(hidden W^T + b)`` by the ``rows`` plan, its gradient
    computed in the forward (``heads/kernels/rows_ce.py``). With ``log_prior`` ``[N, K]``: of
    the mixture ``sum_k pi_k softmax(z_k)`` over the ``[N K, d]`` component rows ``hidden``
    (token-major). With ``outside = (lse, target logit)`` ``[N]`` of the rest of the
    vocabulary: of the softmax over both, these columns one block of it (``target`` then
    counts here only inside ``[0, V)``). ``weights`` (:func:`mean_weights`): each token's
    weight in the loss (0: ignored), when it is not ``1 / count`` over the tokens whose target
    is inside ``[0, V)`` (a block's or a cluster's tokens are counted among all of the
    batch's).
    None where another plan or backend runs (:func:`mean_loss_plan`), or for a mixture or a
    block with label smoothing: the caller then runs its column plan."""
    options = options or LossOptions()
    mixed = log_prior is not None or outside is not None
    if mean_loss_plan(options, hidden, weight.size(0)) != "rows" or (mixed and label_smoothing):
        return None
    k = 1 if log_prior is None else log_prior.size(1)
    if hidden.size(0) != k * target.size(0):
        raise ValueError(f"hidden must be [N K, d] = [{k * target.size(0)}, d], got "
                         f"{tuple(hidden.shape)}")  # fmt: skip
    _check_shapes(hidden, weight, bias, None)
    v = weight.size(0)
    inside = (target >= 0) & (target < v) & (target != ignore_index)
    if weights is None:
        weights = RowWeights.mean(inside, accumulation_dtype(hidden, weight))
    elif not isinstance(weights, RowWeights):  # (a plain [N] tensor would unpack by rows)
        raise TypeError(f"weights must be RowWeights (mean_weights), got {type(weights)}")
    outside_lse, outside_logit = (None, None) if outside is None else outside
    dtype = compute_dtype(hidden, weight)
    held = tile_bytes_per_logit(hidden.device, dtype)
    tile = row_tile(hidden.size(0), v, hidden.device, options, held, mixture=k > 1, unit=k)
    loss, nll = RowsCrossEntropy.apply(
        hidden, weight, bias, torch.where(inside, target, -1), log_prior, outside_lse,
        outside_logit, *weights, float(label_smoothing), dtype, tile,
        torch.is_grad_enabled(), options.fused_products,
    )  # fmt: skip
    return MeanCrossEntropy(loss, nll)


def plain_loss_fits(
    options: LossOptions, device: torch.device, rows: int, columns: int, *,
    classifier: bool = False,
) -> bool:  # fmt: skip
    """Whether a loss over ``rows x columns`` logits runs as plain maths (:func:`plain_nll`):
    always with ``plan="plain"``; on the GPU plans' devices (CUDA) under ``auto`` and
    ``rows`` where the float32 logits fit ``options.saved_bytes`` (the budget the column plans
    may keep anyway), and under ``rows`` for a ``classifier`` (one of an adaptive softmax's)
    only up to :data:`ROWS_PLAIN_LOGITS` logits too.

    There the chunk machinery saves no memory and costs launches and host time, what a GPU
    step of small classifiers is made of: an adaptive softmax's step at V = 1,000, d = 32, 32
    tokens (one CPU thread: the launch-bound proxy) dispatched 257 operators in 0.81 ms of
    host time by the eager plan, 98 in 0.35 ms plainly, PyTorch's own layer 108 in 0.31 ms
    (docs/results/profile_cpu_launch_bound_1k.json); on an H100 ours measured 0.45x as fast as
    PyTorch's at V = 10k. On a CPU under ``auto`` only an adaptive softmax's ``classifier``
    of at most :data:`CPU_PLAIN_LOGITS` logits (within the budget too): the hand-written plan
    is faster once the products count (V = 33k, d = 512, 4,096 tokens, 141 ms against 190
    plainly and PyTorch's 179: docs/results/bench_cpu_adaptive_plain_d512.json), and a
    single softmax pays the loop's fixed cost once.

    ``classifier``: an adaptive softmax's ``rows`` is only ever asked for (its ``auto`` on
    CUDA is ``torch`` or ``plain``: MEASURED_FASTEST), so a large classifier takes the rows
    plan it asks for. A softmax's and Mixtape's ``rows`` is what their ``auto`` runs on CUDA
    up to V = 100k (``measured_options``), plain up to the saved budget: kept so (False) until
    a GPU run measures the crossover there."""
    if options.backend not in ("auto", "torch"):
        return False
    if options.plan == "plain":
        return True
    fits = 4 * rows * columns <= options.saved_bytes
    if not gpu_plans(device):  # a CPU: a small classifier's fixed cost is the hand-written loop's
        small = classifier and rows * columns <= CPU_PLAIN_LOGITS
        return options.plan == "auto" and small and fits
    if options.plan not in ("auto", "rows"):
        return False
    if options.plan == "rows" and classifier and rows * columns > ROWS_PLAIN_LOGITS:
        return False
    # rows: the measured choice for large steps (MEASURED_FASTEST); a small one is plainer
    return fits


def dense_loss_fits(options: LossOptions, device: torch.device, rows: int, columns: int) -> bool:
    """Whether a head whose vocabulary is split among classifiers (an adaptive softmax's short
    list and tail clusters) runs every classifier over every row as plain maths: on the GPU
    plans' devices (CUDA) under ``auto`` and ``plain``, where the float32 logits of all of them
    (``rows x columns``) fit ``options.saved_bytes``, the budget within which every other head
    runs plainly there too (:func:`plain_loss_fits`).

    Each classifier then runs on every row, a tail cluster's targets ignored outside it: more
    device work than on the cluster's own rows, but no sort, no gather, and above all no
    read-back of the group sizes. On a GPU that read-back makes the host wait until the device
    has run everything queued before it (a whole LM step's backbone forward) before it launches
    the head: host and device take turns instead of overlapping. Within the budget (e.g. a PTB
    step, 700 tokens at V = 10k: 7M logits) the extra work is a fraction of a millisecond on
    an H100. Never on a CPU, where the products' work counts and the hand-written plan on each
    cluster's own rows is the faster (:func:`plain_loss_fits`)."""
    return (
        options.backend in ("auto", "torch")
        and options.plan in ("auto", "plain")
        and gpu_plans(device)
        and 4 * rows * columns <= options.saved_bytes
    )


def plain_nll(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor
) -> torch.Tensor:
    """``-log softmax(hidden W^T + b)[target]`` per row, 0 where ``target`` is
    ``IGNORE_INDEX``: :func:`plain_cross_entropy` without label smoothing."""
    return plain_cross_entropy(hidden, weight, bias, target, smoothing=False)[0]


def plain_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    smoothing: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """:func:`log_softmax_rows` of ``hidden W^T + b``: one product, then PyTorch's fused
    log-softmax and NLL kernels in the accumulation dtype (float32 under autocast),
    differentiated by autograd."""
    nll, log_probs = plain_log_probs(hidden, weight, bias, target)
    return nll, -log_probs.mean(1) if smoothing else None


def plain_log_probs(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`log_probs_and_nll` of ``hidden W^T + b`` in the accumulation dtype (the
    log-probabilities ``[N, V]``; a large product's columns aligned: :func:`aligned_columns`)."""
    columns = weight.size(0)
    weight, bias = aligned_columns(hidden, weight, bias)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    # the log-softmax takes the product's logits and writes float32 (float16 ones on CUDA in one
    # kernel each way, PyTorch's half_to_float: no float32 copy, no cast of their gradient)
    nll, log_probs = log_probs_and_nll(logits, target, accumulation_dtype(hidden, weight))
    return nll, log_probs if weight.size(0) == columns else log_probs[:, :columns]


# A product of V columns, V no multiple of 8, runs cuBLAS's slow align1 kernels (its rows are not
# 16-byte aligned: an H100 ran the adaptive softmax's classifiers at V = 100k, 2,961, 28,573
# and 68,468 columns, and PyTorch's layer alike, in cutlass_75 align1 kernels: 2.0 ms of a 7.0
# ms step, docs/results/profile_gpu_heads_100k.json); a large plain product is padded as the
# rows plan pads its tiles (rows_ce.padded_columns). Large: 2 N d V FLOPs at least this (the
# adaptive softmax's at V = 100k, 16,384 tokens: 7 to 50 GFLOP); a smaller step is launch-
# bound (a PTB step's largest, 0.4 GFLOP), where the padding's operators would cost more
PLAIN_ALIGN_FLOPS = 1 << 32


def aligned_columns(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W, b)`` with zero rows after ``W``'s and ``-inf`` after ``b``'s up to
    :func:`~heads.kernels.rows_ce.padded_columns` where ``V`` is no multiple of 8, on the GPU
    plans' devices, for a product of at least :data:`PLAIN_ALIGN_FLOPS` (unchanged elsewhere):
    the extra columns' logits are ``-inf``, so a softmax over them is the one over ``V`` and
    their gradient is 0."""
    if weight.size(0) % 8 == 0 or not gpu_plans(hidden.device):  # 16-byte rows already
        return weight, bias
    if 2 * hidden.size(0) * weight.size(1) * weight.size(0) < PLAIN_ALIGN_FLOPS:
        return weight, bias
    if bias is None:
        bias = weight.new_zeros(weight.size(0))
    columns = padded_columns(weight.size(0))
    bias = torch.nn.functional.pad(bias, (0, columns - weight.size(0)), value=-math.inf)
    return padded_weight(weight, columns, weight.dtype), bias


def log_probs_and_nll(
    logits: torch.Tensor, target: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, ...]:
    """``(-log p_target, log p)`` of ``[N, V]`` logits (in ``dtype``, default theirs;
    autocast off): PyTorch's fused log-softmax and NLL kernels, the NLL 0 where ``target``
    is ``IGNORE_INDEX``."""
    with torch.autocast(logits.device.type, enabled=False):
        log_probs = logits.log_softmax(1, dtype=dtype)
        nll = torch.nn.functional.nll_loss(log_probs, target, reduction="none",
                                           ignore_index=IGNORE_INDEX)  # fmt: skip
    return nll, log_probs


def log_softmax_rows(
    logits: torch.Tensor, target: torch.Tensor, smoothing: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(-log p_target, mean_x(-log p_x) or None)`` per row of ``[N, V]`` logits
    (:func:`log_probs_and_nll`)."""
    nll, log_probs = log_probs_and_nll(logits, target)
    return nll, -log_probs.mean(1) if smoothing else None


def combine_lse(*parts: torch.Tensor) -> torch.Tensor:
    """The log-sum-exp over several blocks of the vocabulary from each block's: their
    ``logsumexp``, whose gradient hands every block its share ``exp(lse_b - lse)``."""
    return torch.logsumexp(torch.stack(parts), dim=0)


def _check_shapes(hidden, weight, bias, target) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(
            f"linear_lse expects hidden [N, d] and weight [V, d], got {tuple(hidden.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.size(0)}], got {tuple(bias.shape)}")
    if target is not None and target.shape != hidden.shape[:1]:
        raise ValueError(f"target must be [N] = [{hidden.size(0)}], got {tuple(target.shape)}")


# -- backends ---------------------------------------------------------------------------------
# The field's fused kernels, optional and CUDA-only (requirements-gpu.txt). Each is called
# through its version's own arguments; another version is refused with the pin to install.
EXTERNAL_PACKAGES = {"cce": "cut-cross-entropy==25.1.1", "liger": "liger-kernel==0.8.5"}

# auto on CUDA: the backend (cce, liger) or torch plan (rows, plain) the GPU benchmark measured
# fastest, per head class, at vocabulary sizes up to the first number (bf16, d = 512, 16,384
# tokens; `bash .ci/gpu bench` prints this line: `python -m app.bench.fastest`). Heads or sizes
# not listed (beyond 100k: unmeasured), or a backend not installed: the compiled column plan.
# H100, torch 2.11, 2026-11-26 (the full bench; the defaults then: the compiled column plan),
# ms per step:
#   softmax  10k 4.66 -> rows 2.31;  100k 25.69 -> rows 16.99 (CCE 66.3, Liger 72.8)
#   MoS-15   10k 110.0 -> rows 24.5 (Liger 52.3);  100k 361.6 -> rows 259.0 (Liger 456.9)
#   Mixtape  10k 12.10 -> rows 10.16;  100k 63.46 -> rows 56.79
#   adaptive 10k 3.57 (plain 3.45, within the noise);  100k 11.87 -> plain 7.94 (PyTorch's 8.46)
# The H200 run with the rows plan's Triton tiles gave the same choices at 100k. Since, on an
# H100 (docs/results/bench_gpu_heads_{10k,100k}.json, 2026-11-27, `bash .ci/gpu quick`): rows
# with the Triton tiles and Mixtape's whole-vocabulary row tiles (heads/kernels/mixtape_rows.py)
#   softmax  10k rows 2.26 (fused 3.98);  100k rows 13.25 (fused 33.46; CCE 65.5, Liger 77.8)
#   MoS-15   100k rows 182.7 (fused 442.6);  Mixtape 10k rows 6.56;  100k rows 25.38 (fused 70.7)
#   adaptive 100k plain 7.71, rows 6.96, fused 7.17 (PyTorch's 8.55; fused / plain 0.92, 95% CI
#   0.65-0.98 over 6 repeats: a candidate for auto, not yet confirmed by the full bench)
# The adaptive softmax's rows plan as one function for its whole loss (heads/kernels/
# adaptive_rows.py), H100, 2026-11-27 (docs/results/bench_gpu_adaptive_defaults_{10k,100k}.json:
# `python -m app.bench.fastest` of them): 10k default 4.30 -> rows 2.92 (0.78x, 95% CI up to
# 0.90; plain 3.36, PyTorch's 3.02); 100k default 25.7 -> rows 14.6 (0.51x, CI up to 0.95), both
# host-bound there after the compiled default; in a process of their own
# (bench_gpu_adaptive_100k.json) rows 3.45, plain 6.43, PyTorch's 8.54
MEASURED_FASTEST: dict[str, list[tuple[int, str]]] = {
    "AdaptiveSoftmaxHead": [(10_000, "rows"), (100_000, "rows")],
    "MixtapeHead": [(10_000, "rows"), (100_000, "rows")],
    "MoSHead": [(10_000, "rows"), (100_000, "rows")],
    "SoftmaxHead": [(10_000, "rows"), (100_000, "rows")],
}


def fastest_backend(head: str, vocab_size: int, device: torch.device) -> str:
    """What ``auto`` runs for ``head`` (its class name) at ``vocab_size`` on ``device``: a
    backend, or a plan of the torch backend (:func:`measured_options`)."""
    if device.type != "cuda":
        return "torch"
    for largest, backend in MEASURED_FASTEST.get(head, []):
        if vocab_size <= largest:
            if backend not in EXTERNAL_PACKAGES:  # torch itself, or one of its plans
                return backend
            try:
                external_loss_function(backend)
            except MissingBackendError:
                return "torch"
            return backend
    return "torch"


def measured_options(options: LossOptions, choice: str) -> LossOptions:
    """``options`` running ``choice`` (:func:`fastest_backend`'s): a backend, or a plan of the
    torch backend (``fused``: ``rows`` with the fused products)."""
    if choice == FUSED:
        return dataclasses.replace(options, backend="torch", plan="rows", fused_products=True)
    if choice in PLANS:
        return dataclasses.replace(options, backend="torch", plan=choice, fused_products=False)
    return dataclasses.replace(options, backend=choice, fused_products=False)


def resolve_backend(name: str, hidden: torch.Tensor) -> str:
    """The backend that runs: ``auto`` is ``torch`` here (a task resolves ``auto`` per head
    with :func:`fastest_backend` when it knows the device); ``cce`` and ``liger`` need CUDA
    (the name itself is checked by ``LossOptions``)."""
    if name == "auto":
        return "torch"
    if name in ("cce", "liger"):
        check_backend_device(name, hidden.device)
    return name


def check_backend_device(name: str, device: torch.device) -> None:
    if name in ("cce", "liger") and device.type != "cuda":
        raise MissingBackendError(
            f"loss backend {name!r} runs on CUDA only (the model is on {device.type}):"
            f" use loss_backend auto"
        )


@functools.cache  # checked once per process: a forward must not read package metadata
def external_loss_function(name: str) -> Callable:
    """A per-row NLL function ``(h, W, b, target) -> [N]`` float32 for ``cce`` or ``liger``,
    sync-free, ``target`` all in ``[0, V)``; a one-line error naming the package to install
    when it is missing or another version."""
    import importlib
    from importlib import metadata

    package = EXTERNAL_PACKAGES[name]
    distribution, version = package.split("==")
    module = {"cce": "cut_cross_entropy.cce", "liger": "liger_kernel.transformers.functional"}
    try:
        installed = metadata.version(distribution)
        importlib.import_module(module[name])
    except (ImportError, metadata.PackageNotFoundError) as error:
        raise MissingBackendError(
            f"loss backend {name!r} needs `pip install {package}` (CUDA and Triton; "
            f"pip install -r requirements-gpu.txt): {error}"
        ) from error
    if installed != version:
        raise MissingBackendError(
            f"loss backend {name!r} is written for {package}, found {installed}: "
            f"`pip install {package}`"
        )
    return _cce_nll if name == "cce" else _liger_nll


def _cce_nll(hidden, weight, bias, target):
    """CCE 25.1.1: its public ``linear_cross_entropy`` has no bias and finds ignored rows with
    ``nonzero()`` (a host sync), so its autograd Function is called with no ignored rows and
    the bias folded in as one more column, ``[h, 1, 0...] . [W, b, 0...]`` (padded to a
    multiple of 8 columns for the kernels' alignment)."""
    from cut_cross_entropy.cce import CCEParams, linear_cross_entropy_apply
    from cut_cross_entropy.utils import _handle_eps

    if bias is not None:
        d = hidden.size(1)
        width = (d + 1 + 7) // 8 * 8
        hidden = torch.cat((hidden, hidden.new_ones(hidden.size(0), 1),
                            hidden.new_zeros(hidden.size(0), width - d - 1)), 1)  # fmt: skip
        weight = torch.cat(
            (weight, bias[:, None], weight.new_zeros(weight.size(0), width - d - 1)), 1
        )
    params = CCEParams(
        target, None, None, "none", _handle_eps("high", hidden.dtype), False, target.size()
    )
    return linear_cross_entropy_apply(hidden.contiguous(), weight.contiguous(), params)


def _liger_nll(hidden, weight, bias, target):
    """Liger 0.8.5 with ``accum_dtype=float32`` (else dW accumulates in bf16)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(
        hidden, weight, target, bias=bias, reduction="none", accum_dtype=torch.float32
    )


def _external_nll(name, hidden, weight, bias, target) -> torch.Tensor:
    """Per-row NLL from CCE or Liger, float32: both want one dtype for ``h``, ``W``, ``b``."""
    function = external_loss_function(name)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device, enabled=False):
        return function(hidden, weight, bias, target).float()


def _external_lse(name, hidden, weight, bias, target, want_sum) -> LinearLSE:
    """``lse = nll(t') + z_t'`` for a valid ``t'`` in every row (the external kernels return
    NLLs only): the ``z`` term's gradient cancels the onehot in the kernel's."""
    acc = accumulation_dtype(hidden, weight)
    valid = (target >= 0) & (target < weight.size(0))
    safe = torch.where(valid, target, 0)
    nll = _external_nll(name, hidden, weight, bias, safe).to(acc)
    with torch.autocast(hidden.device.type, enabled=False):
        h, w = hidden.to(acc), weight.to(acc)
        logit = (h * w.index_select(0, safe)).sum(1)
        if bias is not None:
            logit = logit + bias.to(acc).index_select(0, safe)
    lse = nll + logit
    total = logit_sums(hidden, weight, bias) if want_sum else None
    return LinearLSE(lse, torch.where(valid, logit, torch.zeros_like(logit)), total)
