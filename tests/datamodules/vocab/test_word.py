from collections import Counter

import numpy as np
import pytest

from datamodules.vocab import EOS, UNK, WordVocab
from datamodules.vocab.word import count_words


def test_ids_sorted_by_frequency_with_eos_per_line():
    vocab = WordVocab.build(["b a b", "c b a", "a"])
    # counts: b 3, a 3, <eos> 3, c 1, <unk> 0; ties keep first-occurrence order
    assert vocab.itos == ["b", "a", EOS, "c", UNK]
    assert vocab.counts == [3, 3, 3, 1, 0]
    assert vocab.encode_line("a z") == [1, vocab.unk_id, vocab.eos_id]
    assert vocab.decode([0, 3]) == ["b", "c"]


def test_max_size_maps_the_rest_to_unk():
    vocab = WordVocab.build(["a a a b b c d"], max_size=3)
    assert len(vocab) == 3
    assert set(vocab.itos) == {"a", EOS, UNK}
    assert vocab.counts[vocab.unk_id] == 4  # b, b, c, d
    assert vocab.itos == [UNK, "a", EOS]  # still sorted by (new) frequency
    assert vocab.encode_line("b") == [vocab.unk_id, vocab.eos_id]


def test_state_dict_round_trip_and_fingerprint():
    vocab = WordVocab.build(["x y", "y"])
    again = WordVocab.from_state_dict(vocab.state_dict())
    assert again == vocab and again.fingerprint() == vocab.fingerprint()
    assert WordVocab.build(["x z"]) != vocab


def test_empty_corpus_is_an_error():
    with pytest.raises(ValueError, match="empty corpus"):
        WordVocab.build([])


def plain_build(lines: list[str], max_size: int | None = None) -> tuple[list[str], list[int]]:
    """The vocabulary algorithm as it was, line by line (the reference for the fast counter)."""
    counter: Counter[str] = Counter()
    for line in lines:
        counter.update(line.split())
        counter[EOS] += 1
    counter.setdefault(UNK, 0)
    if max_size is not None and len(counter) > max_size:
        words = [t for t, _ in counter.most_common() if t not in (EOS, UNK)][: max_size - 2]
        kept = Counter({t: counter[t] for t in words})
        kept[EOS] = counter[EOS]
        kept[UNK] = sum(counter.values()) - sum(kept.values())
        counter = kept
    ranked = counter.most_common()
    return [t for t, _ in ranked], [c for _, c in ranked]


# ties everywhere, blank and whitespace-only lines, a literal <eos>, odd whitespace
LINES = ["b a b", "", "c b a <eos> d", "  \t", "a\u00a0e f", "x y z", "z y x <unk>", "a"]


@pytest.mark.parametrize("max_size", [None, 3, 6, 100])
@pytest.mark.parametrize("batch", [1, 3, len(LINES)])
def test_fast_counter_equals_the_line_by_line_algorithm(max_size, batch):
    batches = [LINES[i : i + batch] for i in range(0, len(LINES), batch)]
    vocab = WordVocab.from_counts(count_words(batches), max_size)
    assert (vocab.itos, vocab.counts) == plain_build(LINES, max_size)
    flat = [i for line in LINES for i in vocab.encode_line(line)]
    ids = np.concatenate([vocab.encode_batch(lines) for lines in batches])
    assert ids.dtype == np.int32 and ids.tolist() == flat
    lengths = np.concatenate([vocab.line_lengths(lines, vocab.encode_batch(lines))
                              for lines in batches])  # fmt: skip
    assert lengths.tolist() == [len(vocab.encode_line(line)) for line in LINES]


