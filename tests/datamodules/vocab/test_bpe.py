import pytest

from datamodules.vocab import EOS, UNK, BPEVocab, WordVocab

CORPUS = [
    "the cat sat on the mat",
    "the dog sat on the log",
    "a cat and a dog met on the mat",
    "the <unk> said the cat",
] * 5


@pytest.fixture(scope="module")
def vocab() -> BPEVocab:
    return BPEVocab.build(CORPUS, 40)


def test_round_trip_of_normal_text(vocab):
    for line in ("the cat sat on the mat", "a dog met the log", "mat  on  cat", "catdog"):
        ids = vocab.encode_line(line)
        assert ids[-1] == vocab.eos_id
        assert vocab.detokenize(ids) == line


def test_specials_and_unk_word(vocab):
    assert vocab.itos[vocab.eos_id] == EOS and vocab.itos[vocab.unk_id] == UNK
    ids = vocab.encode_line(" the <unk> said ", add_eos=False)
    assert vocab.unk_id in ids
    assert vocab.detokenize(ids) == "the said"  # specials dropped, no double space
    # characters never seen in training become <unk>
    assert vocab.unk_id in vocab.encode_line("xyz", add_eos=False)


def test_ids_sorted_by_training_frequency(vocab):
    assert len(vocab) == 40
    assert vocab.counts == sorted(vocab.counts, reverse=True)
    # recount from the encoded corpus: the stored counts are the real frequencies
    recount = [0] * len(vocab)
    for line in CORPUS:
        for i in vocab.encode_line(line):
            recount[i] += 1
    assert recount == vocab.counts
    assert vocab.counts[vocab.eos_id] == len(CORPUS)


def test_decode_gives_pieces(vocab):
    pieces = vocab.decode(vocab.encode_line("the cat", add_eos=False))
    assert "".join(pieces).replace("\u2581", " ").strip() == "the cat"


def test_state_dict_round_trip(vocab):
    state = vocab.state_dict()
    assert state["type"] == "bpe"
    again = BPEVocab.from_state_dict(state)
    assert again == vocab and again.fingerprint() == vocab.fingerprint()
    assert again.encode_line("the dog sat") == vocab.encode_line("the dog sat")
    assert vocab != BPEVocab.build(CORPUS, 30)


def test_bad_sizes_and_empty_corpus():
    with pytest.raises(ValueError, match="vocab_size"):
        BPEVocab.build(CORPUS, 2)
    with pytest.raises(ValueError, match="empty corpus"):
        BPEVocab.build(["", "  "], 100)


def test_word_vocab_detokenize():
    words = WordVocab.build(["a b c"])
    assert words.detokenize(words.encode_line("a x c")) == "a c"
