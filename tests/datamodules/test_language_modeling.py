import pytest
import torch

from datamodules import LanguageModelingDataModule
from datamodules.errors import DataConfigError, DataPathError, VocabularyMismatchError
from datamodules.vocab import EOS, UNK, WordVocab
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab


def test_ptb_vocabulary_and_token_counts(ptb_data):
    vocab = ptb_data.vocab
    assert ptb_data.vocab_size == 10_000  # 9,999 word types + <eos>
    assert {EOS, UNK} <= set(vocab.itos)
    assert vocab.itos[0] == "the"
    assert vocab.counts == sorted(vocab.counts, reverse=True)
    # words + one <eos> per line (PTB: 887,521 + 42,068 lines; valid 3,370; test 3,761 lines)
    assert ptb_data.split_tokens("train").numel() == 887_521 + 42_068
    assert ptb_data.split_tokens("valid").numel() == 70_390 + 3_370
    assert ptb_data.split_tokens("test").numel() == 78_669 + 3_761
    assert vocab.counts[vocab.eos_id] == 42_068


def test_train_batches_decode_to_the_corpus(ptb_data, ptb_path):
    x, y = next(iter(ptb_data.train_dataloader()))
    assert x.shape == y.shape == (20, 35)
    first_line = open(f"{ptb_path}/ptb.train.txt").readline().split()
    assert ptb_data.vocab.decode(x[0, : len(first_line)].tolist()) == first_line
    assert ptb_data.vocab.decode([int(x[0, len(first_line)])]) == [EOS]
    torch.testing.assert_close(y[:, :-1], x[:, 1:])


def test_checkpoint_round_trip_and_mismatch(ptb_data):
    state = ptb_data.state_dict()
    ptb_data.load_state_dict(state)  # same vocabulary: fine
    other = {"vocab": WordVocab.build(["some other corpus"]).state_dict()}
    with pytest.raises(VocabularyMismatchError, match="another vocabulary"):
        ptb_data.load_state_dict(other)


def test_missing_path_is_reported(tmp_path):
    with pytest.raises(DataPathError, match="does not exist"):
        _ = LanguageModelingDataModule(path=str(tmp_path / "nope")).vocab_size


def test_empty_file_is_reported(tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"c.{split}.txt").write_text("a b\n" if split != "valid" else "\n\n")
    with pytest.raises(DataPathError, match="valid file .* is empty"):
        _ = LanguageModelingDataModule(path=str(tmp_path)).vocab_size


def test_split_files_can_be_named(tmp_path):
    for name in ("one.txt", "two.txt", "three.txt"):
        (tmp_path / name).write_text("x y z\n" * 30)
    files = {"train": "one.txt", "valid": "two.txt", "test": "three.txt"}
    data = LanguageModelingDataModule(path=str(tmp_path), files=files, batch_size=2, bptt=4)
    assert data.vocab_size == 5  # x y z <eos> <unk>
    assert data.split_tokens("test").numel() == 120


def test_ambiguous_folder_asks_for_file_names(tmp_path):
    (tmp_path / "a.train.txt").write_text("x\n")
    (tmp_path / "b.train.txt").write_text("x\n")
    with pytest.raises(DataPathError, match="data.files"):
        _ = LanguageModelingDataModule(path=str(tmp_path)).vocab_size


@pytest.mark.parametrize("name", ["batch_size", "eval_batch_size", "bptt"])
def test_sizes_must_be_positive(name):
    with pytest.raises(ValueError, match=f"data.{name} must be a positive integer"):
        LanguageModelingDataModule(**{name: 0})


# -- BPE and Hybrid-LightRNN vocabularies ---------------------------------------------------
PTB_WORDS = {"train": 887_521 + 42_068, "valid": 70_390 + 3_370}


@pytest.fixture(scope="module")
def ptb_bpe(ptb_path):
    return LanguageModelingDataModule(path=ptb_path, vocab="bpe", bpe_vocab_size=2000)


@pytest.fixture(scope="module")
def ptb_lightrnn(ptb_path):
    return LanguageModelingDataModule(path=ptb_path, vocab="hybrid_lightrnn", lightrnn_frequent=500)


def test_bpe_data_decodes_to_the_corpus_and_counts_words(ptb_bpe, ptb_path):
    assert ptb_bpe.vocab_size == 2000
    first_line = open(f"{ptb_path}/ptb.train.txt").readline()
    codes = ptb_bpe.split_tokens("train")
    n = len(ptb_bpe.vocab.encode_line(first_line))
    assert ptb_bpe.vocab.detokenize(codes[:n].tolist()) == " ".join(first_line.split())
    for split, words in PTB_WORDS.items():  # word-level perplexity divides by these
        assert ptb_bpe.word_start_mask[ptb_bpe.split_tokens(split)].sum() == words
    x, y = next(iter(ptb_bpe.train_dataloader()))
    assert x.shape == (20, 35) and int(x.max()) < 2000


