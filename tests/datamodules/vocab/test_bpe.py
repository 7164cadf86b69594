from collections import Counter

import numpy as np
import pytest
from tokenizers import trainers

from datamodules.vocab import EOS, UNK, BPEVocab, WordVocab
from datamodules.vocab.bpe import StreamEncoder

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


def test_decode_words_joins_pieces_and_keeps_specials(vocab):
    ids = vocab.encode_line("the catdog <unk> mat", add_eos=True) + vocab.encode_line("a log")
    assert len(ids) > 8  # pieces, not one id per word
    words = ["the", "catdog", "<unk>", "mat", "<eos>", "a", "log", "<eos>"]
    assert vocab.decode_words(ids) == words
    # a stream that begins inside a word (a sample after a prompt) keeps its first piece
    inner = vocab.encode_line("catdog", add_eos=False)[1:]
    assert vocab.decode_words(inner) == ["".join(vocab.decode(inner))]


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


def plain_build(lines: list[str], vocab_size: int) -> BPEVocab:
    """The BPE algorithm as it was: train on the lines, encode them all a second time and
    rank by a Python Counter (the reference for train-on-a-stream and encode-once)."""
    tokenizer = BPEVocab._new_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[UNK, EOS],
                                  show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator(lines, trainer)
    counter: Counter[int] = Counter()
    for encoding in tokenizer.encode_batch(lines):
        counter.update(encoding.ids)
    counter[tokenizer.token_to_id(EOS)] += len(lines)
    order = sorted(range(tokenizer.get_vocab_size()), key=lambda t: (-counter[t], t))
    return BPEVocab(tokenizer, [tokenizer.id_to_token(t) for t in order],
                    [counter[t] for t in order])  # fmt: skip


# blank lines, stray spaces, a literal <eos> (its own token, more <eos> than lines), <unk>
ODD = ["", "  the cat  ", "the<eos>dog", "\tmat\u00a0on", "<unk> <unk>", "z\u00e9bre", "x"]


@pytest.mark.parametrize("size", [12, 40, 60])
def test_stream_training_and_one_encoding_equal_the_old_algorithm(size):
    lines = CORPUS + ODD
    batches = [lines[i : i + 5] for i in range(0, len(lines), 5)]
    tokenizer = BPEVocab.train_tokenizer(iter(batches), size)
    theirs = np.concatenate([BPEVocab.encode_theirs(tokenizer, b) for b in batches])
    counts = np.bincount(theirs, minlength=tokenizer.get_vocab_size())
    vocab = BPEVocab.from_counts(tokenizer, counts)
    assert vocab == plain_build(lines, size) == BPEVocab.build(lines, size)
    assert vocab.counts == plain_build(lines, size).counts


def test_batch_encoding_equals_line_by_line(vocab):
    lines = CORPUS[:3] + ODD
    ids = vocab.encode_batch(lines)
    assert ids.dtype == np.int32
    assert ids.tolist() == [i for line in lines for i in vocab.encode_line(line)]
    lengths = vocab.line_lengths(lines, ids)  # the literal <eos>: counted line by line
    assert lengths.tolist() == [len(vocab.encode_line(line)) for line in lines]
    plain = CORPUS[:3] + ["", "x"]  # no literal <eos>: read off the <eos> positions
    assert vocab.line_lengths(plain, vocab.encode_batch(plain)).tolist() == [
        len(vocab.encode_line(line)) for line in plain
    ]


def test_encoding_by_word_type_equals_encoding_the_text(vocab):
    """The stream encoder's table of word types gives the tokenizer's ids; lines spaced
    otherwise than by single spaces (where the two differ) take the direct path."""
    encoder = StreamEncoder(vocab.tokenizer)
    spaced = [" the cat ", "<unk> dog", "x<unk>y z", "the<eos>dog", "", "a\u2581b", "row\n"]
    odd = ["a  b", "tab\there", "nb\u00a0sp", "a\nb", "fs\x1cx"]
    for lines in [CORPUS, spaced, odd, spaced + odd, *([line] * 3 for line in odd)]:
        expected = BPEVocab.encode_theirs(vocab.tokenizer, list(lines))
        assert encoder.encode(list(lines)).tolist() == expected.tolist()
    assert StreamEncoder.single_spaced(spaced) and not any(
        StreamEncoder.single_spaced([line]) for line in odd
    )
    # every whitespace character but the space and the line break sends a line the direct way
    for code in range(0x110000):
        if chr(code).isspace() and chr(code) not in " \n":
            assert not StreamEncoder.single_spaced([f"a{chr(code)}b"]), hex(code)
