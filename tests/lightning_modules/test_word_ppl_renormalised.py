"""The Hybrid-LightRNN word perplexity renormalised over valid code sequences
(``lightning_modules/word_perplexity.py``): a proper distribution over the words, at most the
unrenormalised (paper's) word perplexity, summed without a second pass or a host read-back."""

import math

import pytest
import torch

from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from lightning_modules import word_perplexity as wp
from lightning_modules.word_perplexity import (
    renormalised_nll,
    update_renormalised_sums,
    update_word_sums,
    word_perplexities,
    word_sums,
)

# 14 words (12 + <eos> + <unk>), word i seen 20 - i times; K = 4 frequent, the 10 rare words in
# a 4 x 4 table filled row by row: rows 0 and 1 full, row 2 holds 2 words, row 3 none.
CORPUS = [" ".join(f"w{i}" for i in range(12) if i <= j) for j in range(20)]


@pytest.fixture()
def vocab() -> HybridLightRNNVocab:
    return HybridLightRNNVocab.build(CORPUS, num_frequent=4, rows=4, cols=4)


def bigram_log_probs(num_codes: int, seed: int = 0) -> torch.Tensor:
    """A code model that reads only the previous code: ``[V prev, V next]`` float64, putting
    mass on every code (invalid ones included), as a trained head does."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_codes, num_codes, generator=generator, dtype=torch.float64)
    return logits.log_softmax(1)


def plain_word_probs(vocab: HybridLightRNNVocab, lp: torch.Tensor, start: int) -> dict:
    """Each word's unrenormalised and renormalised probability after the code ``start``,
    written out from the table (float64)."""
    p = lp.exp()
    table = vocab.table().tolist()
    frequent = vocab.frequent_codes.tolist()
    rows, cols = vocab.row_codes.tolist(), vocab.col_codes.tolist()
    held_rows = [r for r in range(vocab.rows) if any(w >= 0 for w in table[r])]
    # mass of the codes that may start a word: frequent words' codes and rows holding a word
    start_mass = sum(p[start, f] for f in frequent) + sum(p[start, rows[r]] for r in held_rows)
    out = {}
    for word, code in enumerate(frequent):
        out[word] = (float(p[start, code]), float(p[start, code] / start_mass))
    for r in range(vocab.rows):
        row_code = rows[r]
        column_mass = sum(p[row_code, cols[c]] for c in range(vocab.cols) if table[r][c] >= 0)
        for c in range(vocab.cols):
            word = table[r][c]
            if word >= 0:
                joint = p[start, row_code] * p[row_code, cols[c]]
                renorm = p[start, row_code] / start_mass * p[row_code, cols[c]] / column_mass
                out[word] = (float(joint), float(renorm))
    return out


def test_renormalised_word_probabilities_sum_to_one(vocab):
    lp = bigram_log_probs(len(vocab))
    eos = vocab.eos_id
    plain = plain_word_probs(vocab, lp, eos)
    assert sorted(plain) == list(range(len(vocab.words)))  # every word, once
    assert sum(joint for joint, _ in plain.values()) < 0.9  # the code model leaks mass
    assert sum(renorm for _, renorm in plain.values()) == pytest.approx(1.0, abs=1e-12)
    # the module's per-code renormalised NLLs, summed over each word's codes, give the same
    total = 0.0
    for word in range(len(vocab.words)):
        codes = vocab.encode_word_ids(torch.tensor([word])).tolist()
        previous = torch.tensor([eos] + codes[:-1])
        targets = torch.tensor(codes)
        nll = renormalised_nll(lp[previous], previous, targets, vocab.grammar())
        assert nll.dtype == torch.float64
        assert math.exp(-float(nll.sum())) == pytest.approx(plain[word][1], rel=1e-12)
        assert float(nll.sum()) <= -math.log(plain[word][0]) + 1e-12  # never less likely
        total += math.exp(-float(nll.sum()))
    assert total == pytest.approx(1.0, abs=1e-12)


def test_renormalised_word_ppl_is_at_most_the_paper_figure(vocab, monkeypatch):
    lp = bigram_log_probs(len(vocab), seed=1)
    codes = torch.tensor(vocab.encode_line(" ".join(CORPUS[-3:]) + " w3 w11 w7 w0"))
    previous, targets = codes[:-1], codes[1:].clone()
    targets[5] = -100  # an ignored position counts in neither sum
    hidden = torch.nn.functional.one_hot(previous, len(vocab)).double()  # the context: prev
    sums = word_sums(["train", "val", "test"])
    assert "train_renorm" not in sums  # training pays no second head pass (nor saves one)
    starts, grammar = vocab.word_start_mask, vocab.grammar()
    nll = torch.where(targets != -100, -lp[previous, targets.clamp(min=0)], 0.0)
    update_word_sums(sums, "val", starts, nll, targets)
    monkeypatch.setattr(wp, "_CHUNK_ELEMENTS", 3 * len(vocab))  # 3 rows a chunk: chunked too
    update_renormalised_sums(sums, "val", lambda h: h @ lp, hidden, previous, targets, grammar)
    out = word_perplexities(sums, "val", renormalised=True)
    # plain reference: each kept code's probability over the allowed codes after its input
    p = lp.exp()
    table, rows = vocab.table(), vocab.row_codes.tolist()
    words, unnorm, renorm = 0, 0.0, 0.0
    for prev, target in zip(previous.tolist(), targets.tolist(), strict=True):
        if target == -100:
            continue
        if prev in rows:  # after a row: its occupied columns
            r = rows.index(prev)
            allowed = [int(vocab.col_codes[c]) for c in range(vocab.cols) if table[r, c] >= 0]
        else:  # a word starts: frequent words' codes and rows that hold a word
            allowed = vocab.frequent_codes.tolist()
            allowed += [rows[r] for r in range(vocab.rows) if (table[r] >= 0).any()]
        assert target in allowed
        unnorm += -math.log(p[prev, target])
        renorm += -math.log(p[prev, target] / sum(p[prev, a] for a in allowed))
        words += bool(starts[target])
    assert float(out["word_ppl"]) == pytest.approx(math.exp(unnorm / words), rel=1e-12)
    assert float(out["word_ppl_renorm"]) == pytest.approx(math.exp(renorm / words), rel=1e-12)
    assert float(out["word_ppl_renorm"]) < float(out["word_ppl"])
    # read and reset: the next epoch's figures are its own
    update_word_sums(sums, "val", starts, nll, targets)
    again = word_perplexities(sums, "val", renormalised=True)
    assert float(again["word_ppl_renorm"]) == pytest.approx(1.0)  # nothing summed since
    assert float(again["word_ppl"]) == pytest.approx(float(out["word_ppl"]), rel=1e-12)
    # targets without a grammar (words, BPE): no renormalised figure
    assert set(word_perplexities(sums, "val", renormalised=False)) == {"word_ppl"}


def test_training_steps_sum_no_renormalised_nll(vocab):
    sums = word_sums(["train"])
    calls = []
    update_renormalised_sums(
        sums, "train", calls.append, torch.zeros(3, 2), torch.zeros(3, dtype=torch.long),
        torch.zeros(3, dtype=torch.long), vocab.grammar(),
    )  # fmt: skip
    assert calls == []
    assert set(word_perplexities(sums, "train", renormalised=True)) == {"word_ppl"}