def test_lightrnn_data_codes_and_words(ptb_lightrnn, ptb_path):
    vocab = ptb_lightrnn.vocab
    assert vocab.rows * vocab.cols >= 10_000 - 500
    assert ptb_lightrnn.vocab_size == 500 + vocab.rows + vocab.cols
    first_line = open(f"{ptb_path}/ptb.train.txt").readline().split()
    codes = ptb_lightrnn.split_tokens("train")
    assert vocab.decode(codes[: 2 * len(first_line) + 1].tolist()) == first_line + ["<eos>"]
    x, _ = next(iter(ptb_lightrnn.train_dataloader()))
    assert torch.equal(x[0], codes[:35])
    for split, words in PTB_WORDS.items():
        codes = ptb_lightrnn.split_tokens(split)
        assert ptb_lightrnn.word_start_mask[codes].sum() == words
        rare = (ptb_lightrnn.split_word_ids(split) >= 500).sum()
        assert codes.numel() == words + rare  # one extra code per rare word


def test_lightrnn_table_is_restored_from_the_checkpoint_state(ptb_lightrnn, ptb_path):
    state = ptb_lightrnn.state_dict()
    moved = torch.roll(ptb_lightrnn.vocab.cells, 1)
    state["vocab"]["cells"] = moved.tolist()
    other = LanguageModelingDataModule(
        path=ptb_path, vocab="hybrid_lightrnn", lightrnn_frequent=500
    )
    before = other.split_tokens("valid").clone()
    other.load_state_dict(state)
    assert torch.equal(other.vocab.cells, moved)
    assert not torch.equal(other.split_tokens("valid"), before)  # re-encoded with the table
    with pytest.raises(VocabularyMismatchError, match="another vocabulary"):
        ptb_lightrnn.load_state_dict(
            {"vocab": HybridLightRNNVocab.build(["a b c"], 4).state_dict()}
        )


def test_bpe_checkpoint_round_trip_and_mismatch(ptb_bpe):
    ptb_bpe.load_state_dict(ptb_bpe.state_dict())
    with pytest.raises(VocabularyMismatchError, match="data.vocab"):
        ptb_bpe.load_state_dict(ptb_data_word_state())


def ptb_data_word_state():
    return {"vocab": WordVocab.build(["some other corpus"]).state_dict()}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"vocab": "chars"}, "data.vocab must be one of word, bpe, hybrid_lightrnn"),
        ({"vocab": "hybrid_lightrnn", "lightrnn_init": "sorted"}, "data.lightrnn_init"),
    ],
)
def test_bad_vocab_options(options, message):
    with pytest.raises(DataConfigError, match=message):
        LanguageModelingDataModule(**options)


def test_lightrnn_options_that_cannot_work_are_one_clear_error(tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"c.{split}.txt").write_text("a b c d e f g h\n")
    data = LanguageModelingDataModule(
        path=str(tmp_path), vocab="hybrid_lightrnn", lightrnn_frequent=2, lightrnn_rows=2,
        lightrnn_cols=2,
    )  # fmt: skip
    message = r"data.vocab=hybrid_lightrnn \(data.lightrnn_\*\): <eos> is word 8 .*num_frequent"
    with pytest.raises(DataConfigError, match=message):
        _ = data.vocab_size


def test_lightrnn_table_too_small_for_the_corpus_grows_to_fit(tmp_path, caplog):
    for split in ("train", "valid", "test"):
        (tmp_path / f"c.{split}.txt").write_text("a b\nc d\ne f\ng h\n")
    data = LanguageModelingDataModule(
        path=str(tmp_path), vocab="hybrid_lightrnn", lightrnn_frequent=2, lightrnn_rows=2,
        lightrnn_cols=2,
    )  # fmt: skip
    vocab = data.vocab  # <eos> and a frequent; b..h and <unk> rare: 8 words, 4 cells
    assert (vocab.rows, vocab.cols) == (3, 3) and "using 3 x 3" in caplog.text
    lines = [[*pair, "<eos>"] for pair in ("ab", "cd", "ef", "gh")]
    assert vocab.decode(data.split_tokens("test").tolist()) == sum(lines, [])


def test_a_scheduled_table_waits_for_the_next_training_pass(tmp_path):
    """Checkpoint between a re-assignment and the next epoch: test with the table the
    weights were trained with, resume with the new one."""
    for split in ("train", "valid", "test"):
        (tmp_path / f"c.{split}.txt").write_text("a b c d e f g h i j\na b c\n" * 20)
    options = dict(path=str(tmp_path), vocab="hybrid_lightrnn", lightrnn_frequent=4,
                   lightrnn_rows=3, lightrnn_cols=3, batch_size=2, bptt=5)  # fmt: skip
    data = LanguageModelingDataModule(**options)
    trained = data.vocab.cells.clone()
    new = trained.flip(0)
    data.schedule_lightrnn_cells(new)
    assert torch.equal(data.vocab.cells, trained)
    state = data.state_dict()
    restored = LanguageModelingDataModule(**options)
    restored.load_state_dict(state)
    assert torch.equal(restored.vocab.cells, trained)  # what validate/test use
    valid = restored.split_tokens("valid").clone()
    next(iter(restored.train_dataloader()))  # a training pass starts: the new table
    assert torch.equal(restored.vocab.cells, new)
    assert not torch.equal(restored.split_tokens("valid"), valid)
    assert "lightrnn_scheduled_cells" not in restored.state_dict()
    with pytest.raises(ValueError, match="bijection"):
        data.schedule_lightrnn_cells(torch.zeros_like(new))
