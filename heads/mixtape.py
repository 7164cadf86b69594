"""Mixtape output layer (Yang, Luong, Salakhutdinov, Le, NeurIPS 2019; mixtape.txt).

One softmax over vector-gated logits (Eq. 2)::

    logit_{c,x} = sum_k pi_{c,x,k} (h_{c,k} . w_x) + b_x

with priors from a sigmoid tree (Eq. 3) over gate pre-activations (Eq. 4)
``l_{c,x,k} = v_x . tanh(U_k g_c) + u_k . g_c + b_{x,k}`` for the S most frequent tokens,
and the shared ``l_{c,k} = u_k . g_c`` (Eq. 6) for all others. Context embeddings
``h_{c,k} = tanh(H_k g_c)`` (Eq. 5). For the shared-gate tokens the K contexts are mixed
first and multiplied with ``W`` once, so no ``[N, K, V]`` tensor is built.

Training (``forward``) never builds the ``[N, V]`` logits: the frequent tokens' gated logits
go through ``mixtape_frequent_lse`` (the same equations by vocabulary blocks, recomputed in a
hand-written backward: ``heads/kernels/mixtape_frequent.py``; the sigmoid tree is
``heads/kernels/sigmoid_tree.py``), the shared-gate tokens are one plain linear block on the
mixed context (the fused primitive, ``heads/fused_cross_entropy.py``), and the two partial
log-sum-exps combine into the one normaliser of Eq. 2. The ``rows`` plan (CUDA's ``auto``
for large steps) instead takes both blocks by row tiles, the gradient computed in the forward
(``heads/kernels/mixtape_rows.py``: Triton kernels for the gated block on GPUs). ``logits`` /
``log_prob`` build the exact ``[N, V]`` for evaluation, a block of rows at a time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import (
    HeadOutput,
    SingleSoftmaxHead,
    check_dropout,
    check_label_smoothing,
    check_positive_int,
    float32_no_autocast,
    output_bias,
    upcast,
)
from heads.cross_entropy import IGNORE_INDEX
from heads.errors import HeadConfigError
from heads.fused_cross_entropy import (
    LinearLSE,
    combine_lse,
    kept_bytes,
    linear_lse,
    log_softmax_rows,
    mean_cross_entropy,
    mean_loss_plan,
    mean_weights,
    plain_loss_fits,
    plan_tiles,
    resolve_backend,
    resolve_plan,
    row_tile,
)
from heads.kernels.chunks import compute_dtype
from heads.kernels.compiled_lse import compiled_body
from heads.kernels.compiled_mixtape import CompiledMixtapeFrequentLSE
from heads.kernels.locked_dropout import locked_dropout
from heads.kernels.mixtape_frequent import FrequentThenRareLogits, MixtapeFrequentLSE
from heads.kernels.mixtape_rows import MixtapeRowsCrossEntropy, tile_logits_per_row
from heads.kernels.sigmoid_tree import SigmoidTreeMix, sigmoid_tree_priors

# rows per block of the exact log_prob (evaluation): [rows, K, S] products and [rows, V] logits
_EVAL_ROWS = 1024


class MixtapeHead(SingleSoftmaxHead):
    """Mixtape: logit-space vector gating with sigmoid-tree gates and gate sharing.

    Args:
        hidden_size: size ``d1`` of the last-layer hidden states ``g_c``.
        vocab_size: number of classes; ids must be sorted by decreasing frequency.
        num_components: K, a power of two >= 2 (the paper uses 4).
        frequent_ratio: r = S / V, the share of most frequent tokens with their own gates
            (0.1 for language modelling, 0.5 for translation in the paper). r = 1 disables
            gate sharing.
        gate_embedding_size: ``d2``, size of the gate embeddings ``v_x`` (the paper gives no
            value: "much smaller than d").
        embedding_size: size ``d`` of ``h_{c,k}`` and of the token embeddings ``w_x``.
            Default: ``hidden_size``.
        gate_dropout: dropout on ``tanh(U_k g_c)`` (Eq. 4).
        context_dropout: dropout on ``h_{c,k}`` (Eq. 5).
        gate_noise: std of the Gaussian noise added to gate pre-activations in training.
        weight_norm_scale: if set, ``U_k`` is weight-normalised per row with this constant
            scale (the paper's choice for language modelling).
        locked_dropout: where the task gives the rows' layout (``forward``'s
            ``sequence_length``), one mask per sequence for each of ``gate_dropout`` and
            ``context_dropout``, shared by its steps (``heads/kernels/locked_dropout.py``): the
            MoS code's locked latent dropout, whose regularisation the paper follows for
            language modelling ("follow the regularization and optimization techniques used
            in [19]"; it states no mask layout itself); False, or without the layout: a mask
            per row.
        zipf_bias_init: start the output bias ``b_x`` at the centred log-probabilities of a
            Zipf law over the frequency-sorted ids (``b_x = -log(x + 1) + const``) instead of
            zeros. Without it, the first updates fit the unigram through the bounded
            ``tanh`` contexts: Adam drives the backbone's outputs and ``H_k g_c`` to
            saturation, the gradient through both tanh vanishes and training sits on a
            context-free plateau (issue 18's seed-7 run; see ``zipf_log_prior``).
    """

    capturable = True  # its step depends on the batch's shape alone (heads/graphs.py)

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_components: int = 4,
        frequent_ratio: float = 0.1,
        gate_embedding_size: int = 64,
        embedding_size: int | None = None,
        gate_dropout: float = 0.0,
        context_dropout: float = 0.0,
        gate_noise: float = 0.0,
        weight_norm_scale: float | None = None,
        zipf_bias_init: bool = True,
        locked_dropout: bool = False,
    ) -> None:
        super().__init__(hidden_size, vocab_size)
        embedding_size = hidden_size if embedding_size is None else embedding_size
        _check_options(num_components, frequent_ratio, gate_embedding_size, embedding_size,
                       gate_noise, weight_norm_scale)  # fmt: skip

        self.num_components = num_components
        self.num_gates = num_components - 1  # K - 1 sigmoids for K leaves
        self.frequent_ratio = frequent_ratio
        self.num_frequent = min(vocab_size, max(1, math.ceil(frequent_ratio * vocab_size)))
        self.gate_embedding_size = gate_embedding_size
        self.embedding_size = embedding_size
        self.gate_noise = gate_noise
        self.weight_norm_scale = weight_norm_scale

        # Eq. 5: h_{c,k} = tanh(H_k g_c)
        self.context = nn.Linear(hidden_size, num_components * embedding_size)
        # Eq. 4: tanh(U_k g_c), one block of d2 rows per gate
        self.gate_projection = nn.Linear(hidden_size, self.num_gates * gate_embedding_size)
        # Eq. 4 / Eq. 6: u_k . g_c, without a bias (Eq. 6 as written; Sec. 3.4 adds biases to
        # Eq. 4's products: a frequent token's b_{x,k} holds it, the rare tokens' shared gate
        # has none, its priors equal where u_k . g_c are)
        self.gate_context = nn.Linear(hidden_size, self.num_gates, bias=False)
        # Eq. 4: v_x and b_{x,k} for the S frequent tokens only
        self.gate_embedding = nn.Parameter(torch.empty(self.num_frequent, gate_embedding_size))
        self.gate_bias = nn.Parameter(torch.zeros(self.num_frequent, self.num_gates))
        # Eq. 2: token embeddings w_x and bias
        self.weight = nn.Parameter(torch.empty(vocab_size, embedding_size))
        self.bias = output_bias(vocab_size, zipf_bias_init)
        check_dropout("gate_dropout", gate_dropout)
        check_dropout("context_dropout", context_dropout)
        self.gate_dropout = nn.Dropout(gate_dropout)
        self.context_dropout = nn.Dropout(context_dropout)
        self.locked_dropout = locked_dropout
        nn.init.normal_(self.weight, std=embedding_size**-0.5)
        nn.init.normal_(self.gate_embedding, std=gate_embedding_size**-0.5)
        self.zipf_bias_init = zipf_bias_init

    def _gate_projection_weight(self) -> torch.Tensor:
        return _normalised(self.gate_projection.weight, self.weight_norm_scale)

    def _noisy(self, gate_logits: torch.Tensor) -> torch.Tensor:
        if self.training and self.gate_noise > 0:
            return gate_logits + torch.randn_like(gate_logits) * self.gate_noise
        return gate_logits

    def _pieces(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor | None = None,
        sequence_length: int | None = None,
    ) -> tuple:
        """:func:`mixtape_pieces` of this head's parameters: ``(contexts, gate inputs, gate
        weights, shared pre-activations, mixed context or None, target ids, rare targets)``.
        On CUDA (the compiled plan) one compiled function: forward and backward each a few
        fused kernels where the ~40 small operations it is made of are as many launches."""
        pieces = mixtape_pieces
        if target is not None and resolve_plan(self.loss_options.plan, hidden) == "compiled":
            pieces = compiled_body(mixtape_pieces)
        return pieces(hidden, target, *self._piece_args(sequence_length))

    def _piece_args(self, sequence_length: int | None = None) -> tuple:
        """:func:`mixtape_pieces`' arguments after ``hidden`` and ``target``; the dropouts'
        masks locked over sequences of ``sequence_length`` rows with ``locked_dropout``."""
        locked = sequence_length if self.locked_dropout else None
        return (
            self.context.weight, self.context.bias, self.gate_context.weight,
            self.gate_projection.weight, self.gate_projection.bias, self.gate_embedding,
            self.gate_bias, self.num_frequent, self.vocab_size, self.weight_norm_scale,
            self.gate_dropout.p, self.context_dropout.p, locked, self._noise(), self.training,
        )  # fmt: skip

    def _noise(self) -> float:
        """The gate noise's std in this mode (none in evaluation)."""
        return self.gate_noise if self.training else 0.0

    def _mixed_context(self, contexts: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """Infrequent tokens: one shared prior, so the contexts are mixed first ``[N, d]``."""
        return _mixed(contexts, shared, self._noise())

    def _plain(self, hidden: torch.Tensor) -> bool:
        return plain_step_fits(self.loss_options, hidden.device, hidden.size(0),
                               self.vocab_size, self.num_components, self.num_frequent)  # fmt: skip

    def _plain_loss(self, hidden, target, label_smoothing: float,
                    sequence_length: int | None = None) -> HeadOutput:  # fmt: skip
        plain = mixtape_plain_nll
        if resolve_plan("auto", hidden) == "compiled":  # CUDA: one compiled function
            plain = compiled_body(mixtape_plain_nll)
        nll, smoothing = plain(hidden, target, self.weight, self.bias, label_smoothing > 0,
                               *self._piece_args(sequence_length))  # fmt: skip
        return self.output(nll, target, smoothing=smoothing, label_smoothing=label_smoothing)

    def _rows_loss(self, contexts, gate_inputs, gate_weights, mixed, ids,
                   label_smoothing: float) -> HeadOutput:  # fmt: skip
        """The rows plan (``heads/kernels/mixtape_rows.py``): Eq. 2's one softmax over the
        frequent and rare blocks by row tiles, each product once forward and twice backward,
        its gradient computed in the forward."""
        s, v, k = self.num_frequent, self.vocab_size, self.num_components
        device, n = contexts.device, contexts.size(0)
        w_freq, w_rare, b_freq, b_rare = self.weight, None, self.bias, None
        if s < v:  # one split of each: their backward writes one [V, d] gradient
            w_freq, w_rare = self.weight.split([s, v - s])
            b_freq, b_rare = self.bias.split([s, v - s])
        dtype = compute_dtype(contexts, self.weight)
        logits, itemsize = tile_logits_per_row(device, dtype, k, s, v - s)
        tile = row_tile(n, logits, device, self.loss_options, itemsize)
        loss, nll = MixtapeRowsCrossEntropy.apply(
            contexts, gate_inputs, mixed, w_freq, b_freq, gate_weights, w_rare, b_rare, ids,
            *mean_weights(ids >= 0, contexts), float(label_smoothing), self._noise(), None,
            dtype, tile, torch.is_grad_enabled(), self.loss_options.fused_products,
        )  # fmt: skip
        return HeadOutput(loss, nll, loss.new_zeros(()))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vector-gated logits ``[N, V]`` (Eq. 2 before the softmax)."""
        s = self.num_frequent
        contexts, gate_inputs, gate_weights, shared, *_ = self._pieces(hidden)
        if s < self.vocab_size:
            w_freq, w_rare = self.weight.split([s, self.vocab_size - s])
            b_freq, b_rare = self.bias.split([s, self.vocab_size - s])
        else:
            w_freq, b_freq = self.weight, self.bias
        # Frequent tokens, Eq. 4: one [N (K-1), d2 + K] x [d2 + K, S] product -> [N, K-1, S]
        gate_logits = torch.matmul(gate_inputs, gate_weights.t())
        values = F.linear(contexts, w_freq)  # [N, K, S]
        frequent_logits = SigmoidTreeMix.apply(self._noisy(gate_logits), values)  # Eq. 2-3
        # the bias after the mix (sum_k pi = 1): one pass over [N, S], not over [N, K, S]
        frequent_logits = frequent_logits + b_freq.to(frequent_logits.dtype)
        if s == self.vocab_size:
            return frequent_logits
        mixed_context = self._mixed_context(contexts, shared)
        return FrequentThenRareLogits.apply(frequent_logits, mixed_context, w_rare, b_rare)

    def log_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact ``[N, V]`` log-probabilities, ``_EVAL_ROWS`` rows at a time: the frequent
        tokens' ``[rows, K, S]`` products stay bounded however large N is."""
        self.check_inputs(hidden)
        parts = []
        # N = 0: one slice of no rows, so that the answer stays a function of the parameters
        for start in range(0, max(hidden.size(0), 1), _EVAL_ROWS):
            logits = self.logits(hidden[start : start + _EVAL_ROWS])
            with float32_no_autocast(hidden.device):
                parts.append(upcast(logits).log_softmax(dim=-1))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def forward(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float = 0.0,
        sequence_length: int | None = None,
    ) -> HeadOutput:
        """The loss without the ``[N, V]`` logits: the frequent block (``mixtape_frequent_lse``)
        and the shared-gate block (one linear block on the mixed context) each give a partial
        log-sum-exp and their part of the target logit; Eq. 2's normaliser is their
        ``logsumexp``. ``sequence_length``: the rows' layout (``Head.forward``), for
        ``locked_dropout``."""
        self.check_inputs(hidden, target)
        check_label_smoothing(label_smoothing)
        if self._plain(hidden):
            return self._plain_loss(hidden, target, label_smoothing, sequence_length)
        s, v = self.num_frequent, self.vocab_size
        contexts, gate_inputs, gate_weights, _, mixed, ids, rare_target = self._pieces(
            hidden, target, sequence_length
        )
        rows = self.loss_options.plan == "rows"  # not a CPU's auto (below)
        if rows and mean_loss_plan(self.loss_options, contexts, v) == "rows":  # torch backend
            # the whole vocabulary by row tiles, the gradient in the forward (CUDA's choice:
            # MEASURED_FASTEST); a CPU's auto keeps the frequent block by columns, below
            return self._rows_loss(contexts, gate_inputs, gate_weights, mixed, ids,
                                   label_smoothing)  # fmt: skip
        smoothing = bool(label_smoothing)
        # one split of each parameter: its backward writes one [V, d] gradient, where two
        # slices would each write a zero-filled one
        w_freq, w_rare = self.weight.split([s, v - s])
        b_freq, b_rare = self.bias.split([s, v - s])
        noise = self._noise()
        parts = [
            mixtape_frequent_lse(
                gate_inputs,
                gate_weights,
                contexts,
                w_freq,
                b_freq,
                ids,
                smoothing,
                noise,
                self.loss_options,
            )  # fmt: skip
        ]
        if s < v:  # Eq. 6: one prior for every rare token, so the contexts are mixed first
            # a CPU's auto: the rare block's loss and gradient in one forward by the rows
            # plan, the frequent block's log-sum-exp and target logit taken in as the rest of
            # the softmax (the whole rows plan's plain tiles measured level with it, 3.93 s
            # against 4.00 at V = 33k, d = 512, 4,096 tokens: bench_cpu_mixtape_rows_33k_d512)
            if not smoothing and mean_loss_plan(self.loss_options, mixed, v - s) == "rows":
                mean = mean_cross_entropy(
                    mixed, w_rare, b_rare, rare_target, options=self.loss_options,
                    outside=(parts[0].lse, parts[0].target_logit),
                    weights=mean_weights(ids >= 0, mixed),
                )  # fmt: skip
                return HeadOutput(mean.loss, mean.nll, mean.loss.new_zeros(()))
            parts.append(linear_lse(mixed, w_rare, b_rare, rare_target, logit_sum=smoothing,
                                    options=self.loss_options))  # fmt: skip
        lse = combine_lse(*(p.lse for p in parts)) if len(parts) > 1 else parts[0].lse
        nll = lse - sum(p.target_logit for p in parts)
        mean_logit = sum(p.logit_sum for p in parts) / v if smoothing else None
        return self.output(
            nll, target, smoothing=None if mean_logit is None else lse - mean_logit,
            label_smoothing=label_smoothing,
        )  # fmt: skip


def _normalised(weight: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``U_k`` weight-normalised per output row with a constant (not learnt) scale."""
    if scale is None:
        return weight
    return scale * weight / weight.norm(dim=1, keepdim=True).clamp_min(1e-12)


def _mixed(contexts: torch.Tensor, shared: torch.Tensor, noise: float) -> torch.Tensor:
    """The contexts mixed by the shared priors (Eq. 6, the infrequent tokens) ``[N, d]``."""
    if noise > 0:
        shared = shared + torch.randn_like(shared) * noise
    priors = sigmoid_tree_priors(shared)  # [N, K]
    return torch.bmm(priors.unsqueeze(1).to(contexts.dtype), contexts).squeeze(1)


def mixtape_pieces(
    hidden, target, context_weight, context_bias, gate_context_weight, projection_weight,
    projection_bias, gate_embedding, gate_bias, num_frequent: int, vocab_size: int,
    weight_norm_scale: float | None, gate_dropout: float, context_dropout: float,
    sequence_length: int | None, noise: float, training: bool,
) -> tuple:  # fmt: skip
    """What the loss and the logits share, as one function of the head's parameters (so that
    CUDA runs it compiled): contexts ``[N, K, d]`` (Eq. 5), the two factors of the frequent
    tokens' gate pre-activations and the shared pre-activations ``[N, K-1]``; with a
    ``target``, also the rare tokens' mixed context ``[N, d]`` (None when every token is
    frequent), the target ids (-1 where ignored) and the rare block's targets (-1 outside).
    The dropouts on ``h_{c,k}`` and ``tanh(U_k g)`` draw one mask per row, or with a
    ``sequence_length`` one per sequence of that many rows (``locked_dropout``).

    Eq. 4, ``v_x . tanh(U_k g) + u_k . g + b_{x,k}``, is one product ``A B^T`` with
    ``A = [tanh(U_k g) | u_k . g | e_k | 0]`` ``[N, K-1, D]`` and
    ``B = [v_x | 1 | b_x | 0]`` ``[S, D]``: the two broadcast adds over ``[N, K-1, S]``
    happen inside the product's inner dimension (K more multiply-adds per entry). ``D`` is
    ``d2 + K`` rounded up to 8 with zero columns: a half-precision operand's rows then start
    on 16 bytes, which tensor-core GEMMs (cuBLAS on Hopper, its TMA loads) require; at
    ``d2 = 64``, K = 4 the gate products would otherwise have 68-element rows.
    """
    n, kg = hidden.size(0), gate_bias.size(1)
    # sizes named, not -1: a batch of no rows (N = 0) has no size to infer
    d, d2 = context_weight.size(0) // (kg + 1), gate_embedding.size(1)
    contexts = torch.tanh(F.linear(hidden, context_weight, context_bias)).view(n, kg + 1, d)
    # F.dropout where sequence_length is None; else one mask a sequence (the MoS code's lockdrop)
    contexts = locked_dropout(contexts, context_dropout, training, sequence_length)
    shared = F.linear(hidden, gate_context_weight)  # [N, K-1]: u_k . g_c (Eq. 6)
    projection = _normalised(projection_weight, weight_norm_scale)
    gate_hidden = torch.tanh(F.linear(hidden, projection, projection_bias))
    gate_hidden = locked_dropout(gate_hidden, gate_dropout, training, sequence_length)
    gate_hidden = gate_hidden.view(n, kg, d2)
    dtype = gate_hidden.dtype
    eye = torch.eye(kg, dtype=dtype, device=hidden.device).expand(n, kg, kg)
    pad = -(gate_embedding.size(1) + kg + 1) % 8  # zero columns: rows of a multiple of 8
    gate_inputs = torch.cat((gate_hidden, shared.unsqueeze(-1).to(dtype), eye,
                             eye.new_zeros(n, kg, pad)), dim=-1)  # fmt: skip
    ones = gate_embedding.new_ones(gate_embedding.size(0), 1)
    gate_weights = torch.cat((gate_embedding, ones, gate_bias.to(gate_embedding.dtype),
                              ones.new_zeros(ones.size(0), pad)), dim=-1)  # fmt: skip
    if target is None:
        return contexts, gate_inputs, gate_weights, shared, None, None, None
    ids = torch.where(target != IGNORE_INDEX, target, -1)  # -1: no target logit
    mixed = rare_target = None
    if num_frequent < vocab_size:
        mixed = _mixed(contexts, shared, noise)
        rare_target = torch.where(ids >= num_frequent, ids - num_frequent, -1)
    return contexts, gate_inputs, gate_weights, shared, mixed, ids, rare_target


def plain_step_fits(options, device: torch.device, rows: int, vocab_size: int, k: int,
                    frequent: int) -> bool:  # fmt: skip
    """Whether a step runs as plain maths (:func:`mixtape_plain_nll`): the rule of
    :func:`plain_loss_fits` for its float32 ``[N, V]`` logits and ``[N, K, S]`` gates, priors
    and values. There a CUDA step is launch-bound: the plans' ~150 operators (blocks, tiles
    and their glue) against one compiled function, a few fused kernels each way (a whole
    PTB LM step with Mixtape, 700 tokens, measured 1.61x softmax's on an H100 by the plans,
    1.32x so: docs/results/bench_gpu_lm_ptb_step.json)."""
    return plain_loss_fits(options, device, rows, vocab_size + 3 * k * frequent)


def mixtape_plain_nll(hidden, target, weight, bias, smoothing: bool, *piece_args) -> tuple:
    """Eq. 2-6 as plain maths, for steps small enough to hold their ``[N, V]`` logits:
    ``(-log P(target), mean_x(-log p_x) or None)`` per row in float32 (float64 inputs:
    float64), 0 at ignored rows. ``piece_args``: :func:`mixtape_pieces`' after ``hidden`` and
    ``target``. The frequent tokens' priors from the sigmoid tree over their gate
    pre-activations (Eq. 3-4), mixed with the K component logits (Eq. 2); the others' logits
    from the mixed context (Eq. 6); PyTorch's log-softmax over all of them."""
    contexts, gate_inputs, gate_weights, _, mixed, _, _ = mixtape_pieces(hidden, target,
                                                                          *piece_args)  # fmt: skip
    *_, noise, _ = piece_args  # (..., noise, training)
    s, vocab_size = gate_weights.size(0), weight.size(0)  # S frequent tokens have gates
    gate_logits = torch.matmul(gate_inputs, gate_weights.t())  # [N, K-1, S], Eq. 4
    if noise > 0:
        gate_logits = gate_logits + torch.randn_like(gate_logits) * noise
    acc = upcast(hidden).dtype
    priors = sigmoid_tree_priors(gate_logits.to(acc).transpose(1, 2))  # [N, S, K], Eq. 3
    values = F.linear(contexts, weight[:s]).to(acc)  # [N, K, S]: h_{c,k} . w_x
    logits = (priors.transpose(1, 2) * values).sum(1) + bias[:s].to(acc)  # Eq. 2
    if s < vocab_size:
        rare = F.linear(mixed, weight[s:], bias[s:]).to(acc)
        logits = torch.cat((logits, rare), 1)
    return log_softmax_rows(logits, target, smoothing)


