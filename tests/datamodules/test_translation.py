import logging
from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch
from datasets import Dataset, DatasetDict

import datamodules.text_source as text_source
from datamodules import TranslationDataModule
from datamodules.errors import DataConfigError, DataPathError, VocabularyMismatchError
from datamodules.translation import ParallelDataError
from datamodules.vocab import EOS, UNK, WordVocab
from tests.conftest import MULTI30K
from tests.datamodules.vocab.test_word import plain_build, plain_min_freq


@pytest.fixture(scope="module")
def multi30k():
    return TranslationDataModule(path=str(MULTI30K), max_vocab_size=6000, max_tokens=1024)


def write_corpus(folder, pairs: dict[str, list[tuple[str, str]]]) -> str:
    for prefix, lines in pairs.items():
        (folder / f"{prefix}.de").write_text("".join(s + "\n" for s, _ in lines))
        (folder / f"{prefix}.en").write_text("".join(t + "\n" for _, t in lines))
    return str(folder)


TINY = [("ein Hund", "a dog"), ("eine Katze", "a cat"), ("zwei Hunde .", "two dogs .")] * 4


def tiny(tmp_path, **kwargs) -> TranslationDataModule:
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY[:3], "test_2016_flickr": TINY[:2]})
    return TranslationDataModule(path=path, **kwargs)


def test_multi30k_pairs_and_vocabularies(multi30k):
    assert [len(multi30k.splits[s]) for s in ("train", "valid", "test")] == [29_000, 1_014, 1_000]
    first = multi30k.splits["train"][0]
    assert first["target"] == "Two young, White males are outside near many bushes."
    assert first["source"].startswith("Zwei junge weiße Männer")
    assert multi30k.vocab_size == multi30k.src_vocab_size == 6000
    for vocab in multi30k.vocabs:
        assert vocab.counts == sorted(vocab.counts, reverse=True)  # Mixtape's gate sharing
        assert {EOS, UNK} <= set(vocab.itos)
    assert multi30k.bos_id == multi30k.target_vocab.eos_id
    # whitespace word tokens: joining them restores the raw text (sacreBLEU's input)
    ids = multi30k.target_vocab.encode_line(first["target"], add_eos=False)
    assert multi30k.detokenize(ids) == first["target"]


def test_token_counts_are_the_training_target_ids(tmp_path):
    data = tiny(tmp_path)
    data.setup("fit")
    vocab = data.target_vocab
    plain = Counter(i for _, t in TINY for i in vocab.encode_line(t))  # with <eos>
    counts = data.token_counts
    assert counts.shape == (data.vocab_size,)
    assert {i: int(n) for i, n in enumerate(counts) if n} == dict(plain)


def test_training_batches_cover_every_pair_once_within_the_token_budget(multi30k):
    loader = multi30k.train_dataloader()
    seen = []
    raw = multi30k.splits["train"][:]
    for n, batch in enumerate(loader):
        src, pad = batch["source"], batch["source_padding"]
        tin, tout = batch["target_input"], batch["target_output"]
        assert src.numel() <= 1024 and tout.numel() <= 1024
        # padding mask = source lengths; targets: -100 exactly at padding, <eos> last
        src_len, tgt_len = (~pad).sum(1), (tout != -100).sum(1)
        assert torch.equal(pad, torch.arange(src.size(1)) >= src_len[:, None])
        assert (src_len.max(), tgt_len.max()) == (src.size(1), tout.size(1))
        assert bool((tout.gather(1, tgt_len[:, None] - 1) == multi30k.target_vocab.eos_id).all())
        # teacher forcing: decoder input = BOS + target shifted right
        assert bool((tin[:, 0] == multi30k.bos_id).all())
        real = tout[:, :-1] != -100
        assert torch.equal(tin[:, 1:][real], tout[:, :-1][real])
        if n < 3:
            for row, index in enumerate(batch["index"].tolist()):
                words = raw["source"][index].split()
                decoded = multi30k.source_vocab.decode(src[row, : len(words)].tolist())
                assert [w if w in multi30k.source_vocab.stoi else UNK for w in words] == decoded
        seen += batch["index"].tolist()
    assert sorted(seen) == list(range(29_000))
    # similar lengths are batched together: little padding
    assert len(loader) < 29_000 * 14 / 1024 * 1.3


