"""Greedy and beam-search decoding through any head (``head.log_prob`` / ``head.topk``).

Both decoders run one new token per step through the decoder
(``Seq2SeqTransformer.decode_step``, which caches the earlier positions' layer inputs).

Host reads: a search decides on the host which hypotheses end and which beams go on, so each
step reads back once (greedy: its tokens; beam: the candidates' scores, tokens and beams in
one tensor) and copies at most two small index tensors to the device (the next beams; the
rows at their length limit, on the steps where some are); plus one read of the length limits
per batch. Nothing else syncs: the hypotheses' tokens, the limits and which rows end are kept
on the host as they are decided, not read back from the device.

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
    limits: torch.Tensor,
    forced: list[int],
    step: int,
    eos_id: int,
    previous: torch.Tensor,
    restrict: Restrict | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` next tokens per row (among those ``restrict`` allows after ``previous``);
    the rows ``forced`` (host indices: at their length limit, ``limits`` on the device) get
    ``<eos>`` with its log-prob, or 0 where the head gives it none (a DS-Softmax expert
    without ``<eos>``: at -inf every hypothesis of the sentence would end there unfinished)."""
    if restrict is None:
        log_probs, tokens = head.topk(hidden, k)
    else:  # the whole distribution, masked (coded targets: a few thousand codes)
        closing = limits == step + 2
        log_probs = restrict(head.log_prob(hidden), previous, closing)
        log_probs, tokens = log_probs.topk(k, dim=-1)
    if forced:  # known on the host: no read-back of a mask, integer (not boolean) indexing
        rows = torch.tensor(forced, device=hidden.device)
        eos_lp = head.log_prob(hidden[rows])[:, eos_id].nan_to_num(neginf=0.0)
        forced_lp = torch.full_like(log_probs[rows], float("-inf"))
        forced_lp[:, 0] = eos_lp
        log_probs[rows] = forced_lp
        tokens[rows] = eos_id
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
    batch, device = source.size(0), source.device
    limits = _max_lengths(source_padding, config)  # [batch] on the device
    host_limits = limits.tolist()  # the batch's one read of the limits
    prefix = torch.full((batch, 1), bos_id, dtype=torch.long, device=device)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    active = list(range(batch))  # the sentences still running, on the host
    cache = None
    for step in range(max(host_limits)):
        hidden, cache = backbone.decode_step(prefix, memory, source_padding, cache)
        forced = [i for i, s in enumerate(active) if host_limits[s] == step + 1]
        _, tokens = _step_log_probs(
            head, hidden, 1, limits, forced, step, eos_id, prefix[:, -1], restrict
        )
        tokens = tokens[:, 0]
        keep = []
        for i, token in enumerate(tokens.tolist()):  # the step's one read-back
            if token != eos_id:
                outputs[active[i]].append(token)
                keep.append(i)
        if not keep:
            break
        prefix = torch.cat((prefix, tokens[:, None]), dim=1)
        if len(keep) < len(active):  # shrink the batch to the sentences still running
            rows = torch.tensor(keep, device=device)
            active = [active[i] for i in keep]
            memory, source_padding, limits = memory[rows], source_padding[rows], limits[rows]
            prefix = prefix[rows]
            cache = [c[rows] for c in cache]
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
    host_limits = max_lengths.tolist()  # the batch's one read of the limits
    # every live sentence keeps k rows: [n * k, ...]
    memory = backbone.encode(source, source_padding).repeat_interleave(k, dim=0)
    padding = source_padding.repeat_interleave(k, dim=0)
    limits = max_lengths.repeat_interleave(k)
    prefix = torch.full((batch * k, 1), bos_id, dtype=torch.long, device=device)
    # each row's tokens after <eos>, kept on the host as they are chosen (not read back)
    hypotheses: list[list[int]] = [[] for _ in range(batch * k)]
    # only beam 0 is live at the start, so the first step does not pick k copies
    scores = torch.full((batch, k), float("-inf"), device=device)
    scores[:, 0] = 0.0
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(batch)]
    active = list(range(batch))
    per_beam = min(2 * k, head.vocab_size)  # each beam's own best extensions
    num_candidates = min(2 * k, k * per_beam)  # the sentence's best over all its beams
    cache = None
    for step in range(max(host_limits)):
        n = len(active)
        hidden, cache = backbone.decode_step(prefix, memory, padding, cache)  # [n * k, d]
        forced = [
            i * k + beam for i, s in enumerate(active) if host_limits[s] == step + 1
            for beam in range(k)
        ]  # fmt: skip
        log_probs, tokens = _step_log_probs(
            head, hidden, per_beam, limits, forced, step, eos_id, prefix[:, -1], restrict
        )
        candidates = (scores.unsqueeze(-1) + log_probs.view(n, k, -1)).view(n, -1)
        top_scores, top_pos = candidates.topk(num_candidates, dim=1)  # [n, 2k]
        top = (top_scores, tokens.view(n, -1).gather(1, top_pos), top_pos // per_beam)
        penalty = length_penalty(step + 1, config.length_penalty)
        chosen = _next_beams(*top, hypotheses, active, finished, eos_id, penalty)
        if chosen is None:
            break
        rows, new_tokens, scores, still_running, hypotheses = chosen
        prefix = torch.cat((prefix[rows], new_tokens), dim=1)
        memory, padding, limits = memory[rows], padding[rows], limits[rows]
        cache = [c[rows] for c in cache]
        active = [active[i] for i in still_running]
    return [max(hyps, key=lambda h: h[0])[1] if hyps else [] for hyps in finished]


def _next_beams(
    top_scores: torch.Tensor,
    top_tokens: torch.Tensor,
    top_beams: torch.Tensor,
    hypotheses: list[list[int]],
    active: list[int],
    finished: list[list[tuple[float, list[int]]]],
    eos_id: int,
    penalty: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[list[int]]] | None:
    """One step's choice from each active sentence's best candidates ``[n, 2k]`` (score,
    token, beam), ``hypotheses`` holding each row's tokens so far: hypotheses finished by
    ``<eos>`` go to ``finished``; returns the rows the next beams extend ``[n' * k]``, their
    new tokens ``[n' * k, 1]``, their scores ``[n', k]``, the indices (into ``active``) of the
    sentences still running and the next rows' tokens, or None when every sentence is done."""
    k = len(hypotheses) // len(active)
    # the bookkeeping is per sentence in Python lists (small): one read-back of the
    # candidates (float64 holds float32 scores and token ids exactly), one copy of the choice
    read = torch.stack([top_scores.double(), top_tokens.double(), top_beams.double()])
    all_scores, all_tokens, all_beams = read.tolist()
    next_scores, next_rows, next_tokens, still_running = [], [], [], []
    for i, sentence in enumerate(active):
        candidates = zip(all_scores[i], map(int, all_tokens[i]), map(int, all_beams[i]),
                         strict=True)  # fmt: skip
        done = finished[sentence]
        scores_i, rows_i, tokens_i = _extend(
            candidates, done, hypotheses, i * k, k, eos_id, penalty
        )
        if len(done) < k and scores_i:
            still_running.append(i)
            # fewer than k live extensions (tiny vocabularies): pad with dead beams
            missing = k - len(scores_i)
            next_scores.extend(scores_i + [float("-inf")] * missing)
            next_rows.extend(rows_i + [rows_i[0]] * missing)
            next_tokens.extend(tokens_i + [tokens_i[0]] * missing)
    if not still_running:
        return None
    chosen = torch.tensor([next_rows, next_tokens, next_scores], dtype=torch.float64)
    chosen = chosen.to(top_scores.device)
    rows, new_tokens = chosen[0].long(), chosen[1].long().view(-1, 1)
    scores = chosen[2].to(torch.get_default_dtype()).view(len(still_running), k)
    extended = [hypotheses[r] + [t] for r, t in zip(next_rows, next_tokens, strict=True)]
    return rows, new_tokens, scores, still_running, extended


def _extend(
    candidates: Iterable[tuple[float, int, int]],
    finished: list[tuple[float, list[int]]],
    hypotheses: list[list[int]],
    first_row: int,
    k: int,
    eos_id: int,
    penalty: float,
) -> tuple[list[float], list[int], list[int]]:
    """One sentence's step over its candidates (score, token, beam), best first: an
    extension by ``<eos>`` finishes a hypothesis (appended to ``finished`` with its
    length-penalised score and the tokens of the row it extends, ``hypotheses``); the best
    ``k`` others are the next beams (scores, rows they extend, tokens)."""
    scores, rows, tokens = [], [], []
    for rank, (score, token, beam) in enumerate(candidates):
        if score == float("-inf") or len(finished) >= k:
            break
        if token == eos_id:
            # as in fairseq: <eos> finishes a hypothesis only from the top k, so that with
            # k = 1 a non-<eos> best candidate carries on exactly as in greedy
            if rank < k:
                finished.append((score / penalty, hypotheses[first_row + beam]))
        elif len(scores) < k:
            scores.append(score)
            rows.append(first_row + beam)
            tokens.append(token)
    return scores, rows, tokens
