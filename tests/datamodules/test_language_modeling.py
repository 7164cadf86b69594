import io
import logging
import lzma
import pickle
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict, load_dataset

import datamodules.text_source as text_source
import datamodules.vocab.hybrid_lightrnn as hybrid_module
from datamodules import LanguageModelingDataModule
from datamodules.bptt import BPTTBatches
from datamodules.cache import CacheEntry, cache_root
from datamodules.errors import (
    DataConfigError,
    DataFormatError,
    DataPathError,
    VocabularyMismatchError,
)
from datamodules.vocab import EOS, UNK, WordVocab
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from tests.datamodules.test_text_source import WIKI_ROWS, write_hub_layout
from tests.datamodules.vocab.test_bpe import plain_build as plain_bpe
from tests.datamodules.vocab.test_word import plain_build, plain_min_freq


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


def test_token_counts_are_the_training_words_per_id(ptb_data, ptb_text):
    counts = ptb_data.token_counts
    assert counts.shape == (ptb_data.vocab_size,)
    lines = ptb_text["train"].splitlines()
    plain = Counter(i for line in lines for i in ptb_data.vocab.encode_line(line))
    assert counts[ptb_data.vocab.eos_id] == 42_068  # one <eos> per line
    assert {i: int(n) for i, n in enumerate(counts) if n} == dict(plain)


def test_train_batches_decode_to_the_corpus(ptb_data, ptb_text):
    x, y = next(iter(ptb_data.train_dataloader()))
    assert x.shape == y.shape == (20, 35)
    first_line = ptb_text["train"].split("\n", 1)[0].split()
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