def test_training_order_changes_each_epoch_evaluation_order_does_not(multi30k):
    sampler = multi30k.train_dataloader().batch_sampler
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first
    valid = [b["index"].tolist() for b in multi30k.val_dataloader()]
    assert valid == [b["index"].tolist() for b in multi30k.val_dataloader()]
    assert sorted(i for b in valid for i in b) == list(range(1_014))


def test_lightning_sets_the_epoch_of_the_training_order(tmp_path):
    """Through a real Trainer: each epoch sees every pair once, in another order."""
    seen = _recorded_epochs(tiny(tmp_path, max_tokens=8), max_epochs=3)
    assert [sorted(epoch) for epoch in seen] == [list(range(len(TINY)))] * 3
    assert len({tuple(epoch) for epoch in seen}) == 3


def _recorded_epochs(data, **trainer_options) -> list[list[int]]:
    """The pair indices each epoch of a real Trainer's fit trains on, in order."""
    seen: list[list[int]] = []

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))

        def on_train_epoch_start(self) -> None:
            seen.append([])

        def training_step(self, batch, batch_idx):
            seen[-1].extend(batch["index"].tolist())
            return self.weight * 0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, **trainer_options)  # fmt: skip
    trainer.fit(Recorder(), datamodule=data)
    return seen


def test_overfit_batches_trains_the_same_batches_every_epoch(tmp_path):
    """Lightning turns shuffling off for ``overfit_batches`` only in a loader's sampler; the
    token buckets shuffle in the batch sampler, so the module keeps epoch 0's order itself."""
    seen = _recorded_epochs(tiny(tmp_path, max_tokens=8), max_epochs=3, overfit_batches=2)
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
    assert 2 <= len(seen[0]) < len(TINY)
    # epoch 0's shuffled buckets, not the shortest pairs that an unshuffled order starts with
    first = tiny(tmp_path, max_tokens=8).train_dataloader().batch_sampler
    assert seen[0] == [i for batch in list(first)[:2] for i in batch]


def test_misaligned_parallel_files_are_refused(tmp_path):
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY, "test_2016_flickr": TINY})
    (tmp_path / "val.en").write_text("one line too few\n" * (len(TINY) - 1))
    with pytest.raises(ParallelDataError, match=r"misaligned parallel valid files: .*val.de' has "
                       r"12 lines but .*val.en' has 11"):  # fmt: skip
        _ = TranslationDataModule(path=path).vocab_size


def test_missing_files_are_reported(tmp_path):
    with pytest.raises(DataPathError, match="does not exist"):
        _ = TranslationDataModule(path=str(tmp_path / "nope")).vocab_size
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY})
    with pytest.raises(DataPathError, match="test file .*test_2016_flickr.de' does not exist"):
        _ = TranslationDataModule(path=path).vocab_size


def test_training_pairs_only_with_held_out_splits(tmp_path):
    """Training files alone: the missing splits are the last pairs of them, aligned, and the
    vocabularies are counted on the pairs before; misaligned training files are refused here,
    before any pair is cut."""
    pairs = [(f"de{i % 3}", f"en{i % 4}") for i in range(36)] + [("neu", "new")] * 4
    path = write_corpus(tmp_path, {"train": pairs})
    with pytest.raises(DataPathError, match="val.de' does not exist.*--data.held_out 0.05"):
        _ = TranslationDataModule(path=path).vocab_size
    data = TranslationDataModule(path=path, held_out=0.05, cache_dir=str(tmp_path / "c"))
    data.setup("fit")
    data.setup("test")
    assert "neu" not in data.source_vocab.itos and "new" not in data.target_vocab.itos
    assert [len(data.splits[s]) for s in ("train", "valid", "test")] == [36, 2, 2]
    assert data.splits["test"][1] == {"source": "neu", "target": "new"}
    assert data.splits["train"][35] == {"source": "de2", "target": "en3"}
    (tmp_path / "train.en").write_text("one line\n" * 39)
    with pytest.raises(ParallelDataError, match="misaligned parallel train files"):
        _ = TranslationDataModule(path=path, held_out=0.05, cache_dir=str(tmp_path / "d")).source


