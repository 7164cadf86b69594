"""Greedy and beam-search decoding through any head (``head.log_prob`` / ``head.topk``).

Both decoders run one new token per step through the decoder
(``Seq2SeqTransformer.decode_step``, which caches the earlier positions' layer inputs).

Scores: a hypothesis ``y`` (ending in ``<eos>``) is ranked by ``log P(y | x) / lp(|y|)``
with the GNMT length penalty ``lp(n) = ((5 + n) / 6) ** alpha`` (Wu et al. 2016, Sec. 7;
``alpha = 0``: the plain log-probability). ``|y|`` counts ``<eos>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from heads import Head
from lightning_modules.backbones.seq2seq import Seq2SeqTransformer


@dataclass(frozen=True)
class DecodeConfig:
    """Decoding options of a translation task (``model.init_args.decode: {beam_size: 4, ...}``).

    beam_size: beam of ``test`` and ``predict`` (1 = greedy).
    val_beam_size: beam for validation BLEU (greedy by default: cheap); 0 skips decoding in
        validation.
    bleu_every_n_epochs: decode the validation set (and log ``val/bleu``) after every n-th
        epoch only: a checkpoint chosen by validation BLEU (``ModelCheckpoint(monitor=
        "val/bleu", mode="max")``) then needs ``every_n_epochs`` a multiple of n.
    length_penalty: alpha of the GNMT length penalty in beam search (0 = none).
    max_length_a, max_length_b: a hypothesis has at most ``a * source_length + b`` tokens
        (with ``<eos>``; source length with its ``<eos>``); at that length ``<eos>`` is
        forced.
    num_samples: sample translations logged per validation / test.
    """

    beam_size: int = 4
    val_beam_size: int = 1
    bleu_every_n_epochs: int = 1
    length_penalty: float = 0.6
    max_length_a: float = 1.5
    max_length_b: int = 10
    num_samples: int = 3


def length_penalty(length: torch.Tensor | int, alpha: float) -> torch.Tensor | float:
    return ((5 + length) / 6) ** alpha


def _max_lengths(source_padding: torch.Tensor, config: DecodeConfig) -> torch.Tensor:
    source_lengths = (~source_padding).sum(1)
    limit = (config.max_length_a * source_lengths).floor().long() + config.max_length_b
    return limit.clamp(min=1)


# ``(log_probs [n, V], previous tokens [n], closing [n]) -> log_probs`` with the tokens that may
# not follow at -inf: a coded target's grammar (Hybrid-LightRNN: a row code, then a column of
# that row); ``closing``: rows whose next token is the last before a forced <eos>, which must
# end a word (CodeGrammar.restrict)
Restrict = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _step_log_probs(
    head: Head,
    hidden: torch.Tensor,
    k: int,
    max_lengths: torch.Tensor,
    step: int,
    eos_id: int,
    previous: torch.Tensor,
    restrict: Restrict | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` next tokens per row (among those ``restrict`` allows after ``previous``);
    rows at their ``max_lengths`` get ``<eos>`` with its log-prob, or 0 where the head gives
    it none (a DS-Softmax expert without ``<eos>``: at -inf every hypothesis of the sentence
    would end there unfinished)."""
    force_eos = max_lengths == step + 1
    if restrict is None:
        log_probs, tokens = head.topk(hidden, k)
    else:  # the whole distribution, masked (coded targets: a few thousand codes)
        closing = max_lengths == step + 2
        log_probs = restrict(head.log_prob(hidden), previous, closing)
        log_probs, tokens = log_probs.topk(k, dim=-1)
    if force_eos.any():
        eos_lp = head.log_prob(hidden[force_eos])[:, eos_id].nan_to_num(neginf=0.0)
        forced_lp = torch.full_like(log_probs[force_eos], float("-inf"))
        forced_lp[:, 0] = eos_lp
        log_probs[force_eos] = forced_lp
        tokens[force_eos] = eos_id
    return log_probs, tokens