def test_one_training_file_with_held_out_splits(tmp_path, caplog):
    """A corpus of one file: valid and test are its last lines, the vocabulary is counted on
    the lines before them (a word only in the held-out lines is <unk> there), and the cut is
    said in one line."""
    lines = [f"w{i % 7} w{i % 5}" for i in range(95)] + ["held out"] * 5 + ["w1 unseen"] * 5
    (tmp_path / "my_corpus.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataPathError, match="or hold out a share .* --data.held_out 0.05"):
        _ = LanguageModelingDataModule(path=str(tmp_path), files={"train": "my_corpus.txt"}).vocab
    with pytest.raises(DataConfigError, match="data.held_out must be a share"):
        LanguageModelingDataModule(path=str(tmp_path), held_out=0.7)
    with caplog.at_level(logging.INFO, logger="datamodules.language_modeling"):
        data = LanguageModelingDataModule(
            path=str(tmp_path), files={"train": "my_corpus.txt"}, held_out=0.05,
            cache_dir=str(tmp_path / "c"), batch_size=2, bptt=4,
        )  # fmt: skip
        vocab = data.vocab
    assert "valid and test are 5% of the training lines each" in caplog.text
    assert "held" not in vocab.itos and "unseen" not in vocab.itos
    assert len(vocab) == 7 + 2  # w0..w6, <eos>, <unk>
    valid, test = (vocab.decode(data.split_tokens(s).tolist()) for s in ("valid", "test"))
    assert valid == ["<unk>", "<unk>", "<eos>"] * 5
    assert test == ["w1", "<unk>", "<eos>"] * 5
    assert data.split_tokens("train").numel() == 95 * 3


def _in_input_order(batches) -> list[str]:
    """The prompts of predict's batches (sorted by length within windows) in the input's
    order, by each one's ``input_lines``."""
    numbered = [(i, p) for b in batches for i, p in zip(b["input_lines"], b["prompt"], strict=True)]
    assert sorted(i for i, _ in numbered) == list(range(len(numbered)))
    return [p for _, p in sorted(numbered)]


def test_prompts_from_a_file_are_the_given_prompts(tmp_path, monkeypatch):
    """``data.predict_file`` (compressed, a CRLF line, a blank one): the same batches as
    ``data.predict_prompts`` of its lines; one or the other; a missing file is named."""
    for split in ("train", "valid", "test"):
        (tmp_path / f"c.{split}.txt").write_text("x y z\n" * 30)
    prompts = ["x y", "z", "", "y x z"]
    (tmp_path / "prompts.txt.xz").write_bytes(lzma.compress(b"x y\r\nz\n\ny x z"))
    options = dict(path=str(tmp_path), cache_dir=str(tmp_path / "c"))
    given = LanguageModelingDataModule(predict_prompts=prompts, **options)
    from_file = LanguageModelingDataModule(predict_file=str(tmp_path / "prompts.txt"), **options)
    expected = list(given.predict_dataloader())
    batches = list(from_file.predict_dataloader())
    assert _in_input_order(batches) == prompts
    for batch, reference in zip(batches, expected, strict=True):
        assert torch.equal(batch["ids"], reference["ids"])
        assert batch["lengths"] == reference["lengths"]
    with pytest.raises(DataConfigError, match="predict_prompts and data.predict_file are both"):
        LanguageModelingDataModule(
            predict_prompts=prompts, predict_file="p.txt", **options
        ).predict_dataloader()
    with pytest.raises(DataPathError, match="data.predict_file .*nope.txt' does not exist"):
        LanguageModelingDataModule(
            predict_file=str(tmp_path / "nope.txt"), **options
        ).predict_dataloader()
    with pytest.raises(DataPathError, match="data.predict_file .* is not a file"):
        LanguageModelingDataModule(predict_file=str(tmp_path), **options).predict_dataloader()
    # "-": standard input (a pipe), read once
    text_source._stdin_lines.cache_clear()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x y\nz\n\ny x z\n")))
    from_stdin = LanguageModelingDataModule(predict_file="-", **options)
    for _ in range(2):
        assert _in_input_order(from_stdin.predict_dataloader()) == prompts
    text_source._stdin_lines.cache_clear()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe")))
    with pytest.raises(DataFormatError, match="standard input is not UTF-8 text"):
        from_stdin.predict_dataloader()
    text_source._stdin_lines.cache_clear()


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


def test_bpe_data_decodes_to_the_corpus_and_counts_words(ptb_bpe, ptb_text):
    assert ptb_bpe.vocab_size == 2000
    first_line = ptb_text["train"].split("\n", 1)[0]
    codes = ptb_bpe.split_tokens("train")
    n = len(ptb_bpe.vocab.encode_line(first_line))
    assert ptb_bpe.vocab.detokenize(codes[:n].tolist()) == " ".join(first_line.split())
    for split, words in PTB_WORDS.items():  # word-level perplexity divides by these
        assert ptb_bpe.word_start_mask[ptb_bpe.split_tokens(split)].sum() == words
    x, y = next(iter(ptb_bpe.train_dataloader()))
    assert x.shape == (20, 35) and int(x.max()) < 2000


def test_lightrnn_data_codes_and_words(ptb_lightrnn, ptb_text):
    vocab = ptb_lightrnn.vocab
    assert vocab.rows * vocab.cols >= 10_000 - 500
    assert ptb_lightrnn.vocab_size == 500 + vocab.rows + vocab.cols
    first_line = ptb_text["train"].split("\n", 1)[0].split()
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
        ({"min_freq": 0}, r"data.min_freq must be an integer >= 1, got 0"),
        ({"min_freq": 2.5}, r"data.min_freq must be an integer >= 1, got 2.5"),
        ({"vocab": "bpe", "min_freq": 2}, "data.min_freq=2 applies to word vocabularies"),
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
    # a corpus of fewer words than the frequent ones (a PTB config over one's own corpus)
    data = LanguageModelingDataModule(path=str(tmp_path), vocab="hybrid_lightrnn",
                                      lightrnn_frequent=2800)  # fmt: skip
    message = (
        r"data.vocab=hybrid_lightrnn \(data.lightrnn_\*\): num_frequent \(K = 2800\) "
        r"leaves no word for the table: the corpus has 10 words; set K below 10"
    )
    with pytest.raises(DataConfigError, match=message):
        _ = data.vocab_size


def test_lightrnn_table_too_small_for_the_corpus_grows_to_fit(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="datamodules")
    for split in ("train", "valid", "test"):
        (tmp_path / f"c.{split}.txt").write_text("a b\nc d\ne f\ng h\n")
    data = LanguageModelingDataModule(
        path=str(tmp_path), vocab="hybrid_lightrnn", lightrnn_frequent=2, lightrnn_rows=2,
        lightrnn_cols=2,
    )  # fmt: skip
    vocab = data.vocab  # <eos> and a frequent; b..h and <unk> rare: 8 words, 4 cells
    assert (vocab.rows, vocab.cols) == (3, 3) and "using 3 x 3" in caplog.text
    assert (
        "vocabulary (hybrid_lightrnn): 8 ids for 10 words (2 frequent words and the 3 rows and "
        "3 columns of the rare words' table)" in caplog.text
    )
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
    data.vocab.schedule_cells(new)
    assert torch.equal(data.vocab.cells, trained)
    state = data.state_dict()
    restored = LanguageModelingDataModule(**options)
    restored.load_state_dict(state)
    assert torch.equal(restored.vocab.cells, trained)  # what validate/test use
    valid = restored.split_tokens("valid").clone()
    next(iter(restored.train_dataloader()))  # a training pass starts: the new table
    assert torch.equal(restored.vocab.cells, new)
    assert not torch.equal(restored.split_tokens("valid"), valid)
    assert "scheduled_cells" not in restored.state_dict()["vocab"]
    with pytest.raises(ValueError, match="bijection"):
        data.vocab.schedule_cells(torch.zeros_like(new))


# -- prepared once, cached: the same vocabulary and ids as the algorithm it replaced -------------
def old_word_pipeline(lines: dict[str, list[str]], max_size: int | None = None):
    """The vocabulary and ids as they were computed before the cache, written plainly: count
    line by line (ties by first occurrence), then encode line by line."""
    itos, counts = plain_build(lines["train"], max_size)
    stoi = {t: i for i, t in enumerate(itos)}
    ids = {
        split: np.array([stoi.get(w, stoi[UNK]) for line in text for w in [*line.split(), EOS]])
        for split, text in lines.items()
    }
    return itos, counts, ids


def test_ptb_vocabulary_and_ids_are_those_of_the_old_algorithm(ptb_data, ptb_path):
    # the lines as the old code read them: HuggingFace's text builder (which reads .xz itself)
    files = {split: f"{ptb_path}/ptb.{split}.txt.xz" for split in ("train", "valid", "test")}
    lines = {s: d["text"] for s, d in load_dataset("text", data_files=files).items()}
    itos, counts, ids = old_word_pipeline(lines)
    assert ptb_data.vocab.itos == itos and ptb_data.vocab.counts == counts
    for split, expected in ids.items():
        tokens = ptb_data.split_tokens(split)
        assert tokens.dtype == torch.int32 and np.array_equal(tokens.numpy(), expected)


def test_ptb_bpe_vocabulary_and_ids_are_those_of_the_old_algorithm(ptb_bpe, ptb_text):
    lines = {s: ptb_text[s].split("\n")[:-1] for s in PTB_WORDS}
    old = plain_bpe(lines["train"], 2000)  # trained on lines, every line encoded twice
    assert ptb_bpe.vocab == old and ptb_bpe.vocab.counts == old.counts
    for split, text in lines.items():  # encoded once, in joined pieces
        expected = [i for line in text for i in old.encode_line(line)]
        assert ptb_bpe.split_tokens(split).tolist() == expected


@pytest.mark.parametrize("max_size", [None, 30_000])
def test_scaled_down_wikitext_cache_is_used_and_correct(wikitext_like, tmp_path, caplog,
                                                        max_size):  # fmt: skip
    """CI's version of the WikiText-103 target: 2M tokens, 50k types. The first run prepares,
    the second reads the cache; both give the plain algorithm's vocabulary and ids."""
    caplog.set_level(logging.INFO, logger="datamodules")
    options = dict(path=wikitext_like, max_vocab_size=max_size, cache_dir=str(tmp_path))
    first = LanguageModelingDataModule(**options)
    first.prepare_data()
    lines = {s: open(f"{wikitext_like}/wiki.{s}.tokens").read().split("\n")[:-1]
             for s in ("train", "valid", "test")}  # fmt: skip
    itos, counts, ids = old_word_pipeline(lines, max_size)
    assert first.vocab.itos == itos and first.vocab.counts == counts
    assert len(itos) == (max_size or 47_984)  # of 50k types, 48k occur in 2M draws
    misses = [r for r in caplog.records if "cache miss" in r.getMessage()]
    assert len(misses) == 4  # the vocabulary and three token files
    caplog.clear()
    second = LanguageModelingDataModule(**options)
    second.setup("fit")
    second.setup("test")
    assert second.vocab == first.vocab
    for split, expected in ids.items():
        assert np.array_equal(first.split_tokens(split).numpy(), expected)
        assert np.array_equal(second.split_tokens(split).numpy(), expected)
    messages = [r.getMessage() for r in caplog.records if "became <unk>" not in r.getMessage()]
    sizes = [m for m in messages if m.startswith("vocabulary")]
    assert sizes == [f"vocabulary (word): {len(itos):,} ids"]  # what the head is built for
    messages = [m for m in messages if m not in sizes]
    assert len(messages) == 4 and all("data cache hit" in m for m in messages)


def test_hub_datasets_give_the_same_ids_as_files(tmp_path, monkeypatch):
    """A hub name (no network here: load_dataset is replaced): rows may hold line breaks."""
    rows = ["a b c", "b c \n", "", " c a", "d"]
    hub = DatasetDict({name: Dataset.from_dict({"line": rows, "other": [0] * len(rows)})
                       for name in ("train", "validation", "test")})  # fmt: skip
    monkeypatch.setattr(text_source, "load_dataset", lambda hub_name, name, revision: hub)
    data = LanguageModelingDataModule(hub="someone/corpus", text_column="line",
                                      cache_dir=str(tmp_path))  # fmt: skip
    itos, _, ids = old_word_pipeline({"train": rows, "test": rows})
    assert data.vocab.itos == itos
    assert data.split_tokens("test").tolist() == ids["test"].tolist()
    with pytest.raises(DataPathError, match="no column 'text'"):
        _ = LanguageModelingDataModule(hub="someone/corpus", cache_dir=str(tmp_path)).vocab


def test_str_and_repr_read_nothing(tmp_path):
    """The CLI formats the data module while linking arguments (and Lightning's own __str__
    would build every loader): ours names the options only."""
    data = LanguageModelingDataModule(path=str(tmp_path / "not yet there"), vocab="bpe")
    assert (
        str(data)
        == repr(data)
        == (f"LanguageModelingDataModule(path='{tmp_path}/not yet there', vocab='bpe')")
    )


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_lightrnn_ranks_encode_only_their_share(ptb_lightrnn, world_size, monkeypatch):
    monkeypatch.setattr(hybrid_module, "_CHUNK", 10_000)  # many chunks: cross their seams
    full = ptb_lightrnn.vocab.encode_word_ids(ptb_lightrnn.split_word_ids("valid"))
    assert ptb_lightrnn.num_tokens("valid") == len(full)
    shares = [ptb_lightrnn.rank_streams("valid", 8, rank, world_size) for rank in range(world_size)]
    stream_len = len(full) // 8
    assert torch.equal(torch.cat(shares), full[: 8 * stream_len].view(8, stream_len))


@pytest.mark.parametrize("world_size", [3, 4, 8])
def test_evaluation_streams_are_shared_by_ranks_that_do_not_divide_them(ptb_data, world_size):
    # WikiText-103's eval_batch_size 10 under the DDP preset on 4 or 8 GPUs was refused at the
    # first validation: now the first ranks take a stream more, and the ranks' loaders
    # together walk exactly the one-process windows (the same count on every rank)
    streams = 10
    single = list(BPTTBatches(ptb_data.split_tokens("valid"), streams, 35))
    ranks = []
    for rank in range(world_size):
        ptb_data.trainer = SimpleNamespace(global_rank=rank, world_size=world_size)
        ranks.append(list(ptb_data.val_dataloader()))
    ptb_data.trainer = None
    assert [len(batches) for batches in ranks] == [len(single)] * world_size
    sizes = [batches[0][0].size(0) for batches in ranks]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    for step, (inputs, targets) in enumerate(single):
        assert torch.equal(torch.cat([batches[step][0] for batches in ranks]), inputs)
        assert torch.equal(torch.cat([batches[step][1] for batches in ranks]), targets)
    # training keeps equal shares (DDP averages the ranks' gradients with equal weights)
    with pytest.raises(ValueError, match="divisible by the number of processes"):
        ptb_data.rank_streams("train", streams, 0, world_size)


def test_pickling_maps_the_token_files_again_instead_of_copying_them(ptb_data):
    """ddp_spawn and spawned loader workers pickle the data module: 930k tokens would be
    3.7 MB of int32; the vocabulary alone is what travels."""
    ptb_data.setup("fit")
    blob = pickle.dumps(ptb_data)
    assert len(blob) < 1_000_000
    again = pickle.loads(blob)
    assert torch.equal(again.split_tokens("train"), ptb_data.split_tokens("train"))


def test_a_hub_dataset_gives_the_ids_of_the_same_text_in_local_files(tmp_path):
    """WikiText in the hub's layout (parquet per configuration and split, README header), read
    by name through ``datasets.load_dataset`` as from the hub, against the same rows written
    as local ``wiki.*.tokens`` files."""
    rows = {
        "train": WIKI_ROWS * 3 + [" a new article = \n"],
        "validation": WIKI_ROWS,
        "test": [" = game = \n", " the game .\n"],
    }
    hub = write_hub_layout(tmp_path / "wikitext", {"wikitext-2-v1": rows})
    local = tmp_path / "local"
    local.mkdir()
    for split, name in (("train", "train"), ("validation", "valid"), ("test", "test")):
        (local / f"wiki.{name}.tokens").write_text(
            "".join(r.rstrip("\n") + "\n" for r in rows[split])
        )
    by_name = LanguageModelingDataModule(hub=hub, name="wikitext-2-v1", cache_dir=str(tmp_path))
    from_files = LanguageModelingDataModule(path=str(local), cache_dir=str(tmp_path))
    assert by_name.vocab.itos == from_files.vocab.itos and UNK in by_name.vocab.itos
    for split in ("train", "valid", "test"):
        assert by_name.split_tokens(split).tolist() == from_files.split_tokens(split).tolist()
    assert "hub=" in repr(by_name) and "wikitext-2-v1" in repr(by_name)


# -- tokens that became <unk> (issue 33) -------------------------------------------------------
# train: 10 lines of 7 words + <eos>; max_vocab_size 5 keeps <eos>, <unk>, a, b, c: the 5 d's
# are dropped, the 10 written <unk> are not counted. valid: x and y are unknown (2 of 6 tokens
# a line, 5 lines); test: z in 2 of its 4 lines of 4 tokens.
UNK_CORPUS = {
    "train": "a a a b b <unk> c\na a a b b <unk> d\n" * 5,
    "valid": "a x b <unk> y\n" * 5,
    "test": "a b c\n" * 2 + "a z c\n" * 2,
}


def unk_corpus(folder):
    folder.mkdir(exist_ok=True)
    for split, text in UNK_CORPUS.items():
        (folder / f"c.{split}.txt").write_text(text)
    return str(folder)


def unknown_lines(caplog):
    return {r.getMessage().split(":")[0 if r.levelno == logging.INFO else 1].strip(): r
            for r in caplog.records if "became <unk>" in r.getMessage()}  # fmt: skip


@pytest.mark.parametrize("vocab", ["word", "hybrid_lightrnn"])
def test_unknown_words_are_counted_per_split_and_read_back_on_a_cache_hit(tmp_path, caplog,
                                                                         vocab):  # fmt: skip
    caplog.set_level(logging.INFO, logger="datamodules")
    options = dict(path=unk_corpus(tmp_path / "text"), cache_dir=str(tmp_path / "cache"),
                   max_vocab_size=5, vocab=vocab, lightrnn_frequent=4)  # fmt: skip
    expected = {"train": (5, 80), "valid": (10, 30), "test": (2, 16)}
    for run in ("prepared", "cache hit"):
        caplog.clear()
        data = LanguageModelingDataModule(**options)
        data.prepare_data()  # no trainer: every split
        assert data.unknown_tokens == expected, run
        hits = [r for r in caplog.records if "data cache hit" in r.getMessage()]
        assert len(hits) == (4 if run == "cache hit" else 0)
        lines = unknown_lines(caplog)
        assert set(lines) == {"train", "valid", "test"}
        train, valid, test = (lines[s].getMessage() for s in ("train", "valid", "test"))
        assert "train: 5 of 80 tokens (6.25%) became <unk> (words beyond " \
               "data.max_vocab_size=5;" in train  # fmt: skip
        assert "valid: 10 of 30 tokens (33.33%) became <unk> (words not in the training " \
               "vocabulary;" in valid  # fmt: skip
        assert "test: 2 of 16 tokens (12.50%)" in test
        assert all(r.levelno == logging.WARNING for r in lines.values())
        assert "over 1%, raise data.max_vocab_size" in train
    with (tmp_path / "text" / "c.valid.txt").open("w") as handle:  # under 1%: no warning
        handle.write("a b c\n" * 300 + "a q\n")
    caplog.clear()
    data = LanguageModelingDataModule(**options)
    data.setup("validate")
    assert data.unknown_tokens == {"valid": (1, 1203)}
    assert unknown_lines(caplog)["valid"].levelno == logging.INFO


def test_evaluation_unknowns_under_a_vocabulary_cap_advise_raising_it(tmp_path, caplog):
    # a WikiText-103-like corpus cut to 100,000 words: 3.9% of valid became <unk>, nearly all
    # words the cap dropped, and the warning only said to check the splits' tokenisation
    caplog.set_level(logging.INFO, logger="datamodules")
    path, cache = unk_corpus(tmp_path / "text"), str(tmp_path / "cache")
    for cap, advice in ((5, "over 1%, raise data.max_vocab_size (the vocabulary is cut to 5), "
                            "or check that the splits are tokenised alike"),
                        (None, "over 1%, check that the splits are tokenised alike")):  # fmt: skip
        caplog.clear()
        LanguageModelingDataModule(path=path, cache_dir=cache, max_vocab_size=cap).setup("validate")
        assert (
            unknown_lines(caplog)["valid"]
            .getMessage()
            .endswith(advice + " (case, punctuation, numbers)")
        )


def test_bpe_counts_unseen_characters_only(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="datamodules")
    data = LanguageModelingDataModule(
        path=unk_corpus(tmp_path / "text"), vocab="bpe", bpe_vocab_size=12,
        cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    data.prepare_data()
    # train: every character seen, its written <unk> not counted; valid: x and y unseen
    assert data.unknown_tokens["train"][0] == 0
    assert data.unknown_tokens["valid"][0] == 10
    assert data.unknown_tokens["test"][0] == 2
    said = [r.getMessage() for r in caplog.records if "valid: 10 of" in r.getMessage()]
    assert len(said) == 1 and "became <unk_char> (characters the BPE never saw" in said[0]
    tokens = {split: data.num_tokens(split) for split in UNK_CORPUS}
    assert {s: n for s, (_, n) in data.unknown_tokens.items()} == tokens


def test_an_older_cache_entry_without_counts_is_encoded_again(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="datamodules")
    options = dict(path=unk_corpus(tmp_path / "text"), cache_dir=str(tmp_path / "cache"))
    data = LanguageModelingDataModule(**options)
    data.setup("validate")
    meta = data.cache.read_json("valid.json")
    del meta["unknown"]
    data.cache.write_json("valid.json", meta)
    caplog.clear()
    again = LanguageModelingDataModule(**options)
    again.setup("validate")
    assert again.unknown_tokens == {"valid": (10, 30)}
    assert any("cache miss: preparing valid" in r.getMessage() for r in caplog.records)


# -- data.min_freq: words seen fewer times in training become <unk> -----------------------------
def zipf_corpus(folder, seed: int = 0) -> dict[str, list[str]]:
    """A long-tailed corpus (Zipf-distributed types, many seen once or twice), written as
    files; returns its lines."""
    rng = np.random.default_rng(seed)
    folder.mkdir(exist_ok=True)
    lines = {}
    for split, count in (("train", 2000), ("valid", 200), ("test", 200)):
        draws = np.minimum(rng.zipf(1.3, size=(count, 8)), 5000)
        lines[split] = [" ".join(f"w{n}" for n in row) for row in draws]
        (folder / f"z.{split}.txt").write_text("".join(line + "\n" for line in lines[split]))
    return lines


@pytest.mark.parametrize("vocab", ["word", "hybrid_lightrnn"])
@pytest.mark.parametrize(("min_freq", "cap"), [(3, None), (3, 60), (1, 60), (2, None)])
def test_min_freq_vocabulary_ids_and_unknowns_are_plain_counts(tmp_path, vocab, min_freq, cap):
    lines = zipf_corpus(tmp_path / "text")
    data = LanguageModelingDataModule(
        path=str(tmp_path / "text"), cache_dir=str(tmp_path / "cache"), vocab=vocab,
        min_freq=min_freq, max_vocab_size=cap, lightrnn_frequent=10,
    )  # fmt: skip
    data.prepare_data()
    words = data.vocab.base  # (Hybrid-LightRNN: the words the table codes)
    itos, counts = plain_min_freq(lines["train"], cap, min_freq)
    assert (words.itos, words.counts) == (itos, counts)
    assert len(itos) < len({w for line in lines["train"] for w in line.split()})  # cut
    stoi = {t: i for i, t in enumerate(itos)}
    for split, text in lines.items():
        tokens = [w for line in text for w in [*line.split(), EOS]]
        expected = [stoi.get(w, stoi[UNK]) for w in tokens]
        assert data.split_word_ids(split).tolist() == expected
        assert data.unknown_tokens[split] == (sum(w not in stoi for w in tokens), len(tokens))


def test_min_freq_is_said_and_advised_and_keys_its_own_cache_entry(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="datamodules")
    path, cache = unk_corpus(tmp_path / "text"), str(tmp_path / "cache")
    # train counts: a 30, b 20, <unk> 10 (written), <eos> 10, c 5, d 5
    default = LanguageModelingDataModule(path=path, cache_dir=cache)
    data = LanguageModelingDataModule(path=path, cache_dir=cache, min_freq=6)
    data.prepare_data()
    assert data.vocab.itos == ["a", "b", UNK, EOS]  # c and d: <unk> (10 written + 10)
    assert data.unknown_tokens == {"train": (10, 80), "valid": (10, 30), "test": (6, 16)}
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("vocabulary")]
    assert said == [
        "vocabulary (word): 4 ids (data.min_freq=6: words seen under 6 times in training are <unk>)"
    ]
    lines = {split: record.getMessage() for split, record in unknown_lines(caplog).items()}
    assert "became <unk> (words seen fewer than data.min_freq=6 times;" in lines["train"]
    assert lines["train"].endswith("over 1%, lower data.min_freq")
    assert "over 1%, lower data.min_freq (words seen fewer than 6 times in training), or " \
           "check that the splits are tokenised alike" in lines["valid"]  # fmt: skip
    # both limits: the cap (a only) drops b too, and raising it alone stops at min_freq
    caplog.clear()
    both = LanguageModelingDataModule(path=path, cache_dir=cache, min_freq=6, max_vocab_size=3)
    both.setup("fit")
    assert both.vocab.itos == [UNK, "a", EOS] and both.unknown_tokens["train"] == (30, 80)
    lines = {split: record.getMessage() for split, record in unknown_lines(caplog).items()}
    assert "(words beyond data.max_vocab_size=3 or words seen fewer than data.min_freq=6 " \
           "times;" in lines["train"]  # fmt: skip
    assert lines["train"].endswith("raise data.max_vocab_size and lower data.min_freq")
    # each its own cache entry; the default's key is the one made before the option existed
    # (its material has no min_freq), so its cache is still found
    entries = {default.cache.path, data.cache.path, both.cache.path}
    assert len(entries) == 3 and data.cache.material["vocab"]["min_freq"] == 6
    old_material = {"task": "lm", "train": default._identity_of("train"),
                    "vocab": {"type": "word", "max_size": None}}  # fmt: skip
    old = CacheEntry(cache_root(cache), f"{default.source.label}-word", old_material)
    assert default.cache.path == old.path
    explicit = LanguageModelingDataModule(path=path, cache_dir=cache, min_freq=1)
    assert explicit.cache.path == default.cache.path


def test_a_min_freq_that_leaves_no_word_is_one_clear_error(tmp_path):
    data = LanguageModelingDataModule(path=unk_corpus(tmp_path / "text"), min_freq=31,
                                      cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(DataConfigError, match=r"data.vocab=word \(data.max_vocab_size, "
                       r"data.min_freq\): min_freq=31 leaves no word: the most frequent is seen "
                       r"30 times"):  # fmt: skip
        _ = data.vocab_size
