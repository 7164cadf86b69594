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
    assert [vocab.itos[c] for c in vocab.layout_codes[:5]] == words.itos[:5]
    assert [vocab.itos[c] for c in vocab.row_codes] == [f"<row{r}>" for r in range(4)]
    assert [vocab.itos[c] for c in vocab.col_codes] == [f"<col{c}>" for c in range(7)]
    assert vocab.num_rare == 27
    assert vocab.itos[vocab.eos_id] == EOS and vocab.decode([vocab.eos_id]) == [EOS]
    # frequency init fills the table row by row
    assert vocab.table()[0].tolist() == list(range(5, 12))
    assert (vocab.table() >= 0).sum() == 27


def test_encoding_matches_the_table(vocab):
    line = "w0 w10 w29 nope"
    codes = vocab.encode_line(line)
    ids = vocab.words.encode_line(line)
    expected = []  # plain reference: walk the table, name the codes
    for w in ids:
        if w < 5:
            expected.append(vocab.words.itos[w])
        else:
            r, c = [int(x) for x in (vocab.table() == w).nonzero()[0]]
            expected += [f"<row{r}>", f"<col{c}>"]
    assert [vocab.itos[c] for c in codes] == expected
    assert vocab.decode(codes) == ["w0", "w10", "w29", UNK, EOS]
    assert vocab.detokenize(codes) == "w0 w10 w29"
    assert vocab.word_start_mask[torch.tensor(codes)].sum() == len(ids)


def test_round_trip_with_a_random_table():
    vocab = HybridLightRNNVocab.build(CORPUS, 5, 4, 7, init="random", seed=3)
    assert vocab.table()[0].tolist() != list(range(5, 12))
    for line in CORPUS:
        assert vocab.decode(vocab.encode_line(line)) == line.split() + [EOS]


def test_invalid_generated_sequences_decode_to_unk(vocab):
    row, col = int(vocab.row_codes[1]), int(vocab.col_codes[2])
    unused_row, unused_col = int(vocab.row_codes[3]), int(vocab.col_codes[6])  # cell 27: unused
    w0 = int(vocab.layout_codes[0])  # the most frequent word's code
    assert vocab.decode([col]) == [UNK]  # column without a row
    assert vocab.decode([row, w0]) == [UNK, "w0"]  # row without its column
    assert vocab.decode([w0, row]) == ["w0", UNK]  # incomplete at the end
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


def test_a_configured_table_mostly_empty_is_kept_with_a_warning(caplog):
    """PTB's 85 x 85 on a user's small corpus: kept as asked, and the size that fits is named."""
    vocab = HybridLightRNNVocab.build(CORPUS, num_frequent=5, rows=8, cols=8)
    assert (vocab.rows, vocab.cols) == (8, 8)
    assert "64 cells for 27 rare words" in caplog.text and "(6 x 5)" in caplog.text
    caplog.clear()
    assert HybridLightRNNVocab.table_shape(27, 6, 9) == (6, 9)  # 54 cells: half empty at most
    assert caplog.text == ""


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


def test_code_ids_are_ranked_by_training_count(vocab):
    """DESIGN's rule for every vocabulary: ids by decreasing frequency. A row or column code
    stands for many rare words, so it ranks among (or above) the frequent words."""
    counts = vocab.class_counts()
    assert (counts[:-1] >= counts[1:]).all()
    # plain reference: count each slot by walking the corpus, then rank the slots
    names = vocab.words.itos[:5] + [f"<row{r}>" for r in range(4)] + [f"<col{c}>" for c in range(7)]
    slot_count = dict.fromkeys(names, 0)
    for line in CORPUS:
        for w in vocab.words.encode_line(line):
            if w < 5:
                slot_count[vocab.words.itos[w]] += 1
            else:
                r, c = [int(x) for x in (vocab.table() == w).nonzero()[0]]
                slot_count[f"<row{r}>"] += 1
                slot_count[f"<col{c}>"] += 1
    assert vocab.itos == sorted(names, key=lambda name: -slot_count[name])  # (a stable sort)
    assert vocab.itos[:4] == ["<row0>", "<row1>", "<row2>", "<col0>"]  # row 0: 7 words, 154 uses
    assert vocab.itos[10:12] == ["w0", EOS]  # 30 each: the tie keeps the words' order


def test_code_ids_stay_fixed_when_the_table_changes(vocab):
    """A head's class ids never move under it: a re-learnt table keeps the code ids, although
    the rows' and columns' counts change."""
    ids = vocab.layout_codes.clone()
    cells = torch.randperm(28, generator=torch.Generator().manual_seed(1))[:27]
    vocab.schedule_cells(cells)
    vocab.begin_training_pass()
    assert torch.equal(vocab.layout_codes, ids) and torch.equal(vocab.cells, cells)
    assert torch.equal(vocab.with_cells(cells).layout_codes, ids)
    counts = vocab.class_counts()
    assert not (counts[:-1] >= counts[1:]).all()  # this table is no longer in count order
    for line in CORPUS:
        assert vocab.decode(vocab.encode_line(line)) == line.split() + [EOS]


def test_a_checkpoint_from_before_ranked_codes_keeps_its_ids(vocab):
    """Saved vocabularies without ``layout_codes`` used the layout as ids (K frequent words,
    then rows, then columns): they load with those ids, so their heads stay right."""
    old = vocab.state_dict()
    del old["layout_codes"]
    restored = HybridLightRNNVocab.from_state_dict(old)
    assert torch.equal(restored.layout_codes, torch.arange(16))
    assert restored.itos[:5] == vocab.words.itos[:5] and restored.itos[5] == "<row0>"
    # w10 is word 11 (after <eos>): rare word 6, cell (0, 6); <eos> is word 1
    assert restored.encode_line("w0 w10") == [0, 5 + 0, 5 + 4 + 6, 1]
    fresh = HybridLightRNNVocab.build(CORPUS, 5, 4, 7)
    assert fresh.accepts(restored)
    fresh.load_state_dict(old)
    assert fresh == restored and fresh.eos_id == restored.eos_id == vocab.words.eos_id
    with pytest.raises(ValueError, match="permutation"):
        HybridLightRNNVocab(vocab.words, 5, 4, 7, layout_codes=[0] * 16)
