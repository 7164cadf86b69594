from collections import Counter

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from datamodules.vocab import EOS, UNK, BPEVocab, WordVocab, bpe
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
    for line in ("the cat sat on the mat", "a dog met the log", "catdog"):
        ids = vocab.encode_line(line)
        assert ids[-1] == vocab.eos_id
        assert vocab.detokenize(ids) == line
    # whitespace is between words, as for WordVocab: any run of it reads back as one space
    for line in ("mat  on  cat", " the\tcat\u00a0sat\u3000 ", "a\x1cdog\n\nmet"):
        assert vocab.detokenize(vocab.encode_line(line)) == " ".join(line.split())


def test_specials_and_unk_word(vocab):
    assert vocab.itos[vocab.eos_id] == EOS and vocab.itos[vocab.unk_id] == UNK
    ids = vocab.encode_line(" the <unk> said ", add_eos=False)
    assert vocab.unk_id in ids
    assert vocab.detokenize(ids) == "the said"  # specials dropped, no double space
    # characters never seen in training become <unk_char>, not the <unk> word
    ids = vocab.encode_line("xyz", add_eos=False)
    assert vocab.unk_char_id in ids and vocab.unk_id not in ids


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
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(bpe.SPECIALS),
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


# single-spaced lines, literal specials (glued to a word too), unseen characters
SPACED = [
    " the cat ",
    "<unk> dog",
    "x<unk>y z",
    "the<eos>dog",
    "",
    "a\u2581b",
    "row\n",
    "caf\u00e9 na\u00efve",
    "<unk>cat z\u00e9bre<unk>",
    "<unk_char> a<unk_char>b",
]
# every other spacing: double spaces, tabs, Unicode spaces, line breaks, spaces next to specials
ODD_SPACING = [
    "a  b",
    "tab\there",
    "nb\u00a0sp",
    "a\nb",
    "fs\x1cx",
    "\t<unk>\t\tdog  ",
    "the  <unk>  cat",
    "x\u2003\u3000<eos> y",
    " \u00e9\u00a0 caf\u00e9\t\u00e9 ",
    "   ",
    "\t",
    "\u2028\u2029\x85",
    "a\r\nb",
    "<unk><unk>  <eos>\tcat<unk>",
    "x \u2581the",  # a literal marker at a word's start: a space
    "\u2581\u2581a\u2581 \u2581",
]


def test_encoding_by_word_type_equals_encoding_the_text(vocab):
    """The stream encoder's table of word types gives the tokenizer's ids, whatever the
    spacing: the tokenizer makes every whitespace run one space."""
    encoder = StreamEncoder(vocab.tokenizer)
    assert encoder.any_spacing
    spaced, odd = SPACED, ODD_SPACING
    for lines in [CORPUS, spaced, odd, spaced + odd, *([line] * 3 for line in odd)]:
        expected = BPEVocab.encode_theirs(vocab.tokenizer, list(lines))
        assert encoder.encode(list(lines)).tolist() == expected.tolist()
        line_by_line = [i for line in lines for i in vocab.encode_line(line)]
        assert vocab.encode_batch(list(lines)).tolist() == line_by_line
    # the test for tokenizers that do not collapse whitespace (trained before it)
    assert StreamEncoder.single_spaced(SPACED[:5] + SPACED[6:]) and not any(
        StreamEncoder.single_spaced([line]) for line in [*odd[:5], "a \u2581b", "a\u2581b"]
    )
    # every whitespace character but the space and the line break sends a line the direct way
    for code in range(0x110000):
        if chr(code).isspace() and chr(code) not in " \n":
            assert not StreamEncoder.single_spaced([f"a{chr(code)}b"]), hex(code)


def test_whitespace_is_that_of_str_split():
    spaces = {chr(code) for code in range(0x110000) if chr(code).isspace()}
    assert set(bpe._SPACES) == spaces and len(bpe._SPACES) == len(spaces)
    normalizer = BPEVocab._new_tokenizer().normalizer
    for space in spaces:
        assert normalizer.normalize_str(f"{space}a{space}b{space * 3}c{space}") == "a b c"
    others = "".join(
        chr(code)
        for code in range(0x110000)
        if not chr(code).isspace() and not 0xD800 <= code < 0xE000 and code != 0x2581
    )
    assert normalizer.normalize_str(others) == others
    assert normalizer.normalize_str(" a b  c\t \u00a0d ") == "a b c d"
    # the literal marker is a separator too (Metaspace splits a word there anyway)
    assert normalizer.normalize_str("\u2581a\u2581\u2581b \u2581c\u2581") == "a b c"


# a BPE whose training text lacks the characters \u00e9, \u00ef, v, w, ...
CAFE = ["the cafe is open"] * 5


