import pytest

from datamodules.vocab import EOS, UNK, WordVocab


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