@torch.no_grad()
def greedy_decode(
    backbone: Seq2SeqTransformer,
    head: Head,
    source: torch.Tensor,
    source_padding: torch.Tensor,
    config: DecodeConfig,
    bos_id: int,
    eos_id: int,
    restrict: Restrict | None = None,
) -> list[list[int]]:
    """The most likely next token at each step until ``<eos>`` (among those ``restrict``
    allows); ids without ``<eos>``."""
    memory = backbone.encode(source, source_padding)
    batch = source.size(0)
    max_lengths = _max_lengths(source_padding, config)
    prefix = torch.full((batch, 1), bos_id, dtype=torch.long, device=source.device)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    active = torch.arange(batch, device=source.device)
    cache = None
    for step in range(int(max_lengths.max())):
        hidden, cache = backbone.decode_step(prefix, memory, source_padding, cache)
        _, tokens = _step_log_probs(
            head, hidden, 1, max_lengths[active], step, eos_id, prefix[:, -1], restrict
        )
        tokens = tokens[:, 0]
        for row, token in zip(active.tolist(), tokens.tolist(), strict=True):
            if token != eos_id:
                outputs[row].append(token)
        keep = tokens != eos_id
        if not keep.any():
            break
        # shrink the batch to the sentences still running
        active, memory, source_padding = active[keep], memory[keep], source_padding[keep]
        prefix = torch.cat((prefix[keep], tokens[keep, None]), dim=1)
        cache = [c[keep] for c in cache]
    return outputs