def _check_options(
    num_components, frequent_ratio, gate_embedding_size, embedding_size, gate_noise,
    weight_norm_scale,
) -> None:  # fmt: skip
    if (
        not isinstance(num_components, int)
        or num_components < 2
        or num_components & (num_components - 1)
    ):
        raise HeadConfigError(
            f"MixtapeHead num_components must be a power of two >= 2 (sigmoid tree, Eq. 3), "
            f"got {num_components!r}"
        )
    if not 0.0 < frequent_ratio <= 1.0:
        raise HeadConfigError(
            f"MixtapeHead frequent_ratio r must be in (0, 1], got {frequent_ratio!r}"
        )
    check_positive_int("gate_embedding_size", gate_embedding_size)
    check_positive_int("embedding_size", embedding_size)
    if gate_noise < 0:
        raise HeadConfigError(f"MixtapeHead gate_noise must be >= 0, got {gate_noise!r}")
    if weight_norm_scale is not None and weight_norm_scale <= 0:
        raise HeadConfigError(
            f"MixtapeHead weight_norm_scale must be positive, got {weight_norm_scale!r}"
        )


def mixtape_frequent_lse(
    gate_inputs: torch.Tensor,
    gate_weights: torch.Tensor,
    contexts: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    target: torch.Tensor,
    logit_sum: bool,
    gate_noise: float,
    options,
):
    """``(lse, target logit, logit sum or None)`` per row over the S frequent tokens' gated
    logits (Eq. 2-4), block by block over the S columns with nothing ``[N, K, S]`` kept
    beyond ``options.saved_bytes``. ``target`` outside ``[0, S)``: no target logit. The
    compiled plan (CUDA's) runs each block as one compiled body forward and backward
    (``heads/kernels/compiled_mixtape.py``), the others the hand-written CPU plan."""
    n, k, _ = contexts.shape
    resolve_backend(options.backend, contexts)  # cce/liger: CUDA only; the torch path runs
    # a block holds [N, K-1, w] gates, [N, K, w] values and [N, w] logits: 2K floats a column
    _, width = plan_tiles(n, weight.size(0), contexts.device, options, entries_per_column=2 * k)
    dtype = compute_dtype(contexts, weight)
    if resolve_plan(options.plan, contexts) == "compiled":
        lse, target_logit, total = CompiledMixtapeFrequentLSE.apply(
            gate_inputs, gate_weights, contexts, weight, bias, target, logit_sum, dtype, width,
            float(gate_noise),
        )  # fmt: skip
        return LinearLSE(lse, target_logit, total if logit_sum else None)
    lse, target_logit, total = MixtapeFrequentLSE.apply(
        gate_inputs, gate_weights, contexts, weight, bias, target, logit_sum, dtype, width,
        kept_bytes(options, gate_inputs, gate_weights, contexts, weight, bias), float(gate_noise),
    )  # fmt: skip
    return LinearLSE(lse, target_logit, total if logit_sum else None)