def test_empty_lines_policy(tmp_path):
    """Empty training pairs are dropped; evaluation keeps every line (aligned output)."""
    with_empty = TINY + [("", "nothing"), ("nichts", "")]
    path = write_corpus(
        tmp_path, {"train": with_empty, "val": with_empty, "test_2016_flickr": TINY}
    )
    data = TranslationDataModule(path=path)
    assert len(data.encoded("train")) == len(TINY)
    valid = data.encoded("valid")
    assert len(valid) == len(with_empty)
    assert valid[len(TINY)]["source_ids"].tolist() == [data.source_vocab.eos_id]
    assert data.references("valid")[-1] == ""


def test_training_pairs_over_max_length_are_dropped_and_said(tmp_path, caplog):
    """A pair longer than data.max_length on either side is left out of training, and the
    run says how many (a corpus of long sentences must not shrink silently)."""
    long = ("ein " * 9 + "Hund", "a dog")  # 11 source tokens with <eos>
    pairs = TINY + [long, ("ein Hund", "a " * 9 + "dog"), ("", "a " * 20)]
    path = write_corpus(tmp_path, {"train": pairs, "val": pairs, "test_2016_flickr": TINY})
    data = TranslationDataModule(path=path, max_length=10)
    with caplog.at_level(logging.WARNING, logger="datamodules.translation"):
        assert len(data.encoded("train")) == len(TINY)
    assert "dropped 2 training pairs longer than data.max_length=10 tokens" in caplog.text
    assert "dropped 1 training pairs with an empty side" in caplog.text
    assert len(data.encoded("valid")) == len(pairs)  # evaluation keeps every line


def test_joint_vocabulary_and_checkpoint_state(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="datamodules")
    data = tiny(tmp_path, joint_vocab=True)
    assert data.source_vocab is data.target_vocab
    # ein Hund eine Katze zwei Hunde . + a dog cat two dogs (. shared) + <eos> + <unk>
    assert data.vocab_size == data.src_vocab_size == 14
    assert "vocabularies (word): joint 14 ids" in caplog.text  # what the model is built for
    caplog.clear()
    (tmp_path / "apart").mkdir()
    assert tiny(tmp_path / "apart").vocab_size == 8  # a dog cat two dogs . <eos> <unk>
    assert "vocabularies (word): source 9, target 8 ids" in caplog.text
    state = data.state_dict()
    tiny(tmp_path, joint_vocab=True).load_state_dict(state)  # same data: accepted
    with pytest.raises(VocabularyMismatchError, match="another source vocabulary"):
        tiny(tmp_path, joint_vocab=False).load_state_dict(state)
    state["target_vocab"] = WordVocab.build(["x y"]).state_dict()
    with pytest.raises(VocabularyMismatchError, match="another target vocabulary"):
        data.load_state_dict(state)


def test_bpe_vocabularies(tmp_path):
    data = tiny(tmp_path, vocab="bpe", bpe_vocab_size=30, joint_vocab=True)
    vocab = data.target_vocab
    assert type(vocab).__name__ == "BPEVocab" and data.vocab_size == len(vocab) <= 30
    assert vocab.counts == sorted(vocab.counts, reverse=True)
    ids = vocab.encode_line("two dogs .", add_eos=False)
    assert data.detokenize(ids) == "two dogs ."
    tiny(tmp_path, vocab="bpe", bpe_vocab_size=30, joint_vocab=True).load_state_dict(
        data.state_dict()
    )
    with pytest.raises(VocabularyMismatchError, match="WordVocab"):
        tiny(tmp_path, joint_vocab=True).load_state_dict(data.state_dict())


