"""Greedy and beam-search decoding through any head (``head.log_prob`` / ``head.topk``).

Both decoders run one new token per step through the decoder
(``Seq2SeqTransformer.decode_step``, which caches the earlier positions' layer inputs).

Scores: a hypothesis ``y`` (ending in ``<eos>``) is ranked by ``log P(y | x) / lp(|y|)``
with the GNMT length penalty ``lp(n) = ((5 + n) / 6) ** alpha`` (Wu et al. 2016, Sec. 7;
``alpha = 0``: the plain log-probability). ``|y|`` counts ``<eos>``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heads import Head
from lightning_modules.backbones.seq2seq import Seq2SeqTransformer


@dataclass
class DecodeConfig:
    """Search options.

    bos_id, eos_id: decoder start token and end token.
    max_length_a, max_length_b: a hypothesis has at most ``a * source_length + b`` tokens
        (with ``<eos>``; source length with its ``<eos>``), and never more than the
        backbone's positions allow; at that length ``<eos>`` is forced.
    length_penalty: alpha of the GNMT length penalty (0 = none).
    """

    bos_id: int
    eos_id: int
    max_length_a: float = 1.5
    max_length_b: int = 10
    length_penalty: float = 0.0


def length_penalty(length: torch.Tensor | int, alpha: float) -> torch.Tensor | float:
    return ((5 + length) / 6) ** alpha


def _max_lengths(
    source_padding: torch.Tensor, config: DecodeConfig, backbone: Seq2SeqTransformer
) -> torch.Tensor:
    source_lengths = (~source_padding).sum(1)
    limit = (config.max_length_a * source_lengths).floor().long() + config.max_length_b
    # the decoder input (BOS + all but the last token) must fit the position table
    return limit.clamp(min=1, max=backbone.max_length)


def _step_log_probs(
    head: Head, hidden: torch.Tensor, k: int, force_eos: torch.Tensor, eos_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` next tokens per row; rows in ``force_eos`` get ``<eos>`` with its log-prob."""
    log_probs, tokens = head.topk(hidden, k)
    if force_eos.any():
        eos_lp = head.log_prob(hidden[force_eos])[:, eos_id]
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
) -> list[list[int]]:
    """The most likely next token at each step until ``<eos>``; ids without ``<eos>``."""
    memory = backbone.encode(source, source_padding)
    batch = source.size(0)
    max_lengths = _max_lengths(source_padding, config, backbone)
    prefix = torch.full((batch, 1), config.bos_id, dtype=torch.long, device=source.device)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    active = torch.arange(batch, device=source.device)
    cache = None
    for step in range(int(max_lengths.max())):
        hidden, cache = backbone.decode_step(prefix, memory, source_padding, cache)
        force = max_lengths[active] == step + 1
        _, tokens = _step_log_probs(head, hidden, 1, force, config.eos_id)
        tokens = tokens[:, 0]
        for row, token in zip(active.tolist(), tokens.tolist(), strict=True):
            if token != config.eos_id:
                outputs[row].append(token)
        keep = tokens != config.eos_id
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
    beam_size: int = 4,
) -> list[list[int]]:
    """Beam search; the best finished hypothesis per sentence, ids without ``<eos>``.

    Each step takes, per sentence, the ``2 * beam_size`` best extensions over all its beams
    (each beam's own top ``2 * beam_size`` from ``head.topk`` suffice for that, so heads with
    a fast top-k path never form the full distribution); extensions by ``<eos>`` become
    finished hypotheses, the best others the next beams. A sentence is done when it holds
    ``beam_size`` finished hypotheses (so ``beam_size = 1`` is greedy decoding) or at its
    maximum length, where ``<eos>`` is forced.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be at least 1, got {beam_size}")
    device = source.device
    batch, k = source.size(0), beam_size
    max_lengths = _max_lengths(source_padding, config, backbone)
    memory = backbone.encode(source, source_padding)
    # every live sentence keeps k rows: [n * k, ...]
    memory = memory.repeat_interleave(k, dim=0)
    padding = source_padding.repeat_interleave(k, dim=0)
    prefix = torch.full((batch * k, 1), config.bos_id, dtype=torch.long, device=device)
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
        force = (max_lengths[active] == step + 1).repeat_interleave(k)
        log_probs, tokens = _step_log_probs(head, hidden, per_beam, force, config.eos_id)
        candidates = (scores.unsqueeze(-1) + log_probs.view(n, k, -1)).view(n, -1)
        top_scores, top_pos = candidates.topk(num_candidates, dim=1)  # [n, 2k]
        top_tokens = tokens.view(n, -1).gather(1, top_pos)
        top_beams = top_pos // per_beam
        penalty = length_penalty(step + 1, config.length_penalty)

        # the bookkeeping is per sentence in Python lists (small), tensors are built once
        all_scores, all_tokens = top_scores.tolist(), top_tokens.tolist()
        all_beams, prefix_rows = top_beams.tolist(), prefix.tolist()
        next_scores, next_rows, next_tokens, still_running = [], [], [], []
        for i, sentence in enumerate(active):
            scores_i, rows_i, tokens_i = [], [], []
            for rank, (score, token, beam) in enumerate(
                zip(all_scores[i], all_tokens[i], all_beams[i], strict=True)
            ):
                if score == float("-inf") or len(finished[sentence]) >= k:
                    break
                if token == config.eos_id:
                    # as in fairseq: <eos> finishes a hypothesis only from the top k, so that
                    # with k = 1 a non-<eos> best candidate carries on exactly as in greedy
                    if rank < k:
                        hypothesis = prefix_rows[i * k + beam][1:]
                        finished[sentence].append((score / penalty, hypothesis))
                elif len(scores_i) < k:
                    scores_i.append(score)
                    rows_i.append(i * k + beam)
                    tokens_i.append(token)
            if len(finished[sentence]) < k and scores_i:
                still_running.append(i)
                # fewer than k live extensions (tiny vocabularies): pad with dead beams
                missing = k - len(scores_i)
                next_scores.append(scores_i + [float("-inf")] * missing)
                next_rows.append(rows_i + [rows_i[0]] * missing)
                next_tokens.append(tokens_i + [tokens_i[0]] * missing)
        if not still_running:
            break
        rows = torch.tensor(next_rows, device=device).view(-1)
        new_tokens = torch.tensor(next_tokens, device=device).view(-1, 1)
        prefix = torch.cat((prefix[rows], new_tokens), dim=1)
        memory, padding = memory[rows], padding[rows]
        cache = [c[rows] for c in cache]
        scores = torch.tensor(next_scores, device=device)
        active = [active[i] for i in still_running]
    return [max(hyps, key=lambda h: h[0])[1] if hyps else [] for hyps in finished]