# -- data.min_freq: the minimum training count, with max_size "both limits apply" -------------
def plain_min_freq(lines: list[str], max_size: int | None, min_freq: int):
    """torchtext's rule written out: count line by line, drop the words seen fewer than
    ``min_freq`` times, keep the ``max_size`` most frequent of the rest (ties by first
    occurrence), every dropped word counted as <unk>; <eos> and <unk> always kept."""
    counts: dict[str, int] = {}
    for line in lines:
        for word in [*line.split(), EOS]:
            counts[word] = counts.get(word, 0) + 1
    counts.setdefault(UNK, 0)
    first = list(counts)  # first-occurrence order
    words = [w for w in first if w not in (EOS, UNK) and counts[w] >= min_freq]
    words.sort(key=lambda w: -counts[w])  # stable: ties keep first occurrence
    if max_size is not None:
        words = words[: max(max_size - 2, 0)]
    kept = {w: counts[w] for w in words}
    kept[EOS] = counts[EOS]
    kept[UNK] = sum(counts.values()) - sum(kept.values())
    if len(kept) == len(counts):  # nothing dropped: the tokens in first-occurrence order
        kept = counts
    ranked = sorted(kept, key=lambda w: -kept[w])  # stable
    return ranked, [kept[w] for w in ranked]


# a 6, b 4, <eos> 10 (one literal), c 3, <unk> 2 written, d e 2, the rest once
MIN_FREQ_LINES = ["a b a", "c a b d", "<unk> a x", "e d c b", "", "a c <eos> e <unk>", "y a",
                  "z w", "b"]  # fmt: skip


@pytest.mark.parametrize("min_freq", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("max_size", [None, 3, 4, 6, 100])
def test_min_freq_drops_rare_words_and_both_limits_apply(min_freq, max_size):
    vocab = WordVocab.build(MIN_FREQ_LINES, max_size=max_size, min_freq=min_freq)
    assert (vocab.itos, vocab.counts) == plain_min_freq(MIN_FREQ_LINES, max_size, min_freq)
    assert sum(vocab.counts) == sum(len(line.split()) + 1 for line in MIN_FREQ_LINES)
    words = [w for w in vocab.itos if w not in (EOS, UNK)]
    assert all(vocab.counts[vocab.stoi[w]] >= min_freq for w in words)
    if min_freq == 1:  # the default: the vocabulary without the option, bit for bit
        assert (vocab.itos, vocab.counts) == plain_build(MIN_FREQ_LINES, max_size)
    flat = [vocab.stoi.get(w, vocab.unk_id) for line in MIN_FREQ_LINES
            for w in [*line.split(), EOS]]  # fmt: skip
    assert vocab.encode_batch(MIN_FREQ_LINES).tolist() == flat


def test_min_freq_keeps_eos_and_unk_and_counts_the_dropped_words_as_unk():
    vocab = WordVocab.build(["a a a b", "a c"], min_freq=3)  # b and c once, <eos> twice
    # <eos> (2) and <unk> (b, c) tie: <eos> first, as when max_size drops words
    assert vocab.itos == ["a", EOS, UNK] and vocab.counts == [4, 2, 2]
    assert vocab.encode_line("b c a") == [vocab.unk_id, vocab.unk_id, 0, vocab.eos_id]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_min_freq_below_one_or_not_an_integer_is_refused(bad):
    with pytest.raises(ValueError, match="min_freq must be an integer >= 1"):
        WordVocab.build(["a b"], min_freq=bad)


@pytest.mark.parametrize("max_size", [None, 4])
@pytest.mark.parametrize("batch", [1, 4, len(MIN_FREQ_LINES)])
def test_encode_batch_unknown_counts_the_words_outside_the_vocabulary(max_size, batch):
    """Its ids are ``encode_batch``'s, and its count is the words missing from the
    vocabulary, a ``<unk>`` (or ``<eos>``) written in the text not among them: a plain count
    line by line."""
    vocab = WordVocab.build(["a a b <unk> c", "b d"], max_size=max_size)
    lines = MIN_FREQ_LINES + ["<unk> <unk>", "q <unk> a"]
    for start in range(0, len(lines), batch):
        chunk = lines[start : start + batch]
        ids, unknown = vocab.encode_batch_unknown(chunk)
        assert ids.dtype == np.int32 and np.array_equal(ids, vocab.encode_batch(chunk))
        plain = sum(w not in vocab.stoi for line in chunk for w in line.split())
        assert unknown == plain


def test_a_min_freq_above_every_words_count_is_refused():
    with pytest.raises(ValueError, match="min_freq=4 leaves no word: the most frequent is seen 3"):
        WordVocab.build(["a a a b", "b"], min_freq=4)
