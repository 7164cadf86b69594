"""The next words' top-k of a language model over Hybrid-LightRNN codes.

A frequent word is one code, so its probability is that code's. A rare word is its row's code
then its column's, ``P(w) = P(row r | context) * P(column c | context, r)``: the column's
distribution needs the model run one more step with the row as input. Each word of row ``r``
is at most as likely as ``r`` itself, so the rows are expanded best first, only while a row
can still beat the k-th best word found: the result is exact, usually after a few rows.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab


def top_words(
    log_probs: torch.Tensor,
    after: Callable[[int], torch.Tensor],
    vocab: HybridLightRNNVocab,
    k: int,
) -> list[tuple[float, int]]:
    """The ``k`` most likely next words, ``(log-probability, word id)`` best first.

    ``log_probs``: ``[num_codes]`` the next code's log-probabilities; ``after(code)``: the
    code after that one, ``[num_codes]``, once ``code`` (a row) is read."""

    def after_rows(_: list[int], codes: list[int]) -> torch.Tensor:
        return torch.stack([after(code) for code in codes])

    return top_words_batch(log_probs.unsqueeze(0), after_rows, vocab, k)[0]


def top_words_batch(
    log_probs: torch.Tensor,
    after: Callable[[list[int], list[int]], torch.Tensor],
    vocab: HybridLightRNNVocab,
    k: int,
) -> list[list[tuple[float, int]]]:
    """:func:`top_words` of a batch of contexts, ``[B, num_codes]``: each context's rows are
    read in the same order and stop at the same bound as alone, the contexts in lockstep, so
    that one call ``after(contexts, codes) -> [n, num_codes]`` reads the next row of every
    context that still needs one (one backbone pass and one read-back a round)."""
    log_probs = log_probs.double().cpu()
    frequent = log_probs[:, vocab.frequent_codes].tolist()
    best = [heapq.nlargest(k, zip(lps, range(len(lps)), strict=True)) for lps in frequent]
    table, col_codes, row_codes = vocab.table(), vocab.col_codes, vocab.row_codes.tolist()
    occupied = table >= 0
    held = occupied.any(1).tolist()
    row_lps = log_probs[:, vocab.row_codes]
    orders = row_lps.argsort(dim=1, descending=True).tolist()
    row_lps = row_lps.tolist()
    position = [0] * len(best)
    while True:
        pending: list[tuple[int, int]] = []  # (context, row): its next row to read
        for b, order in enumerate(orders):
            while position[b] < len(order):
                row = order[position[b]]
                if len(best[b]) == k and row_lps[b][row] <= best[b][-1][0]:
                    position[b] = len(order)  # no word of this row or a later one can enter
                    break
                position[b] += 1
                if held[row]:
                    pending.append((b, row))
                    break
        if not pending:
            return best
        columns = after([b for b, _ in pending], [row_codes[row] for _, row in pending])
        columns = columns.double().cpu()[:, col_codes]
        for (b, row), column_lps in zip(pending, columns, strict=True):
            words = (row_lps[b][row] + column_lps[occupied[row]]).tolist()
            best[b] = heapq.nlargest(k, best[b] + list(zip(words, table[row][occupied[row]]
                                                           .tolist(), strict=True)))  # fmt: skip