@torch.no_grad()
def beam_search(
    backbone: Seq2SeqTransformer,
    head: Head,
    source: torch.Tensor,
    source_padding: torch.Tensor,
    config: DecodeConfig,
    bos_id: int,
    eos_id: int,
    beam_size: int | None = None,
    restrict: Restrict | None = None,
) -> list[list[int]]:
    """Beam search; the best finished hypothesis per sentence, ids without ``<eos>``.

    Each step takes, per sentence, the ``2 * beam_size`` best extensions over all its beams
    (each beam's own top ``2 * beam_size`` from ``head.topk`` suffice for that, so heads with
    a fast top-k path never form the full distribution); extensions by ``<eos>`` become
    finished hypotheses, the best others the next beams. A sentence is done when it holds
    ``beam_size`` finished hypotheses (so ``beam_size = 1`` is greedy decoding) or at its
    maximum length, where ``<eos>`` is forced. ``beam_size`` defaults to ``config``'s;
    ``restrict`` masks the tokens that may not follow a beam's last one (a coded target).
    """
    k = config.beam_size if beam_size is None else beam_size
    if k < 1:
        raise ValueError(f"beam_size must be at least 1, got {k}")
    batch, device = source.size(0), source.device
    max_lengths = _max_lengths(source_padding, config)
    # every live sentence keeps k rows: [n * k, ...]
    memory = backbone.encode(source, source_padding).repeat_interleave(k, dim=0)
    padding = source_padding.repeat_interleave(k, dim=0)
    prefix = torch.full((batch * k, 1), bos_id, dtype=torch.long, device=device)
    # only beam 0 is live at the start, so the first step does not pick k copies
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    active = list(range(batch))
    per_beam = min(2 * k, head.vocab_size)  # each beam's own best extensions
    num_candidates = min(2 * k, k * per_beam)  # the sentence's best over all its beams
    cache = None
    for step in range(int(max_lengths.max())):
        n = len(active)
        hidden, cache = backbone.decode_step(prefix, memory, padding, cache)  # [n * k, d]
        limits = max_lengths[active].repeat_interleave(k)
        log_probs, tokens = _step_log_probs(
            head, hidden, per_beam, limits, step, eos_id, prefix[:, -1], restrict
        )
        candidates = (scores.unsqueeze(-1) + log_probs.view(n, k, -1)).view(n, -1)
        top_scores, top_pos = candidates.topk(num_candidates, dim=1)  # [n, 2k]
        top = (top_scores, tokens.view(n, -1).gather(1, top_pos), top_pos // per_beam)
        penalty = length_penalty(step + 1, config.length_penalty)
        chosen = _next_beams(*top, prefix, active, finished, eos_id, penalty)
        if chosen is None:
            break
        rows, new_tokens, scores, still_running = chosen
        prefix = torch.cat((prefix[rows], new_tokens), dim=1)
        memory, padding = memory[rows], padding[rows]
        cache = [c[rows] for c in cache]
        active = [active[i] for i in still_running]
    return [max(hyps, key=lambda h: h[0])[1] if hyps else [] for hyps in finished]


def _next_beams(
    top_scores: torch.Tensor,
    top_tokens: torch.Tensor,
    top_beams: torch.Tensor,
    prefix: torch.Tensor,
    active: list[int],
    finished: list[list[tuple[float, list[int]]]],
    eos_id: int,
    penalty: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]] | None:
    """One step's choice from each active sentence's best candidates ``[n, 2k]`` (score,
    token, beam): hypotheses finished by ``<eos>`` go to ``finished``; returns the rows of
    ``prefix`` the next beams extend ``[n' * k]``, their new tokens ``[n' * k, 1]``, their
    scores ``[n', k]`` and the indices (into ``active``) of the sentences still running, or
    None when every sentence is done."""
    k = prefix.size(0) // len(active)
    # the bookkeeping is per sentence in Python lists (small), tensors are built once
    all_scores, all_tokens = top_scores.tolist(), top_tokens.tolist()
    all_beams, prefix_rows = top_beams.tolist(), prefix.tolist()
    next_scores, next_rows, next_tokens, still_running = [], [], [], []
    for i, sentence in enumerate(active):
        candidates = zip(all_scores[i], all_tokens[i], all_beams[i], strict=True)
        done = finished[sentence]
        scores_i, rows_i, tokens_i = _extend(
            candidates, done, prefix_rows, i * k, k, eos_id, penalty
        )
        if len(done) < k and scores_i:
            still_running.append(i)
            # fewer than k live extensions (tiny vocabularies): pad with dead beams
            missing = k - len(scores_i)
            next_scores.append(scores_i + [float("-inf")] * missing)
            next_rows.append(rows_i + [rows_i[0]] * missing)
            next_tokens.append(tokens_i + [tokens_i[0]] * missing)
    if not still_running:
        return None
    device = prefix.device
    rows = torch.tensor(next_rows, device=device).view(-1)
    new_tokens = torch.tensor(next_tokens, device=device).view(-1, 1)
    return rows, new_tokens, torch.tensor(next_scores, device=device), still_running


def _extend(
    candidates: Iterable[tuple[float, int, int]],
    finished: list[tuple[float, list[int]]],
    prefix_rows: list[list[int]],
    first_row: int,
    k: int,
    eos_id: int,
    penalty: float,
) -> tuple[list[float], list[int], list[int]]:
    """One sentence's step over its candidates (score, token, beam), best first: an
    extension by ``<eos>`` finishes a hypothesis (appended to ``finished`` with its
    length-penalised score); the best ``k`` others are the next beams (scores, rows of the
    prefix they extend, tokens)."""
    scores, rows, tokens = [], [], []
    for rank, (score, token, beam) in enumerate(candidates):
        if score == float("-inf") or len(finished) >= k:
            break
        if token == eos_id:
            # as in fairseq: <eos> finishes a hypothesis only from the top k, so that with
            # k = 1 a non-<eos> best candidate carries on exactly as in greedy
            if rank < k:
                finished.append((score / penalty, prefix_rows[first_row + beam][1:]))
        elif len(scores) < k:
            scores.append(score)
            rows.append(first_row + beam)
            tokens.append(token)
    return scores, rows, tokens
