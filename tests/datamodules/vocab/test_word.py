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
