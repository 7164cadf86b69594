import pytest
import torch

from datamodules.vocab import EOS, UNK, WordVocab
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab

# word i appears 30 - i times: a clear frequency order
CORPUS = [" ".join(f"w{i}" for i in range(30) if i <= j) for j in range(30)]


@pytest.fixture()
def vocab() -> HybridLightRNNVocab:
    return HybridLightRNNVocab.build(CORPUS, num_frequent=5, rows=4, cols=7)


def test_layout_and_sizes(vocab):
    words = vocab.words
    assert len(words) == 32  # 30 words + <eos> + <unk>
    assert len(vocab) == 5 + 4 + 7  # K + d1 + d2 codes
    assert vocab.itos[:5] == words.itos[:5]
    assert vocab.num_rare == 27
    assert vocab.eos_id == words.eos_id < 5
    # frequency init fills the table row by row
    assert vocab.table()[0].tolist() == list(range(5, 12))
    assert (vocab.table() >= 0).sum() == 27


def test_encoding_matches_the_table(vocab):
    line = "w0 w10 w29 nope"
    codes = vocab.encode_line(line)
    ids = vocab.words.encode_line(line)
    expected = []  # plain reference: walk the table
    for w in ids:
        if w < 5:
            expected.append(w)
        else:
            r, c = [int(x) for x in (vocab.table() == w).nonzero()[0]]
            expected += [5 + r, 5 + 4 + c]
    assert codes == expected
    assert vocab.decode(codes) == ["w0", "w10", "w29", UNK, EOS]
    assert vocab.detokenize(codes) == "w0 w10 w29"
    assert vocab.word_start_mask[torch.tensor(codes)].sum() == len(ids)


def test_round_trip_with_a_random_table():
    vocab = HybridLightRNNVocab.build(CORPUS, 5, 4, 7, init="random", seed=3)
    assert vocab.table()[0].tolist() != list(range(5, 12))
    for line in CORPUS:
        assert vocab.decode(vocab.encode_line(line)) == line.split() + [EOS]


def test_invalid_generated_sequences_decode_to_unk(vocab):
    K, R = 5, 4
    row, col = K + 1, K + R + 2
    unused_row, unused_col = K + 3, K + R + 6  # cell 27: past the 27 rare words
    assert vocab.decode([col]) == [UNK]  # column without a row
    assert vocab.decode([row, 0]) == [UNK, vocab.itos[0]]  # row without its column
    assert vocab.decode([0, row]) == [vocab.itos[0], UNK]  # incomplete at the end
    assert vocab.decode([row, row, col]) == [UNK, vocab.words.itos[int(vocab.table()[1, 2])]]
    assert vocab.decode([unused_row, unused_col]) == [UNK]
    with pytest.raises(ValueError, match="outside"):
        vocab.decode([len(vocab)])


def test_table_size_and_eos_are_checked():
    words = WordVocab.build(CORPUS)
    with pytest.raises(ValueError, match=r"K \+ d1\*d2 = 5 \+ 3\*3 = 14 < 32 words"):
        HybridLightRNNVocab(words, num_frequent=5, rows=3, cols=3)  # a restored table is exact
    with pytest.raises(ValueError, match="num_frequent"):
        HybridLightRNNVocab(words, 1, 6, 6)  # <eos> is not among the frequent words
    with pytest.raises(ValueError, match="init"):
        HybridLightRNNVocab.build(CORPUS, 5, 4, 7, init="alphabetical")


def test_a_configured_table_too_small_for_the_vocabulary_grows_to_fit(caplog):
    """PTB's 85 x 85 on WikiText-103's 267k words: the vocabulary decides the cells needed."""
    vocab = HybridLightRNNVocab.build(CORPUS, num_frequent=5, rows=3, cols=3)
    assert (vocab.rows, vocab.cols) == (5, 6)  # 27 rare words: 3 x 3 scaled by sqrt(3)
    assert "table 3 x 3" in caplog.text and "using 5 x 6" in caplog.text
    assert HybridLightRNNVocab.table_shape(264_000, 85, 85) == (514, 514)
    assert HybridLightRNNVocab.table_shape(100, 4, 50) == (4, 50)  # fits: kept as given
    assert HybridLightRNNVocab.table_shape(401, 2, 200) == (2, 201)  # about its shape


def test_near_square_table_by_default():
    vocab = HybridLightRNNVocab.build(CORPUS, num_frequent=5)
    assert (vocab.rows, vocab.cols) == (6, 5)  # ceil(sqrt(27)), then ceil(27 / 6)
    vocab = HybridLightRNNVocab.build(CORPUS, num_frequent=5, rows=3)
    assert vocab.cols == 9


def test_new_table_must_be_a_bijection(vocab):
    with pytest.raises(ValueError, match="bijection"):
        vocab.set_cells([0] * 27)
    with pytest.raises(ValueError, match="lie in"):
        vocab.set_cells(list(range(1, 27)) + [28])
    cells = torch.randperm(28)[:27]
    vocab.set_cells(cells)
    for line in CORPUS:
        assert vocab.decode(vocab.encode_line(line)) == line.split() + [EOS]


def test_state_dict_round_trip_keeps_the_table(vocab):
    vocab.set_cells(torch.arange(27).flip(0))
    again = HybridLightRNNVocab.from_state_dict(vocab.state_dict())
    assert again == vocab and again.fingerprint() == vocab.fingerprint()
    assert torch.equal(again.table(), vocab.table())
    fresh = HybridLightRNNVocab.build(CORPUS, 5, 4, 7)
    assert fresh.same_structure(vocab) and fresh != vocab
