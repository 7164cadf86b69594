"""Parallel-text data for translation: vocabularies, token-count buckets, padding and masks.

Empty-lines policy: a training pair with an empty line on either side is dropped (there is
nothing to learn from it; the count is logged); validation and test keep every line, so the
written translations stay line-aligned with the source and reference files (an empty source
is translated from ``<eos>`` alone).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset
from torch.utils.data import DataLoader, Sampler

from datamodules.errors import (
    DataConfigError,
    DataPathError,
    ParallelDataError,
    VocabularyMismatchError,
)
from datamodules.text_source import looks_local
from datamodules.vocab import BPEVocab, WordVocab
from heads import IGNORE_INDEX

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
# Multi30k's file prefixes (task 1): train.de, val.de, test_2016_flickr.de ...
DEFAULT_FILES = {"train": "train", "valid": "val", "test": "test_2016_flickr"}


def _count_lines(path: Path) -> int:
    with path.open(encoding="utf-8") as handle:
        return sum(1 for _ in handle)


def load_parallel_splits(
    path: str,
    source_lang: str,
    target_lang: str,
    files: dict[str, str] | None = None,
    hub_config: str | None = None,
    hub_splits: dict[str, str] | None = None,
) -> DatasetDict:
    """The three splits as a ``DatasetDict`` with columns ``source`` and ``target``.

    Local: ``<path>/<prefix>.<lang>`` files, line i of one side translating line i of the
    other, read with the offline ``text`` builder. Hub: a dataset with one column per language
    (e.g. ``bentrevett/multi30k``) or a ``translation`` column of ``{lang: text}`` (WMT style).
    """
    if looks_local(path):
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise DataPathError(f"data path {str(folder)!r} does not exist or is not a folder")
        prefixes = {**DEFAULT_FILES, **(files or {})}
        paths: dict[str, str] = {}
        for split in SPLITS:
            side_files = [
                folder / f"{prefixes[split]}.{lang}" for lang in (source_lang, target_lang)
            ]
            for file in side_files:
                if not file.is_file():
                    raise DataPathError(
                        f"{split} file {str(file)!r} does not exist; name the split prefixes "
                        f"with data.files, e.g. {{train: train, valid: val, test: test}}"
                    )
            counts = [_count_lines(f) for f in side_files]
            if counts[0] != counts[1]:
                raise ParallelDataError(
                    f"misaligned parallel {split} files: {str(side_files[0])!r} has {counts[0]} "
                    f"lines but {str(side_files[1])!r} has {counts[1]}; line i of one side must "
                    f"translate line i of the other"
                )
            if counts[0] == 0:
                raise DataPathError(f"{split} file {str(side_files[0])!r} is empty")
            paths[f"{split}_source"], paths[f"{split}_target"] = map(str, side_files)
        # one builder for all six files: one cache look-up instead of six
        raw = load_dataset("text", data_files=paths)
        for split in SPLITS:  # the text builder may split lines differently (\r, \u2028...)
            if len(raw[f"{split}_source"]) != len(raw[f"{split}_target"]):
                raise ParallelDataError(
                    f"misaligned parallel {split} files: {paths[f'{split}_source']!r} reads as "
                    f"{len(raw[f'{split}_source'])} lines but {paths[f'{split}_target']!r} as "
                    f"{len(raw[f'{split}_target'])}"
                )
        return DatasetDict(
            {
                split: concatenate_datasets(
                    [
                        raw[f"{split}_source"].rename_column("text", "source"),
                        raw[f"{split}_target"].rename_column("text", "target"),
                    ],
                    axis=1,  # side by side: the line counts are checked equal above
                )
                for split in SPLITS
            }
        )

    hub_splits = hub_splits or {"train": "train", "valid": "validation", "test": "test"}
    raw = load_dataset(path, hub_config)
    missing = [name for name in hub_splits.values() if name not in raw]
    if missing:
        raise DataPathError(f"hub dataset {path!r} has no split(s) {missing}; set data.hub_splits")
    out = {}
    for ours, theirs in hub_splits.items():
        split = raw[theirs]
        if {source_lang, target_lang} <= set(split.column_names):
            src, tgt = split[source_lang], split[target_lang]
        elif "translation" in split.column_names:
            pairs = split["translation"]
            src = [p[source_lang] for p in pairs]
            tgt = [p[target_lang] for p in pairs]
        else:
            raise ParallelDataError(
                f"hub dataset {path!r} has neither columns {source_lang!r}/{target_lang!r} nor "
                f"a 'translation' column (columns: {split.column_names})"
            )
        out[ours] = Dataset.from_dict({"source": list(src), "target": list(tgt)})
    return DatasetDict(out)


class LengthSortedSampler(Sampler[int]):
    """Indices sorted by (source, target) length; with ``shuffle``, equal lengths are ordered
    at random anew each epoch (from ``seed + epoch``).

    Lightning calls ``set_epoch`` on the ``sampler`` of a DataLoader's batch sampler at every
    epoch start, which is how :class:`TokenBucketBatchSampler` learns the epoch.
    """

    def __init__(
        self,
        source_lengths: Sequence[int],
        target_lengths: Sequence[int],
        shuffle: bool,
        seed: int = 0,
    ) -> None:
        self.source_lengths = list(source_lengths)
        self.target_lengths = list(target_lengths)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def rng(self) -> random.Random:
        return random.Random(self.seed + self.epoch)

    def __iter__(self) -> Iterator[int]:
        # random tie-breaker so equal-length pairs meet different neighbours each epoch
        rng = self.rng()
        tie = [rng.random() for _ in self.source_lengths] if self.shuffle else None
        yield from sorted(
            range(len(self.source_lengths)),
            key=lambda i: (self.source_lengths[i], self.target_lengths[i], tie[i] if tie else i),
        )

    def __len__(self) -> int:
        return len(self.source_lengths)


class TokenBucketBatchSampler(Sampler[list[int]]):
    """Batches of similar-length pairs holding at most ``max_tokens`` padded tokens per side.

    The length-sorted order of ``sampler`` is cut into batches whose ``count * longest`` stays
    within ``max_tokens``, so padding is small. With a shuffling sampler the order of the
    batches is shuffled anew each epoch too. Under DDP each rank takes every
    ``world_size``-th batch (in training the last few batches are dropped so that every rank
    runs the same number of steps).
    """

    def __init__(
        self,
        sampler: LengthSortedSampler,
        max_tokens: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        longest = max(max(sampler.source_lengths), max(sampler.target_lengths))
        if max_tokens < longest:
            raise DataConfigError(
                f"data.max_tokens ({max_tokens}) must hold the longest sequence ({longest} tokens)"
            )
        self.sampler = sampler
        self.max_tokens = max_tokens
        self.rank = rank
        self.world_size = world_size
        self._cache: tuple[int, list[list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def _batches(self) -> list[list[int]]:
        # Lightning asks for len() several times per epoch: cut the batches once per epoch
        epoch = self.sampler.epoch
        if self._cache is None or self._cache[0] != epoch:
            self._cache = (epoch, self._cut_batches())
        return self._cache[1]

    def _cut_batches(self) -> list[list[int]]:
        src, tgt = self.sampler.source_lengths, self.sampler.target_lengths
        batches, batch, longest = [], [], 0
        for i in self.sampler:
            size = max(src[i], tgt[i])
            if batch and (len(batch) + 1) * max(longest, size) > self.max_tokens:
                batches.append(batch)
                batch, longest = [], 0
            batch.append(i)
            longest = max(longest, size)
        if batch:
            batches.append(batch)
        shuffle = self.sampler.shuffle
        if shuffle:
            # a different stream than the tie-breaker's
            random.Random(self.sampler.seed + self.sampler.epoch + 7919).shuffle(batches)
        if self.world_size > 1:
            usable = len(batches) - len(batches) % self.world_size if shuffle else None
            batches = batches[:usable][self.rank :: self.world_size]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        yield from self._batches()

    def __len__(self) -> int:
        return len(self._batches())


def collate_pairs(items: list[dict[str, Any]], pad_id: int, bos_id: int) -> dict[str, torch.Tensor]:
    """Pad a list of encoded pairs into a batch.

    ``source [B, S]`` with ``source_padding [B, S]`` (True at padding: masked in attention),
    ``target_input [B, T]`` = BOS + target without its last token (teacher forcing),
    ``target_output [B, T]`` = target ending in EOS, ``-100`` at padding (ignored by heads),
    ``index [B]`` = line number in the split. Padding ids only fill masked or ignored
    positions, so any id works; ``pad_id`` is an ordinary token of the frequency-sorted
    vocabulary and needs no slot of its own.
    """
    batch = len(items)
    src_len = max(len(it["source_ids"]) for it in items)
    tgt_len = max(len(it["target_ids"]) for it in items)
    source = torch.full((batch, src_len), pad_id, dtype=torch.long)
    padding = torch.ones((batch, src_len), dtype=torch.bool)
    target_input = torch.full((batch, tgt_len), pad_id, dtype=torch.long)
    target_output = torch.full((batch, tgt_len), IGNORE_INDEX, dtype=torch.long)
    for row, it in enumerate(items):
        src, tgt = it["source_ids"], it["target_ids"]
        source[row, : len(src)] = torch.as_tensor(src)
        padding[row, : len(src)] = False
        target_input[row, 0] = bos_id
        target_input[row, 1 : len(tgt)] = torch.as_tensor(tgt[:-1])
        target_output[row, : len(tgt)] = torch.as_tensor(tgt)
    index = torch.as_tensor([it["index"] for it in items], dtype=torch.long)
    return {
        "source": source,
        "source_padding": padding,
        "target_input": target_input,
        "target_output": target_output,
        "index": index,
    }


Vocab = WordVocab | BPEVocab


class TranslationDataModule(L.LightningDataModule):
    """Serves padded, length-bucketed batches of parallel sentences (see :func:`collate_pairs`).

    Ids: every sentence ends in ``<eos>``; the decoder starts from ``<eos>`` as BOS (so no
    extra token breaks the frequency order of the target ids that Mixtape's gate sharing
    relies on) and padding reuses ``<eos>`` at masked positions.

    Args:
        path: a local folder of ``<prefix>.<lang>`` files, or a HuggingFace hub dataset name.
        source_lang, target_lang: language suffixes / column names (``de`` -> ``en``).
        files: split -> file prefix (default Multi30k's ``train``, ``val``, ``test_2016_flickr``).
        hub_config, hub_splits: the hub dataset's configuration and split names.
        vocab: ``word`` (whitespace tokens) or ``bpe`` (HuggingFace ``tokenizers`` BPE).
        joint_vocab: one vocabulary for both sides (needed to share embeddings).
        max_vocab_size: word vocabularies: keep this many most frequent tokens per side.
        bpe_vocab_size: BPE vocabularies: merges + alphabet + specials, per vocabulary.
        max_tokens: padded tokens per side per training batch.
        eval_max_tokens: the same for validation and test (default ``max_tokens``).
        max_length: training pairs longer than this (tokens, with ``<eos>``) on either side
            are dropped.
        seed: shuffling seed of the training batches.
        predict_sentences: source sentences that ``predict`` translates.
    """

    def __init__(
        self,
        path: str = "../shared/data/multi30k",
        source_lang: str = "de",
        target_lang: str = "en",
        files: dict[str, str] | None = None,
        hub_config: str | None = None,
        hub_splits: dict[str, str] | None = None,
        vocab: Literal["word", "bpe"] = "word",
        joint_vocab: bool = False,
        max_vocab_size: int | None = None,
        bpe_vocab_size: int = 8000,
        max_tokens: int = 4096,
        eval_max_tokens: int | None = None,
        max_length: int = 128,
        seed: int = 0,
        predict_sentences: list[str] | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("max_tokens", max_tokens),
            ("eval_max_tokens", eval_max_tokens or max_tokens),
            ("max_length", max_length),
            ("bpe_vocab_size", bpe_vocab_size),
        ):
            if not isinstance(value, int) or value <= 0:
                raise DataConfigError(f"data.{name} must be a positive integer, got {value!r}")
        if vocab not in ("word", "bpe"):
            raise DataConfigError(f"data.vocab must be 'word' or 'bpe', got {vocab!r}")
        if source_lang == target_lang:
            raise DataConfigError(f"source and target language are both {source_lang!r}")
        self.save_hyperparameters()
        self._splits: DatasetDict | None = None
        self._vocabs: tuple[Vocab, Vocab] | None = None
        self._encoded: dict[str, Dataset] = {}

    # -- data and vocabularies (needed at CLI link time, before setup) -----------------
    @property
    def splits(self) -> DatasetDict:
        if self._splits is None:
            hp = self.hparams
            self._splits = load_parallel_splits(
                hp.path, hp.source_lang, hp.target_lang, hp.files, hp.hub_config, hp.hub_splits
            )
        return self._splits

    def _build_vocab(self, lines: list[str]) -> Vocab:
        if self.hparams.vocab == "bpe":
            return BPEVocab.build(lines, self.hparams.bpe_vocab_size)
        return WordVocab.build(lines, self.hparams.max_vocab_size)

    @property
    def vocabs(self) -> tuple[Vocab, Vocab]:
        """(source vocabulary, target vocabulary), built from the training pairs kept."""
        if self._vocabs is None:
            train = self.splits["train"][:]  # plain lists: columns are lazy in datasets 5
            src, tgt = train["source"], train["target"]
            if self.hparams.joint_vocab:
                shared = self._build_vocab(src + tgt)
                self._vocabs = (shared, shared)
            else:
                self._vocabs = (self._build_vocab(src), self._build_vocab(tgt))
        return self._vocabs

    @property
    def source_vocab(self) -> Vocab:
        return self.vocabs[0]

    @property
    def target_vocab(self) -> Vocab:
        return self.vocabs[1]

    @property
    def vocab_size(self) -> int:
        """Target vocabulary size: the head's classes and the decoder's embeddings."""
        return len(self.target_vocab)

    @property
    def src_vocab_size(self) -> int:
        return len(self.source_vocab)

    @property
    def bos_id(self) -> int:
        return self.target_vocab.eos_id

    def detokenize(self, ids: Sequence[int]) -> str:
        """Target ids (without the final ``<eos>``) back to text, for BLEU and the output file."""
        return self.target_vocab.detokenize(ids)

    def references(self, split: str) -> list[str]:
        """The raw target lines of a split (BLEU references), in file order."""
        return self.splits[split][:]["target"]

    def sources(self, split: str) -> list[str]:
        return self.splits[split][:]["source"]

    # -- encoding and batches --------------------------------------------------------------
    def encoded(self, split: str) -> Dataset:
        """Columns ``source_ids``, ``target_ids`` (each ending in ``<eos>``) and ``index``."""
        if split not in self._encoded:
            src_vocab, tgt_vocab = self.vocabs
            data = self.splits[split]
            data = data.add_column("index", list(range(len(data))))
            if split == "train":
                before = len(data)
                data = data.filter(
                    lambda b: [
                        bool(s.strip() and t.strip())
                        for s, t in zip(b["source"], b["target"], strict=True)
                    ],
                    batched=True,
                    desc="dropping empty training pairs",
                )
                if len(data) < before:
                    log.warning("dropped %d training pairs with an empty side", before - len(data))
            data = data.map(
                lambda b: {
                    "source_ids": [src_vocab.encode_line(s) for s in b["source"]],
                    "target_ids": [tgt_vocab.encode_line(t) for t in b["target"]],
                },
                batched=True,
                remove_columns=["source", "target"],
                desc=f"tokenising {split}",
            )
            if split == "train":
                limit = self.hparams.max_length
                data = data.filter(
                    lambda b: [
                        len(s) <= limit and len(t) <= limit
                        for s, t in zip(b["source_ids"], b["target_ids"], strict=True)
                    ],
                    batched=True,
                    desc="dropping long training pairs",
                )
                if len(data) == 0:
                    raise DataConfigError(
                        f"no training pair is within data.max_length={limit} tokens"
                    )
            self._encoded[split] = data.with_format(None)
        return self._encoded[split]

    def _loader(self, split: str, max_tokens: int, shuffle: bool) -> DataLoader:
        columns = self.encoded(split)[:]
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        order = LengthSortedSampler(
            [len(s) for s in columns["source_ids"]],
            [len(t) for t in columns["target_ids"]],
            shuffle=shuffle,
            seed=self.hparams.seed,
        )
        if trainer is not None:  # a resumed run continues with its epoch's order
            order.set_epoch(trainer.current_epoch)
        sampler = TokenBucketBatchSampler(order, max_tokens, rank=rank, world_size=world)
        pad = bos = self.bos_id
        return DataLoader(
            self.encoded(split),
            batch_sampler=sampler,
            collate_fn=lambda items: collate_pairs(items, pad_id=pad, bos_id=bos),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.hparams.max_tokens, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid", self.hparams.eval_max_tokens or self.hparams.max_tokens, False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.hparams.eval_max_tokens or self.hparams.max_tokens, False)

    def predict_dataloader(self) -> DataLoader:
        sentences = self.hparams.predict_sentences
        if not sentences:
            raise DataConfigError(
                "predict needs sentences: set data.predict_sentences, e.g. "
                "--data.predict_sentences '[\"Ein Hund rennt durch den Schnee.\"]'"
            )
        vocab, eos = self.source_vocab, self.bos_id
        items = [
            {"source_ids": vocab.encode_line(s), "target_ids": [eos], "index": i}
            for i, s in enumerate(sentences)
        ]
        return DataLoader(
            items,
            batch_size=64,
            collate_fn=lambda batch: collate_pairs(batch, pad_id=eos, bos_id=eos),
        )

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        src, tgt = self.vocabs
        return {"source_vocab": src.state_dict(), "target_vocab": tgt.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for side, ours in (("source", self.source_vocab), ("target", self.target_vocab)):
            saved = _vocab_from_state(state_dict[f"{side}_vocab"])
            if type(saved) is not type(ours) or saved.itos != ours.itos:
                raise VocabularyMismatchError(
                    f"the checkpoint was trained with another {side} vocabulary "
                    f"({type(saved).__name__}, {len(saved)} tokens, fingerprint "
                    f"{saved.fingerprint()}) than the data at {self.hparams.path!r} gives "
                    f"({type(ours).__name__}, {len(ours)} tokens, fingerprint "
                    f"{ours.fingerprint()}); point data.path at the corpus the checkpoint was "
                    f"trained on and use the same data.vocab options"
                )


def _vocab_from_state(state: dict[str, Any]) -> Vocab:
    if state.get("type") == "bpe":
        return BPEVocab.from_state_dict(state)
    return WordVocab.from_state_dict(state)