def test_hybrid_lightrnn_codes_the_target_side(tmp_path):
    words = tiny(tmp_path)
    data = tiny(tmp_path, vocab="hybrid_lightrnn", lightrnn_frequent=3)
    codes = data.target_vocab
    assert type(codes).__name__ == "HybridLightRNNVocab" and codes.words == words.target_vocab
    assert data.source_vocab == words.source_vocab  # the source side stays words
    assert data.vocab_size == len(codes) == 3 + codes.rows + codes.cols
    assert data.bos_id == codes.eos_id == words.bos_id  # <eos>: a frequent word's own code
    pairs = data.encoded("train")
    rare = 0
    for i, (source, target) in enumerate(TINY):
        assert pairs[i]["source_ids"].tolist() == words.source_vocab.encode_line(source)
        assert pairs[i]["target_ids"].tolist() == codes.encode_line(target)
        assert data.detokenize(pairs[i]["target_ids"].tolist()[:-1]) == target
        rare += len(codes.encode_line(target)) - len(target.split()) - 1
    assert rare > 0  # some words are written as two codes
    assert data.token_counts.tolist() == codes.class_counts().tolist()
    # a checkpoint's codes: the same accepted, others refused
    tiny(tmp_path, vocab="hybrid_lightrnn", lightrnn_frequent=3).load_state_dict(data.state_dict())
    with pytest.raises(VocabularyMismatchError, match="another target vocabulary"):
        tiny(tmp_path, vocab="hybrid_lightrnn", lightrnn_frequent=4).load_state_dict(
            data.state_dict()
        )
    with pytest.raises(DataConfigError, match="hybrid_lightrnn codes the target side only"):
        TranslationDataModule(vocab="hybrid_lightrnn", joint_vocab=True)


def test_option_errors(tmp_path):
    with pytest.raises(DataConfigError, match="data.max_tokens must be a positive integer"):
        TranslationDataModule(max_tokens=0)
    with pytest.raises(DataConfigError, match="data.vocab must be 'word', 'bpe' or 'hybrid_"):
        TranslationDataModule(vocab="chars")
    with pytest.raises(DataConfigError, match=r"data.max_tokens \(2\) must hold the longest"):
        tiny(tmp_path, max_tokens=2).train_dataloader()
    with pytest.raises(DataConfigError, match="predict needs sentences"):
        tiny(tmp_path).predict_dataloader()


def test_an_evaluation_pair_longer_than_the_token_budget_is_a_batch_of_its_own(tmp_path):
    """Evaluation keeps every line: a test pair over ``eval_max_tokens`` (a long sentence of
    one's own corpus) is batched alone, where it stopped ``test`` mid-way; training still
    refuses a budget below its longest pair."""
    long = (" ".join(["ein Hund"] * 20), " ".join(["a dog"] * 20))  # 41 tokens with <eos>
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY[:3],
                                   "test_2016_flickr": [*TINY[:5], long]})  # fmt: skip
    data = TranslationDataModule(path=path, max_tokens=16, cache_dir=str(tmp_path / "c"))
    data.setup("test")
    batches = list(data.test_dataloader())
    assert sorted(int(i) for b in batches for i in b["index"]) == list(range(6))
    (alone,) = [b for b in batches if 5 in b["index"].tolist()]
    assert alone["source"].shape == (1, 41)
    assert all(b["source"].numel() <= 16 for b in batches if b is not alone)
    data = TranslationDataModule(path=path, max_tokens=3, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataConfigError, match=r"data.max_tokens \(3\) must hold the longest"):
        data.train_dataloader()


