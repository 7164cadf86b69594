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
    log_probs = log_probs.double().cpu()
    frequent = log_probs[vocab.frequent_codes].tolist()
    best = heapq.nlargest(k, zip(frequent, range(len(frequent)), strict=True))  # (log p, word)
    table, col_codes = vocab.table(), vocab.col_codes
    row_lps = log_probs[vocab.row_codes]
    for row in row_lps.argsort(descending=True).tolist():
        row_lp = float(row_lps[row])
        if len(best) == k and row_lp <= best[-1][0]:
            break  # no word of this row or a later one can enter the top k
        occupied = table[row] >= 0
        if not occupied.any():
            continue
        column_lps = after(int(vocab.row_codes[row])).double().cpu()[col_codes]
        words = (row_lp + column_lps[occupied]).tolist()
        best = heapq.nlargest(k, best + list(zip(words, table[row][occupied].tolist(),
                                                 strict=True)))  # fmt: skip
    return best