@pytest.fixture(scope="module")
def cafe() -> BPEVocab:
    return BPEVocab.build(CAFE, 40)


@pytest.mark.parametrize(
    "line",
    ["the caf\u00e9 is  open\tnow", "na\u00efve\u00a0cafe", "  the\u2003cafe\x1c\x1fis  ",
     "<unk> is open", "\u00e9 \u00e9\u00e9 w", "the <unk>  caf\u00e9\n\nopen", "", "   "],
)  # fmt: skip
def test_bpe_words_are_the_words_of_the_word_vocabulary(cafe, line):
    """Word-level perplexity divides by the word starts: the words of str.split (a literal
    <unk> one of them) and <eos>, however spaced, unseen characters adding none."""
    ids = cafe.encode_line(line)
    words = len(line.split()) + 1
    assert int(cafe.word_start_mask[ids].sum()) == words
    assert int(cafe.word_start_mask[cafe.encode_batch([line, line])].sum()) == 2 * words


def test_unseen_characters_are_inside_their_word(cafe):
    assert not cafe.word_start_mask[cafe.unk_char_id]
    assert cafe.word_start_mask[cafe.unk_id] and cafe.word_start_mask[cafe.eos_id]
    assert cafe.unk_char_id not in cafe.special_ids
    ids = cafe.encode_line("the caf\u00e9 is  open\tnow")
    assert cafe.decode(ids).count("<unk_char>") == 2 and cafe.unk_id not in ids
    # a continuation that spells nothing, as the tokenizer writes it; detokenize drops it
    assert cafe.decode_words(ids) == ["the", "caf", "is", "open", "no", "<eos>"]
    assert cafe.detokenize(ids) == "the caf is open no"
    op, en = (cafe.stoi[piece] for piece in ("op", "en"))
    assert cafe.decode_words([cafe.unk_char_id, op, cafe.eos_id, cafe.unk_char_id, en]) == [
        "op",
        "<eos>",
        "en",
    ]
    # the text of seen characters comes back, spaced as str.split words
    for line in ["the cafe  is\topen", "\u00a0open  the\u3000cafe ", "the <unk> is open"]:
        ids = cafe.encode_line(line)
        assert cafe.detokenize(ids) == " ".join(w for w in line.split() if w != UNK)
        assert cafe.unk_char_id not in ids


def test_unseen_characters_are_counted(cafe):
    lines = ["the caf\u00e9", "na\u00efve <unk>", "the <unk> cafe", "wow\u00a0<unk_char>"]
    ids, unknown = cafe.encode_batch_unknown(lines)
    assert ids.tolist() == [i for line in lines for i in cafe.encode_line(line)]
    # é; ï, v; w, w (the written <unk> and <unk_char> are not counted)
    assert unknown == 5
    assert cafe.encode_batch_unknown(["the cafe", "<unk> is open"])[1] == 0


def old_format_vocab(lines: list[str], vocab_size: int) -> BPEVocab:
    """A BPE as trained before <unk_char> and the whitespace normaliser (in older
    checkpoints), through its state dict."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.normalizer = normalizers.Strip()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[UNK, EOS],
                                  show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator(lines, trainer)
    theirs = BPEVocab.encode_theirs(tokenizer, lines)
    vocab = BPEVocab.from_counts(
        tokenizer, np.bincount(theirs, minlength=len(tokenizer.get_vocab()))
    )
    return BPEVocab.from_state_dict(vocab.state_dict())


def test_an_old_format_tokenizer_loads_and_encodes_as_before():
    old = old_format_vocab(CAFE, 40)
    assert "<unk_char>" not in old.tokenizer.get_vocab() and old.unk_char_id is None
    line = "the caf\u00e9 is  open"
    ids = old.encode_line(line)
    assert ids == [old._ours[t] for t in old.tokenizer.encode(line).ids] + [old.eos_id]
    # as it was: <unk> for the unseen character, a word start; a lone marker for "  "
    assert old.decode(ids) == [
        "\u2581the",
        "\u2581caf",
        UNK,
        "\u2581is",
        "\u2581",
        "\u2581open",
        EOS,
    ]
    assert int(old.word_start_mask[ids].sum()) == 7
    assert old.detokenize(ids) == "the caf is  open"
    lines = [*SPACED, *ODD_SPACING, line]
    assert not StreamEncoder(old.tokenizer).any_spacing
    ids, unknown = old.encode_batch_unknown(lines)
    assert ids.tolist() == [i for line in lines for i in old.encode_line(line)]
    assert unknown == int(np.count_nonzero(ids == old.unk_id)) - sum(s.count(UNK) for s in lines)
    assert unknown > 0