@pytest.mark.parametrize("layout", ["columns", "translation"])
def test_hub_datasets_give_the_same_columns(monkeypatch, layout):
    """A hub name (no network here: load_dataset is replaced) with one column per language or
    a WMT-style ``translation`` column gives the same source/target splits."""

    def rows(pairs):
        if layout == "columns":
            return {"de": [s for s, _ in pairs], "en": [t for _, t in pairs]}
        return {"translation": [{"de": s, "en": t} for s, t in pairs]}

    hub = DatasetDict(
        {name: Dataset.from_dict(rows(TINY)) for name in ("train", "validation", "test")}
    )
    monkeypatch.setattr(text_source, "load_dataset", lambda hub_name, name, revision: hub)
    data = TranslationDataModule(hub="someone/multi30k")
    assert data.splits["valid"][0] == {"source": TINY[0][0], "target": TINY[0][1]}
    assert data.references("test") == [t for _, t in TINY]
    with pytest.raises(DataPathError, match="has no split"):
        _ = TranslationDataModule(hub="someone/multi30k", hub_splits={"train": "x"}).splits


def cache_lines(caplog, kind: str) -> int:
    return sum(f"data cache {kind}" in r.getMessage() for r in caplog.records)


def test_a_hub_translation_column_is_read_from_the_cache_the_second_time(
    monkeypatch, tmp_path, caplog
):
    """A WMT-style ``translation`` column: each part's identity names it as a pair, which its
    cache entry's JSON gives back as a list; the second run reads every part back."""
    caplog.set_level(logging.INFO, logger="datamodules")
    rows = {"translation": [{"de": s, "en": t} for s, t in TINY]}
    hub = DatasetDict({name: Dataset.from_dict(rows) for name in ("train", "validation", "test")})
    monkeypatch.setattr(text_source, "load_dataset", lambda hub_name, name, revision: hub)
    for _ in range(2):
        caplog.clear()
        TranslationDataModule(hub="someone/wmt", cache_dir=str(tmp_path / "c")).prepare_data()
    assert cache_lines(caplog, "miss") == 0 and cache_lines(caplog, "hit") == 7


@pytest.mark.parametrize("vocab", ["word", "bpe"])
def test_prepared_ids_are_cached_and_equal_line_by_line_encoding(tmp_path, caplog, vocab):
    caplog.set_level(logging.INFO, logger="datamodules")
    odd = TINY + [("ein <eos> Hund", "a dog"), ("", "x")]  # a literal <eos>; an empty side
    path = write_corpus(tmp_path, {"train": odd, "val": odd, "test_2016_flickr": TINY})
    options = dict(path=path, vocab=vocab, bpe_vocab_size=30, cache_dir=str(tmp_path / "c"))
    first = TranslationDataModule(**options)
    first.prepare_data()
    # the vocabularies, then 6 token files (BPE writes the training ones with its vocabulary)
    assert cache_lines(caplog, "miss") == (7 if vocab == "word" else 5)
    caplog.clear()
    second = TranslationDataModule(**options)
    second.setup("fit")
    second.setup("test")
    assert cache_lines(caplog, "hit") == 7 and cache_lines(caplog, "miss") == 0
    for data in (first, second):
        valid = data.encoded("valid")
        for i, (source, target) in enumerate(odd):
            assert valid[i]["source_ids"].tolist() == data.source_vocab.encode_line(source)
            assert valid[i]["target_ids"].tolist() == data.target_vocab.encode_line(target)
        assert data.encoded("train").index.tolist() == list(range(len(TINY) + 1))


def test_misaligned_training_files_are_refused_when_read(tmp_path):
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY, "test_2016_flickr": TINY})
    (tmp_path / "train.en").write_text("one line too few\n" * (len(TINY) - 1))
    with pytest.raises(ParallelDataError, match=r"misaligned parallel train files: .*train.de' "
                       r"has 12 lines but .*train.en' has 11"):  # fmt: skip
        _ = TranslationDataModule(path=path, cache_dir=str(tmp_path / "c")).vocab_size


