"""Parallel-text data for translation: vocabularies, token-count buckets, padding and masks.

Prepared once, as language-modelling data is (``datamodules/cache.py``): the vocabularies are
counted (or the BPE trained) on the training pairs, each side of each split is encoded in
batches into an int32 token file with line offsets, and every later run and DDP rank
memory-maps those files. ``vocab_size``/``src_vocab_size`` (read by the CLI before
``prepare_data``) load or build only the vocabularies.

Empty-lines policy: a training pair with an empty side (a line with no token) is dropped (there
is nothing to learn from it; the count is logged); validation and test keep every line, so the
written translations stay line-aligned with the source and reference files (an empty source
is read as ``<eos>`` alone for the loss; its written translation is blank, as ``predict``'s).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning as L
import numpy as np
import torch
from datasets import Dataset, DatasetDict
from torch.utils.data import DataLoader

from datamodules.cache import (
    CacheEntry,
    SourceIdentities,
    cache_root,
    check_min_freq,
    min_freq_text,
    process_rank,
    splits_to_prepare,
    vocab_options,
)
from datamodules.errors import (
    DataConfigError,
    DataPathError,
    ParallelDataError,
    VocabularyMismatchError,
)
from datamodules.pair_batches import (
    EncodedPairs,
    LengthSortedSampler,
    StreamedWindows,
    TokenBucketBatchSampler,
    collate_pairs,
)
from datamodules.resumable import ResumableLoader
from datamodules.text_source import (
    CORPORA,
    HeldOutSplits,
    HubColumns,
    HubDataset,
    TextFiles,
    TextSource,
    check_held_out,
    count_lines,
    data_location,
    file_identity,
    has_text,
    local_or_hub,
    predict_input,
    require_folder,
    resolve_file,
    split_files_option,
    tokenizers_progress,
    with_held_out,
)
from datamodules.vocab import (
    EOS,
    BPEVocab,
    HybridLightRNNVocab,
    WordVocab,
    vocab_from_state,
    vocab_over,
)
from datamodules.vocab.bpe import UNK_CHAR, StreamEncoder, warn_if_other_bpe_size, written_unk
from datamodules.vocab.hybrid_lightrnn import codes_text
from datamodules.vocab.word import count_words
from heads.errors import UserError

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
SIDES = ("source", "target")
# Multi30k's file prefixes (task 1): train.de, val.de, test_2016_flickr.de ...
DEFAULT_FILES = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
# Above this share of a side's tokens, the unknown-word line is a warning (as the LM's).
UNKNOWN_WARN_SHARE = 0.01


def _misaligned(split: str, files: Sequence[str], counts: Sequence[int], how: str = "has"):
    return ParallelDataError(
        f"misaligned parallel {split} files: {files[0]!r} {how} {counts[0]} lines but "
        f"{files[1]!r} {how} {counts[1]}; line i of one side must translate line i of the other"
    )


def cached_line_count(path: Path, counts_dir: Path | None) -> int:
    """``count_lines(path)``, kept in ``counts_dir`` (none: counted every time) under the
    file's identity (the data cache's: name, size, modification time, a hash of its first and
    last MiB), so an unchanged file is counted once and a changed one again. A parallel
    corpus's sides are checked to align at every launch (``data.held_out`` cuts the training
    files by their line counts): counting 4M pairs took 9 s on every DDP rank, every run."""
    if counts_dir is None:
        return count_lines(path)
    identity = {"path": str(path.resolve()), **file_identity(path)}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    record = counts_dir / f"{key}.json"
    try:
        saved = json.loads(record.read_text())
        if saved.get("identity") == identity and isinstance(saved.get("lines"), int):
            return saved["lines"]
    except (OSError, ValueError):
        pass  # not counted yet (or unreadable): count
    lines = count_lines(path)
    try:  # written whole or not at all (ranks count at once the first time)
        counts_dir.mkdir(parents=True, exist_ok=True)
        temp = counts_dir / f".{key}.{uuid.uuid4().hex}.tmp"
        temp.write_text(json.dumps({"identity": identity, "lines": lines}))
        os.replace(temp, record)
    except OSError:
        pass  # a cache that cannot be written only costs the count next time
    return lines


def parallel_text_source(
    folder: Path,
    hub: HubDataset | None,
    source_lang: str,
    target_lang: str,
    files: dict[str, str] | None = None,
    held_out: float | None = None,
    counts_dir: Path | None = None,
) -> TextSource:
    """The parts ``<split>.source`` and ``<split>.target`` of the three splits.

    Local: ``<folder>/<prefix>.<lang>`` files (or ``.xz``/``.gz``/``.bz2`` of them), line i of
    one side translating line i of the other (validation and test line counts are checked
    here; the training files', which may be large, as they are read). Hub: a dataset with one
    column per language (e.g. ``bentrevett/multi30k``) or a ``translation`` column of
    ``{lang: text}`` (WMT style). With ``held_out``, a validation or test split the corpus
    lacks is cut from the end of the training pairs (:class:`HeldOutSplits`). Line counts are
    kept in ``counts_dir`` (:func:`cached_line_count`).
    """
    check_held_out(held_out)
    if hub is None:
        require_folder(folder, "Multi30k (as configs/data/multi30k*.yaml do)")
        named = split_files_option(files)
        prefixes = {**DEFAULT_FILES, **named}
        found: dict[str, Path] = {}
        present: list[str] = []
        train_counts: dict[str, int] = {}  # the training sides' lines, for the held-out cut
        for split in SPLITS:
            side_files = [
                resolve_file(folder / f"{prefixes[split]}.{lang}")
                for lang in (source_lang, target_lang)
            ]
            absent = [file for file in side_files if not file.is_file()]
            if (
                len(absent) == 2
                and held_out is not None
                and split != "train"
                and split not in named
            ):
                continue  # cut from the training pairs
            if absent:
                hint = ", or hold out a share of the training pairs with --data.held_out 0.05"
                raise DataPathError(
                    f"{split} file {str(absent[0])!r} does not exist; name the split prefixes "
                    f"with data.files, e.g. {{train: train, valid: val, test: test}}"
                    f"{hint if split != 'train' else ''}"
                )
            if split != "train" or held_out is not None:  # (cut pairs must align)
                counts = [cached_line_count(f, counts_dir) for f in side_files]
                if counts[0] != counts[1]:
                    raise _misaligned(split, [str(f) for f in side_files], counts)
                if split == "train":  # (HeldOutSplits cuts by them: not counted again)
                    train_counts = {f".{side}": n for side, n in zip(SIDES, counts, strict=True)}
            if not has_text(side_files[0]):
                raise DataPathError(f"{split} file {str(side_files[0])!r} is empty")
            found[f"{split}.source"], found[f"{split}.target"] = side_files
            present.append(split)
        label = f"{folder.resolve().name}-{source_lang}-{target_lang}"
        source = TextFiles(found, label=label)
        where = data_location(folder, None)
        return with_held_out(source, present, held_out, where, counts=train_counts)

    splits = hub.load(held_out)
    parts: dict[str, Any] = {}
    for split in splits:
        dataset = splits[split]
        if {source_lang, target_lang} <= set(dataset.column_names):
            columns: tuple[Any, Any] = (source_lang, target_lang)
        elif "translation" in dataset.column_names:
            columns = (("translation", source_lang), ("translation", target_lang))
        else:
            raise ParallelDataError(
                f"hub dataset {hub.hub!r} has neither columns {source_lang!r}/{target_lang!r} "
                f"nor a 'translation' column (columns: {dataset.column_names})"
            )
        for side, column in zip(SIDES, columns, strict=True):
            parts[f"{split}.{side}"] = (dataset, column)
    source = HubColumns(parts, label=f"{hub.label}-{source_lang}-{target_lang}")
    return with_held_out(source, splits, held_out, data_location(folder, hub))


Vocab = WordVocab | BPEVocab | HybridLightRNNVocab


def line_codes(
    vocab: HybridLightRNNVocab, word_ids: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Lines of word ids (flat, with line ``offsets``) as Hybrid-LightRNN code lines: one code
    per frequent word, two per rare word (int32, in memory: the codes follow the table)."""
    word_ids = np.asarray(word_ids)
    codes = vocab.encode_word_ids(torch.from_numpy(word_ids)).numpy()
    per_word = 1 + (word_ids >= vocab.num_frequent)  # a line is never empty (<eos>)
    ends = np.cumsum(per_word)[np.asarray(offsets[1:]) - 1] if len(offsets) > 1 else []
    return codes, np.concatenate([[0], ends]).astype(np.int64)


class TranslationDataModule(SourceIdentities, L.LightningDataModule):
    """Serves padded, length-bucketed batches of parallel sentences (see :func:`collate_pairs`).

    Ids: every sentence ends in ``<eos>``; the decoder starts from ``<eos>`` as BOS (so no
    extra token breaks the frequency order of the target ids that Mixtape's gate sharing
    relies on) and padding reuses ``<eos>`` at masked positions.

    Args:
        path: a local folder of ``<prefix>.<lang>`` files, plain or compressed (``.xz``, ``.gz``,
            ``.bz2``); unset: Multi30k shipped with the project (``datamodules/corpora/multi30k``).
        source_lang, target_lang: language suffixes / column names (``de`` -> ``en``).
        files: split -> file prefix (default Multi30k's ``train``, ``val``, ``test_2016_flickr``;
            keys ``train``, ``valid`` (or ``validation``, ``val``, ``dev``) and ``test``).
        hub: a Hugging Face hub dataset name instead of ``path`` (e.g. ``bentrevett/multi30k``),
            or a local copy in the hub's layout.
        name, revision, hub_splits: the hub dataset's configuration, revision (branch, tag or
            commit) and our split -> its split name (default train/validation/test).
        held_out: for a corpus without validation or test pairs (training files only, a hub
            dataset with only ``train``): this share of the training pairs (``0.05``) for
            each missing split, cut in contiguous blocks from the end of the training files
            (valid, then test); training reads the pairs before them.
        vocab: ``word`` (whitespace tokens), ``bpe`` (HuggingFace ``tokenizers`` BPE) or
            ``hybrid_lightrnn``: source words, target Hybrid-LightRNN codes (K frequent target
            words with a code each, the others two: a cell of a rows x cols table; the
            decoder reads and the head predicts codes, BLEU is on the decoded words).
            ``LightRNNTableReassignment`` re-learns the table between epochs; the target codes
            follow the installed table.
        joint_vocab: one vocabulary for both sides (needed to share embeddings).
        max_vocab_size: word vocabularies: keep this many most frequent tokens per side.
        min_freq: word vocabularies (and ``hybrid_lightrnn``'s words): words seen fewer than
            this many times on their side of the training pairs (both sides with
            ``joint_vocab``) become ``<unk>`` (fairseq's ``--thresholdsrc/--thresholdtgt``);
            with ``max_vocab_size`` both limits apply.
        bpe_vocab_size: BPE vocabularies: merges + alphabet + specials, per vocabulary.
        max_tokens: padded tokens per side per training batch (per DDP rank; a training
            split that it cuts into fewer batches than ranks is cut into one batch per rank
            instead, of balanced cost: an epoch of one step).
        eval_max_tokens: the same for validation and test (default ``max_tokens``). Under
            DDP the split is cut into rounds of one batch per rank, of balanced cost, each
            within it (``datamodules/pair_batches.py``).
        max_length: training pairs longer than this (tokens, with ``<eos>``) on either side
            are dropped.
        seed: shuffling seed of the training batches.
        predict_sentences: source sentences that ``predict`` translates.
        predict_file: a UTF-8 text file (plain or compressed; ``-``: standard input) of source
            sentences, one a line, instead of ``predict_sentences``; the translations come
            out in its order.
        predict_window: ``predict`` sorts the sentences by length within windows of this
            many lines and cuts each window into batches of at most ``eval_max_tokens`` (else
            ``max_tokens``) padded source tokens, so a batch holds sentences of about one
            length (fairseq-interactive's ``--buffer-size``); the translations are written
            in the input's order, at most one window of them held back. The input is read
            a window at a time, never held whole.
        lightrnn_frequent, lightrnn_rows, lightrnn_cols, lightrnn_init, lightrnn_seed: the
            target's Hybrid-LightRNN codes, as in ``LanguageModelingDataModule``.
        cache_dir: folder of prepared corpora (default ``data/`` below
            ``$OUTPUT_HEADS_CACHE`` or ``~/.cache/output-heads``).
    """

    def __init__(
        self,
        path: str | None = None,
        source_lang: str = "de",
        target_lang: str = "en",
        files: dict[str, str] | None = None,
        hub: str | None = None,
        name: str | None = None,
        revision: str | None = None,
        hub_splits: dict[str, str] | None = None,
        held_out: float | None = None,
        vocab: Literal["word", "bpe", "hybrid_lightrnn"] = "word",
        joint_vocab: bool = False,
        max_vocab_size: int | None = None,
        min_freq: int = 1,
        bpe_vocab_size: int = 8000,
        max_tokens: int = 4096,
        eval_max_tokens: int | None = None,
        max_length: int = 128,
        seed: int = 0,
        predict_sentences: list[str] | None = None,
        predict_file: str | None = None,
        predict_window: int = 4096,
        lightrnn_frequent: int = 1000,
        lightrnn_rows: int | None = None,
        lightrnn_cols: int | None = None,
        lightrnn_init: Literal["frequency", "random"] = "frequency",
        lightrnn_seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        for option, value in (
            ("max_tokens", max_tokens),
            ("eval_max_tokens", eval_max_tokens or max_tokens),
            ("max_length", max_length),
            ("bpe_vocab_size", bpe_vocab_size),
            ("predict_window", predict_window),
        ):
            if not isinstance(value, int) or value <= 0:
                raise DataConfigError(f"data.{option} must be a positive integer, got {value!r}")
        if vocab not in ("word", "bpe", "hybrid_lightrnn"):
            raise DataConfigError(
                f"data.vocab must be 'word', 'bpe' or 'hybrid_lightrnn', got {vocab!r}"
            )
        if vocab == "hybrid_lightrnn" and joint_vocab:
            raise DataConfigError(
                "data.joint_vocab needs one vocabulary for both sides, and hybrid_lightrnn codes "
                "the target side only: set data.joint_vocab false (or data.vocab word or bpe)"
            )
        check_min_freq(min_freq, vocab)
        if source_lang == target_lang:
            raise DataConfigError(f"source and target language are both {source_lang!r}")
        check_held_out(held_out)
        self._folder, self._hub = local_or_hub(
            path, CORPORA / "multi30k", hub, name, revision, hub_splits
        )
        self.save_hyperparameters()
        self._source: TextSource | None = None
        self._cache: CacheEntry | None = None
        self._identity: dict[str, Any] = {}
        self._vocabs: tuple[Vocab, Vocab] | None = None
        self._word_vocabs: tuple[Vocab, Vocab] | None = None  # what the token files hold
        self._parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._encoded: dict[str, EncodedPairs] = {}
        # Hybrid-LightRNN target: the word lines behind each coded part, and the table version
        # the codes were made with (they follow a re-learnt or restored table)
        self._target_words: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._table_version: int | None = None
        self._lines: dict[str, list[str]] = {}
        self._splits: DatasetDict | None = None
        # split -> side -> (tokens that became <unk> without being written so, tokens)
        self.unknown_tokens: dict[str, dict[str, tuple[int, int]]] = {}

    def __repr__(self) -> str:
        # Lightning's own __str__ builds every data loader: this one reads nothing.
        hp = self.hparams
        return (
            f"{type(self).__name__}({self.location}, {hp.source_lang}->{hp.target_lang}, "
            f"vocab={hp.vocab!r})"
        )

    __str__ = __repr__

    def __getstate__(self) -> dict[str, Any]:
        # pickled (ddp_spawn, DataLoader workers under spawn): the token files are mapped again
        # where it is unpickled, not copied into the pickle
        state = self.__dict__.copy()
        state["_parts"], state["_encoded"], state["_target_words"] = {}, {}, {}
        return state

    # -- source and cache ----------------------------------------------------------------
    @property
    def location(self) -> str:
        """Where the text comes from, for messages: ``path=...`` or ``hub=...``."""
        return data_location(self._folder, self._hub)

    @property
    def source(self) -> TextSource:
        if self._source is None:
            hp = self.hparams
            self._source = parallel_text_source(
                self._folder, self._hub, hp.source_lang, hp.target_lang, hp.files, hp.held_out,
                counts_dir=cache_root(hp.cache_dir) / "line-counts",
            )  # fmt: skip
            if isinstance(self._source, HeldOutSplits) and process_rank() in (None, 0):
                log.info(self._source.summary())
        return self._source

    @property
    def _level(self) -> str:
        """The vocabulary the cached token files are written in: a Hybrid-LightRNN target is
        coded from word ids when read (its codes follow the table, the files do not)."""
        return "word" if self.hparams.vocab == "hybrid_lightrnn" else self.hparams.vocab

    @property
    def cache(self) -> CacheEntry:
        """This corpus's cache entry: keyed by the training files and the vocabulary options."""
        if self._cache is None:
            hp = self.hparams
            options = vocab_options(self._level, hp.bpe_vocab_size, hp.max_vocab_size, hp.min_freq)
            options["joint"] = hp.joint_vocab
            train = {side: self._identity_of(f"train.{side}") for side in SIDES}
            material = {"task": "mt", "train": train, "vocab": options}
            label = f"{self.source.label}-{self._level}"
            self._cache = CacheEntry(cache_root(hp.cache_dir), label, material)
        return self._cache

    @property
    def splits(self) -> DatasetDict:
        """The raw text as a ``DatasetDict`` of ``source``/``target`` columns (to look at; the
        loaders read the prepared token files)."""
        if self._splits is None:
            self._splits = DatasetDict(
                {
                    split: Dataset.from_dict(
                        {side: self._raw_lines(f"{split}.{side}") for side in SIDES}
                    )
                    for split in SPLITS
                }
            )
        return self._splits

    def _raw_lines(self, part: str) -> list[str]:
        if part not in self._lines:
            self._lines[part] = self.source.lines(part)
        return self._lines[part]

    # -- vocabularies (needed at CLI link time, before setup) -------------------------
    @property
    def vocabs(self) -> tuple[Vocab, Vocab]:
        """(source vocabulary, target vocabulary), built from every training pair."""
        if self._vocabs is None:
            hp = self.hparams
            try:
                cache = self.cache
                what = f"the {self._level} vocabularies of {self.source.label!r}"
                cache.ensure(lambda: cache.has("vocabs.json"), self._build_vocabs, what)
                states = cache.read_json("vocabs.json")
                source = vocab_from_state(states["source"])
                target = source if hp.joint_vocab else vocab_from_state(states["target"])
                self._word_vocabs = (source, target)
                target = vocab_over(target, hp.vocab, hp)  # (words and BPE: itself)
            except UserError:
                raise
            except ValueError as exc:
                option = {"bpe": "data.bpe_vocab_size", "hybrid_lightrnn": "data.lightrnn_*"}
                option = option.get(hp.vocab, "data.max_vocab_size, data.min_freq")
                raise DataConfigError(f"data.vocab={hp.vocab} ({option}): {exc}") from exc
            self._vocabs = (source, target)
            if process_rank() in (None, 0):  # the sizes the model is built for
                sizes = (
                    f"joint {len(source):,}"
                    if hp.joint_vocab
                    else f"source {len(source):,}, target {len(target):,}"
                )
                codes = codes_text(target)
                limits = min_freq_text(hp.min_freq)
                log.info("vocabularies (%s): %s ids%s%s", hp.vocab, sizes, codes, limits)
        return self._vocabs

    def _train_batches(self, side: str, desc: str, lines: dict[str, int]) -> Iterator[list[str]]:
        """A training side's line batches, counting its lines into ``lines[side]``."""
        lines[side] = 0
        for batch in self.source.line_batches(f"train.{side}", desc=f"{desc} (train {side})"):
            lines[side] += len(batch)
            yield batch

    def _check_train_lines(self, lines: dict[str, int]) -> None:
        if lines["source"] != lines["target"]:
            files = [self.source.describe(f"train.{side}") for side in SIDES]
            raise _misaligned("train", files, [lines[side] for side in SIDES])

    def _build_vocabs(self) -> None:
        """Word: count each side (both sides into one vocabulary when joint). BPE: train on
        the side(s), encode the training lines once for the frequency ranking and keep those
        ids as the training split's."""
        hp, cache, lines = self.hparams, self.cache, {}
        groups = [SIDES] if hp.joint_vocab else [(side,) for side in SIDES]
        built: dict[str, Vocab] = {}
        for sides in groups:
            if self._level == "word":
                batches = (
                    b for side in sides for b in self._train_batches(side, "counting", lines)
                )
                counts = count_words(batches)
                vocab = WordVocab.from_counts(counts, hp.max_vocab_size, hp.min_freq)
            else:
                vocab = self._build_bpe(sides, lines)
            built.update(dict.fromkeys(sides, vocab))
        self._check_train_lines(lines)
        states = {side: built[side].state_dict() for side in SIDES}
        cache.write_json("vocabs.json", states)

    def _build_bpe(self, sides: tuple[str, ...], lines: dict[str, int]) -> BPEVocab:
        cache, hp = self.cache, self.hparams
        batches = (b for side in sides for b in self._train_batches(side, "training BPE", lines))
        tokenizer = BPEVocab.train_tokenizer(
            batches, hp.bpe_vocab_size, show_progress=tokenizers_progress()
        )
        warn_if_other_bpe_size(tokenizer.get_vocab_size(), hp.bpe_vocab_size, log)
        counts = np.zeros(tokenizer.get_vocab_size(), dtype=np.int64)
        eos = tokenizer.token_to_id(EOS)
        encoder = StreamEncoder(tokenizer)

        unk_char = tokenizer.token_to_id(UNK_CHAR)
        unknown = dict.fromkeys(sides, 0)  # <unk_char> not written in the text, per side

        def theirs(side: str):
            desc = f"encoding train {side} (BPE)"
            for batch in self.source.line_batches(f"train.{side}", desc=desc):
                ids = encoder.encode(batch)
                counts[:] += np.bincount(ids, minlength=counts.size)
                if found := int(np.count_nonzero(ids == unk_char)):
                    unknown[side] += found - written_unk(batch, UNK_CHAR)
                yield ids, BPEVocab.theirs_line_lengths(tokenizer, batch, ids, eos)

        for side in sides:
            cache.write_ids(f"train.{side}.theirs", theirs(side))
        vocab = BPEVocab.from_counts(tokenizer, counts)
        for side in sides:
            identity = self._identity_of(f"train.{side}")
            cache.remap(
                f"train.{side}.theirs",
                f"train.{side}",
                vocab.to_ours,
                source=identity,
                unknown=unknown[side],
            )
        return vocab

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
    def word_start_mask(self) -> torch.Tensor | None:
        """``[vocab_size]`` bool, True for the target ids that begin a word (Hybrid-LightRNN
        codes), so that the model reports word-level perplexity; None for word and BPE
        targets."""
        return getattr(self.target_vocab, "word_start_mask", None)

    @property
    def bos_id(self) -> int:
        return self.target_vocab.eos_id

    @property
    def token_counts(self) -> np.ndarray:
        """Training count of every target id (``[vocab_size]``, int64): what a head's ``setup``
        may use, e.g. adaptive ``cutoffs: auto`` ranks classes by it. A target vocabulary of its
        own holds exactly these counts; a joint one counts the source side too, so the training
        target ids are counted then."""
        if isinstance(self.target_vocab, HybridLightRNNVocab):
            return self.target_vocab.class_counts()  # each code's words' counts
        if not self.hparams.joint_vocab:
            return np.asarray(self.target_vocab.counts, dtype=np.int64)
        ids, _ = self._part("train", SIDES[1])
        return np.bincount(np.asarray(ids), minlength=self.vocab_size)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Target ids (without the final ``<eos>``) back to text, for BLEU and the output file."""
        return self.target_vocab.detokenize(ids)

    def references(self, split: str) -> list[str]:
        """The raw target lines of a split (BLEU references), in file order."""
        return self._raw_lines(f"{split}.target")

    def sources(self, split: str) -> list[str]:
        return self._raw_lines(f"{split}.source")

    # -- preparing, encoding and batches --------------------------------------------------
    def prepare_data(self) -> None:
        """Vocabularies and the token files of the splits this run reads (Lightning calls it
        on one process per node before ``setup``)."""
        _ = self.vocabs
        for split in splits_to_prepare(self.trainer):
            self.encoded(split)

    def setup(self, stage: str) -> None:
        for split in splits_to_prepare(self.trainer, stage):
            self.encoded(split)  # memory-maps (prepares only if prepare_data did not)

    def _part(self, split: str, side: str) -> tuple[np.ndarray, np.ndarray]:
        """One side of a split: its ids (int32, memory-mapped) and line offsets."""
        part = f"{split}.{side}"
        self._follow_the_table()  # first: the parts coded so far and a new one share a table
        if part not in self._parts:
            # the words the token files hold, and the ids the model reads (codes or the same)
            coder = self.vocabs[SIDES.index(side)]
            vocab, cache = self._word_vocabs[SIDES.index(side)], self.cache
            identity = self._identity_of(part)

            def done() -> bool:
                if not (cache.has_ids(part) and cache.has(f"{part}.offsets.npy")):
                    return False
                meta = cache.read_json(f"{part}.json")
                # an entry of an older version has no unknown-word count: encoded again
                return meta["source"] == identity and "unknown" in meta

            unknown = [0]  # tokens that became <unk> (<unk_char>) without being written so

            def chunks():
                for batch in self.source.line_batches(part, desc=f"tokenising {split} {side}"):
                    ids, found = vocab.encode_batch_unknown(batch)
                    unknown[0] += found
                    yield ids, vocab.line_lengths(batch, ids)

            def write() -> None:
                counted = lambda: {"unknown": unknown[0]}  # noqa: E731
                cache.write_ids(part, chunks(), source=identity, counted=counted)

            cache.ensure(done, write, part)
            meta = cache.read_json(f"{part}.json")
            self.unknown_tokens.setdefault(split, {})[side] = (meta["unknown"], meta["tokens"])
            ids, offsets = cache.ids(part), cache.offsets(part)
            if isinstance(coder, HybridLightRNNVocab):
                self._target_words[part] = (ids, offsets)
                ids, offsets = line_codes(coder, ids, offsets)
                self._table_version = coder.version
            self._parts[part] = (ids, offsets)
        return self._parts[part]

    def _follow_the_table(self) -> None:
        """Code the target lines read so far again if the Hybrid-LightRNN table changed (re-learnt
        by ``LightRNNTableReassignment``, or restored from a checkpoint), also in the datasets
        the loaders hold. A word keeps its number of codes, so lengths and batches stay."""
        if not self._target_words:
            return
        vocab = self.target_vocab
        if vocab.version == self._table_version:
            return
        for part, (ids, offsets) in self._target_words.items():
            codes, _ = line_codes(vocab, ids, offsets)
            self._parts[part] = (codes, self._parts[part][1])
            split = part.rsplit(".", 1)[0]
            if split in self._encoded:
                self._encoded[split].target = codes
        self._table_version = vocab.version

    def _begin_training_pass(self) -> None:
        """A training epoch starts: a table the vocabulary scheduled is installed now, and the
        target codes follow it (the language model's streams do the same)."""
        if isinstance(self.target_vocab, HybridLightRNNVocab):
            self.target_vocab.begin_training_pass()
            self._follow_the_table()

    def encoded(self, split: str) -> EncodedPairs:
        """The split's pairs (training pairs with an empty side or longer than
        ``max_length`` left out)."""
        self._follow_the_table()
        if split not in self._encoded:
            (source, source_offsets), (target, target_offsets) = (
                self._part(split, side) for side in SIDES
            )
            if len(source_offsets) != len(target_offsets):
                counts = [len(source_offsets) - 1, len(target_offsets) - 1]
                files = [self.source.describe(f"{split}.{s}") for s in SIDES]
                raise _misaligned(split, files, counts, how="reads as")
            source_lengths, target_lengths = np.diff(source_offsets), np.diff(target_offsets)
            index = np.arange(len(source_lengths))
            if split == "train":
                # a line with no token encodes to <eos> alone
                kept = (source_lengths > 1) & (target_lengths > 1)
                if not kept.all():
                    log.warning("dropped %d training pairs with an empty side", (~kept).sum())
                limit = self.hparams.max_length
                short = (source_lengths <= limit) & (target_lengths <= limit)
                if (long := int((kept & ~short).sum())) > 0:  # said, not dropped silently
                    log.warning(
                        "dropped %d training pairs longer than data.max_length=%d tokens",
                        long,
                        limit,
                    )
                kept &= short
                index = np.flatnonzero(kept)
                if len(index) == 0:
                    raise DataConfigError(
                        f"no training pair is within data.max_length={limit} tokens"
                    )
            self._encoded[split] = EncodedPairs(
                source, source_offsets, target, target_offsets, index
            )
            self._report_unknown(split)
        return self._encoded[split]

    def _report_unknown(self, split: str) -> None:
        """One line per split (from the cache entry's counts, so also on a cache hit): each
        side's tokens that became ``<unk>`` without being written ``<unk>`` in the text (BPE:
        ``<unk_char>``, characters the BPE never saw). In training the words the vocabulary's
        limits dropped; elsewhere also the words the training pairs lack. A warning above 1%
        on a side: BLEU and perplexity are then measured on text the model cannot write."""
        counts = self.unknown_tokens.get(split, {})
        if process_rank() not in (None, 0) or set(counts) != set(SIDES):
            return
        bpe = self._level == "bpe"
        token = "<unk_char>" if bpe else "<unk>"
        if bpe:
            why = "characters the BPE never saw in training"
        elif split == "train":
            hp = self.hparams
            why = " or ".join(
                [f"words beyond data.max_vocab_size={hp.max_vocab_size}"] * bool(hp.max_vocab_size)
                + [f"words seen fewer than data.min_freq={hp.min_freq} times"] * (hp.min_freq > 1)
            )
            why = why or "no limit set"
        else:
            why = "words not in the training vocabulary"
        shares = {side: unknown / max(tokens, 1) for side, (unknown, tokens) in counts.items()}
        sides = ", ".join(
            f"{side} {counts[side][0]:,} of {counts[side][1]:,} tokens ({shares[side]:.2%})"
            for side in SIDES
        )
        line = f"{split}: {token}: {sides} ({why}; {token} written in the text not counted)"
        if max(shares.values()) > UNKNOWN_WARN_SHARE:
            log.warning("warning: %s: over %.0f%% on a side", line, 100 * UNKNOWN_WARN_SHARE)
        else:
            log.info("%s", line)

    def _loader(
        self, split: str, max_tokens: int, shuffle: bool, resumable: bool = False
    ) -> DataLoader:
        pairs = self.encoded(split)
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        order = LengthSortedSampler(
            pairs.source_lengths,
            pairs.target_lengths,
            shuffle=shuffle,
            seed=self.hparams.seed,
            # Lightning turns a shuffling sampler off for overfit_batches; ours shuffles in
            # the batch sampler, which it cannot see
            epochs_alike=bool(trainer is not None and trainer.overfit_batches),
        )
        if trainer is not None:  # a resumed run continues with its epoch's order
            order.set_epoch(trainer.current_epoch)
        sampler = TokenBucketBatchSampler(
            order, max_tokens, rank=rank, world_size=world, longer_alone=split != "train"
        )
        pad = bos = self.bos_id
        collate = functools.partial(collate_pairs, pad_id=pad, bos_id=bos)
        if resumable:
            return ResumableLoader(
                pairs, before_pass=self._begin_training_pass, batch_sampler=sampler,
                collate_fn=collate,
            )  # fmt: skip
        return DataLoader(pairs, batch_sampler=sampler, collate_fn=collate)

    def train_dataloader(self) -> DataLoader:
        # a mid-epoch checkpoint saves the position, `fit --ckpt_path` continues there
        return self._loader("train", self.hparams.max_tokens, shuffle=True, resumable=True)

    def table_scoring_dataloader(self) -> DataLoader:
        """This rank's training pairs in the current epoch's shuffled token buckets, with no
        resume position: what ``LightRNNTableReassignment`` scores (Eq. 6) after an epoch (a
        ``max_batches`` sample is then a random one, not the shortest sentences)."""
        return self._loader("train", self.hparams.max_tokens, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("valid", self.hparams.eval_max_tokens or self.hparams.max_tokens, False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.hparams.eval_max_tokens or self.hparams.max_tokens, False)

    def predict_dataloader(self) -> DataLoader:
        hp = self.hparams
        sentences = predict_input(
            hp.predict_sentences, hp.predict_file, "sentences", "Ein Hund rennt durch den Schnee."
        )
        vocab, eos = self.source_vocab, self.bos_id

        def encode(lines: list[str]) -> tuple[list[list[int]], list[int]]:
            ids = [vocab.encode_line(s) for s in lines]
            return ids, [len(source) for source in ids]

        def collate(ids: list[list[int]], lines: list[str], numbers: list[int]) -> dict[str, Any]:
            items = [{"source_ids": source, "target_ids": [eos], "index": i}
                     for source, i in zip(ids, numbers, strict=True)]  # fmt: skip
            return {**collate_pairs(items, pad_id=eos, bos_id=eos), "text": lines}

        # read a window at a time (a long file is never held whole), sorted by length in the
        # window, batched by the evaluation's token budget: in file order, 64 a batch, every
        # batch was padded to its longest source and decoded until its longest output
        # (Translation.predict_step writes the results in the input's order)
        budget = hp.eval_max_tokens or hp.max_tokens
        batches = StreamedWindows(sentences.line_batches, encode, collate, hp.predict_window,
                                  max_tokens=budget, name=sentences.name)  # fmt: skip
        return DataLoader(batches, batch_size=None)

    # -- checkpoint ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        src, tgt = self.vocabs
        return {"source_vocab": src.state_dict(), "target_vocab": tgt.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for side, ours in (("source", self.source_vocab), ("target", self.target_vocab)):
            saved = vocab_from_state(state_dict[f"{side}_vocab"])
            if isinstance(ours, HybridLightRNNVocab):  # same words and table shape
                accepted = ours.accepts(saved)
            else:
                accepted = type(saved) is type(ours) and saved.itos == ours.itos
            if not accepted:
                raise VocabularyMismatchError(
                    f"the checkpoint was trained with another {side} vocabulary "
                    f"({type(saved).__name__}, {len(saved)} tokens, fingerprint "
                    f"{saved.fingerprint()}) than the data at {self.location} gives "
                    f"({type(ours).__name__}, {len(ours)} tokens, fingerprint "
                    f"{ours.fingerprint()}); point data.path at the corpus the checkpoint was "
                    f"trained on and use the same data.vocab options"
                )
            if isinstance(ours, HybridLightRNNVocab):  # its code ids and (learnt) table
                ours.load_state_dict(state_dict[f"{side}_vocab"])
