import pytest
import torch

from app.vocab import EOS, UNK, VocabularyMismatchError, WordVocab
from datamodules import LanguageModelingDataModule
from datamodules.text_source import DataPathError


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