def test_str_reads_nothing(tmp_path):
    data = TranslationDataModule(path=str(tmp_path / "absent"))
    assert str(data) == f"TranslationDataModule(path='{tmp_path}/absent', de->en, vocab='word')"


@pytest.mark.parametrize("key", ["valid", "validation", "val", "dev"])
def test_files_keys_take_every_spelling_of_the_validation_split(tmp_path, key):
    path = write_corpus(tmp_path, {"train": TINY, "heldout": TINY[:3], "final": TINY[:2]})
    data = TranslationDataModule(path=path, files={key: "heldout", "test": "final"})
    assert data.source.describe("valid.source").endswith("heldout.de")


def test_an_unknown_files_key_is_refused(tmp_path):
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY[:3], "test_2016_flickr": TINY[:2]})
    with pytest.raises(DataConfigError, match="unknown split 'eval'; use train, valid"):
        _ = TranslationDataModule(path=path, files={"eval": "val"}).vocab_size


# -- data.min_freq: words seen fewer times on their training side become <unk> ----------------
def zipf_pairs(count: int, seed: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    draws = np.minimum(rng.zipf(1.4, size=(count, 2, 6)), 3000)
    return [(" ".join(f"s{n}" for n in s), " ".join(f"t{n}" for n in t)) for s, t in draws]


@pytest.mark.parametrize(
    ("vocab", "joint", "min_freq", "cap"),
    [("word", False, 3, None), ("word", True, 3, None), ("word", False, 2, 40),
     ("hybrid_lightrnn", False, 3, None)],
)  # fmt: skip
def test_min_freq_vocabularies_per_side_and_joint_are_plain_counts(
    tmp_path, caplog, vocab, joint, min_freq, cap
):
    caplog.set_level(logging.INFO, logger="datamodules")
    train, valid = zipf_pairs(600, 1), zipf_pairs(50, 2)
    path = write_corpus(tmp_path, {"train": train, "val": valid, "test_2016_flickr": valid})
    options = dict(path=path, vocab=vocab, joint_vocab=joint, max_vocab_size=cap,
                   lightrnn_frequent=5, cache_dir=str(tmp_path / "c"))  # fmt: skip
    data = TranslationDataModule(**options, min_freq=min_freq)
    sources, targets = [s for s, _ in train], [t for _, t in train]
    if joint:  # one count over both sides (the source's lines first)
        expected = (plain_min_freq(sources + targets, cap, min_freq),) * 2
    else:
        expected = (plain_min_freq(sources, cap, min_freq), plain_min_freq(targets, cap, min_freq))
    words = (data.source_vocab, getattr(data.target_vocab, "words", data.target_vocab))
    assert [(v.itos, v.counts) for v in words] == list(expected)
    assert all(len(v) < len(plain_build(sources + targets)[0]) for v in words)  # cut
    said = [r.getMessage() for r in caplog.records if "vocabularies (" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        f"(data.min_freq={min_freq}: words seen under {min_freq} times in training are <unk>)"
    )
    pairs = data.encoded("valid")
    for i, (source, target) in enumerate(valid):
        assert pairs[i]["source_ids"].tolist() == data.source_vocab.encode_line(source)
        assert pairs[i]["target_ids"].tolist() == data.target_vocab.encode_line(target)
    default = TranslationDataModule(**options)
    assert default.cache.path != data.cache.path
    assert "min_freq" not in default.cache.material["vocab"]  # the key made before the option


def test_min_freq_errors():
    with pytest.raises(DataConfigError, match="data.min_freq must be an integer >= 1, got 0"):
        TranslationDataModule(min_freq=0)
    with pytest.raises(DataConfigError, match="data.min_freq=3 applies to word vocabularies"):
        TranslationDataModule(vocab="bpe", min_freq=3)
