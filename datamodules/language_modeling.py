"""Language-modelling data: word, BPE or Hybrid-LightRNN vocabulary, prepared once into a cache
of int32 token files that every run and rank memory-maps, truncated-BPTT batches."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from datamodules.bptt import StreamWindows, WindowSchedule, stream_layout
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
from datamodules.errors import DataConfigError, VocabularyMismatchError
from datamodules.pair_batches import StreamedWindows, check_window
from datamodules.resumable import ResumableLoader
from datamodules.text_source import (
    CORPORA,
    HeldOutSplits,
    PredictInput,
    TextSource,
    check_held_out,
    data_location,
    local_or_hub,
    predict_input,
    text_source,
    tokenizers_progress,
)
from datamodules.vocab import VOCABS, BPEVocab, Vocab, WordVocab, vocab_from_state, vocab_over
from datamodules.vocab.bpe import StreamEncoder, warn_if_other_bpe_size, written_unk
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab, codes_text
from datamodules.vocab.word import UNK, count_words
from heads.errors import UserError

log = logging.getLogger(__name__)

# Predict names at most this many prompts of unknown words alone (a file of them: thousands).
NAMED_UNKNOWN_PROMPTS = 5
# Above this share of a split's tokens, the unknown-word line is a warning.
UNKNOWN_WARN_SHARE = 0.01


def check_window_law(std: float, half_prob: float, min_len: int, max_len: int | None) -> None:
    """Raises ``DataConfigError`` for a variable-window law that cannot work."""
    if not std >= 0:
        raise DataConfigError(f"data.bptt_std must be >= 0, got {std!r}")
    if not 0 <= half_prob <= 1:
        raise DataConfigError(f"data.bptt_half_prob must be in [0, 1], got {half_prob!r}")
    if not isinstance(min_len, int) or min_len <= 0:
        raise DataConfigError(f"data.min_bptt must be a positive integer, got {min_len!r}")
    if max_len is not None and (not isinstance(max_len, int) or max_len < min_len):
        raise DataConfigError(
            f"data.max_bptt must be an integer >= data.min_bptt ({min_len}), got {max_len!r}"
        )


class _UnknownCounter:
    """Encodes line batches (``vocab.encode_batch``) and counts the tokens that became
    ``<unk>`` without being written ``<unk>`` in the text."""

    def __init__(self, vocab: WordVocab | BPEVocab) -> None:
        self.vocab, self.unknown = vocab, 0

    def encode_batch(self, lines: list[str]) -> np.ndarray:
        ids, unknown = self.vocab.encode_batch_unknown(lines)
        self.unknown += unknown
        return ids

    def counted(self) -> dict[str, int]:
        return {"unknown": self.unknown}


def unknown_ids(vocab: Any) -> frozenset[int]:
    """The ids that stand for input the vocabulary does not know: ``<unk>`` (a word outside
    it, or written ``<unk>``), and a BPE's ``<unk_char>`` (a character it never saw). Over
    Hybrid-LightRNN codes: its words' ``<unk>``."""
    units = getattr(vocab, "words", vocab)
    return frozenset(
        i for i in (getattr(units, "unk_id", None), getattr(units, "unk_char_id", None))
        if i is not None
    )  # fmt: skip


def count_unknown(vocab: Any, units: list[int]) -> int:
    """How many of ``units`` (ids of ``vocab``'s words, or of its BPE pieces) are unknown."""
    unknown = unknown_ids(vocab)
    return sum(1 for i in units if i in unknown)


class PromptBatches(StreamedWindows):
    """``predict``'s prompts in batches of at most ``batch_size``, read from ``prompts`` a
    window of ``window`` lines at a time, each window's prompts encoded once (in the input's
    order), sorted by length and cut into batches (:class:`StreamedWindows`): a batch holds
    prompts of about one length, so little of it is padding (in the input's order, one long
    prompt padded its whole batch: 3.8 padded tokens a real one on mixed PTB prompts). The
    model gives the results back in the input's order (:class:`InputOrder`); memory holds
    one window (a long file is never read whole).

    A batch: ``prompt`` (the texts), ``ids`` ``[B, T]`` long (each prompt's ids, right-padded
    with ``<eos>``; an empty prompt is ``<eos>`` alone), ``lengths`` (each prompt's length, a
    list that stays on the host) and ``ends`` (the same, a tensor that goes to the device with
    ``ids``: the model reads each prompt's last real position), ``unknown`` and ``tokens``
    (each prompt's tokens read as ``<unk>``, and its tokens: words for Hybrid-LightRNN, pieces
    for BPE; what ``UnknownInput`` counts, so that the model encodes nothing again),
    ``input_lines`` (each prompt's line in the input) and ``last``. The first few wholly
    unknown prompts are named in a warning, in the input's order (the model counts them all)."""

    def __init__(
        self, prompts: PredictInput | list[str], vocab: Vocab, batch_size: int, window: int = 4096
    ) -> None:
        if not isinstance(prompts, PredictInput):
            prompts = PredictInput(given=tuple(prompts))
        super().__init__(prompts.line_batches, self._encode_window, self._collate, window,
                         max_lines=batch_size, name=prompts.name)  # fmt: skip
        self.vocab, self.batch_size = vocab, batch_size
        self._unknown = unknown_ids(vocab)
        self._named = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._named = 0  # a new pass over the prompts
        return super().__iter__()

    def _encode_window(self, prompts: list[str]) -> tuple[list[tuple], list[int]]:
        """Each prompt's ``(ids, unknown, tokens)`` and its length (the ids the model reads)."""
        items = []
        for prompt in prompts:
            ids, units = self._encode(prompt)
            unknown = sum(1 for i in units if i in self._unknown)
            if units and unknown == len(units):
                self._name_unknown(prompt)
            items.append((ids or [self.vocab.eos_id], unknown, len(units)))
        return items, [len(item[0]) for item in items]

    def _collate(self, items: list[tuple], prompts: list[str], _: list[int]) -> dict[str, Any]:
        rows = [item[0] for item in items]
        lengths = [len(row) for row in rows]
        padded = torch.full((len(rows), max(lengths)), self.vocab.eos_id, dtype=torch.long)
        for i, row in enumerate(rows):
            padded[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return {"prompt": prompts, "ids": padded, "lengths": lengths,
                "ends": torch.tensor(lengths), "unknown": [item[1] for item in items],
                "tokens": [item[2] for item in items]}  # fmt: skip

    def _encode(self, prompt: str) -> tuple[list[int], list[int]]:
        """(the ids the model reads, the units ``<unk>`` is counted in): the text split and
        looked up once (Hybrid-LightRNN: its words, then their codes)."""
        vocab = self.vocab
        if isinstance(vocab, HybridLightRNNVocab):
            words = vocab.words.encode_line(prompt, add_eos=False)
            return vocab.encode_word_ids(torch.tensor(words, dtype=torch.long)).tolist(), words
        ids = vocab.encode_line(prompt, add_eos=False)
        return ids, ids

    def _name_unknown(self, prompt: str) -> None:
        self._named += 1
        if self._named <= NAMED_UNKNOWN_PROMPTS:
            last = " (further ones not named)" * (self._named == NAMED_UNKNOWN_PROMPTS)
            log.warning("prompt %r: no word of it is in the vocabulary (all <unk>)%s", prompt, last)


class LanguageModelingDataModule(SourceIdentities, L.LightningDataModule):
    """Serves contiguous BPTT batches ``(input [B, T], target [B, T])`` for train/valid/test.

    The corpus is prepared once (``prepare_data``, rank 0; or on first use): the vocabulary is
    counted in one pass and each split tokenised in batches straight into an int32 file of a
    cache entry keyed by the files' identity and the vocabulary options
    (``datamodules/cache.py``). Every later run, and every DDP rank, loads the vocabulary and
    memory-maps the token files instead (a log line says which). ``vocab_size`` (read by the
    CLI before ``prepare_data``) loads or builds only the vocabulary; nothing is tokenised
    while the CLI builds objects, and ``test``/``validate``/``predict`` never touch the
    training split.

    Args:
        path: a local folder with train/valid/test text files, plain or compressed (``.xz``,
            ``.gz``, ``.bz2``), found by name or named in ``files``; unset: the Penn Treebank
            shipped with the project (``datamodules/corpora/ptb``).
        files: split -> file name inside ``path``, e.g. ``{train: ptb.train.txt, ...}``.
        hub: a Hugging Face hub dataset name instead of ``path`` (e.g. ``Salesforce/wikitext``;
            network on the first use, HF's cache after), or a local copy in the hub's layout.
        name: the hub dataset's configuration (e.g. ``wikitext-103-v1``).
        revision: the hub dataset's branch, tag or commit (default: its main branch).
        hub_splits: our split -> the hub's split name (default train/validation/test).
        text_column: the hub dataset's text column.
        held_out: for a corpus without validation or test text (one training file, a hub
            dataset with only ``train``): this share of the training lines (``0.05``) for
            each missing split, cut in contiguous blocks from the end of the training text
            (valid, then test); training reads what comes before them.
        batch_size: parallel streams in training (global, split across DDP ranks).
        eval_batch_size: parallel streams for validation and test.
        bptt: time steps per batch (with ``variable_bptt``, in training: the mean window).
        variable_bptt: AWD-LSTM's variable training windows (Merity et al. 2018, Sec. 4.1;
            ``datamodules.bptt.WindowSchedule``): each window's length is drawn around
            ``bptt`` (``bptt / 2`` with probability ``bptt_half_prob``), normal with standard
            deviation ``bptt_std``, at least ``min_bptt``, at most ``max_bptt``; every training
            target is still predicted once per epoch. The lengths are a function of the run's
            seed (``seed_everything``; 0 without one; the checkpoint keeps it) and the epoch,
            alike on every DDP rank. Validation and test keep windows of ``bptt``. The
            reference also scales the learning rate by ``T / bptt`` for each window: add the
            callback ``app.callbacks.WindowLR`` (without it the run says so). The number of
            windows changes from epoch to epoch, so the trainer re-reads the training loader
            every epoch (``trainer.reload_dataloaders_every_n_epochs`` is set to 1), and the
            fit's optimizer steps are :meth:`stepping_batches` (exact; Lightning's
            ``trainer.estimated_stepping_batches`` takes the first epoch's count for all).
        bptt_std, bptt_half_prob, min_bptt, max_bptt: the law of the variable windows: 5, 0.05,
            5 and no cap in AWD-LSTM; the MoS code caps at ``bptt + 40``.
        max_vocab_size: keep only the most frequent words (others become ``<unk>``); for
            ``hybrid_lightrnn`` too (the words that get codes).
        min_freq: words seen fewer than this many times in the training split become
            ``<unk>`` (torchtext's ``min_freq``; raw corpora's long tail); with
            ``max_vocab_size`` both limits apply. Word and ``hybrid_lightrnn`` vocabularies.
        predict_prompts: texts whose continuation ``predict`` reports.
        predict_file: a UTF-8 text file (plain or compressed; ``-``: standard input) of
            prompts, one a line, instead of ``predict_prompts``.
        predict_batch_size: prompts ``predict`` reads at once (one backbone pass, one top-k
            over the batch), right-padded: each prompt's top-k is the one it has alone (in
            float32 a probability's 6th significant digit may differ by one: other shapes,
            other rounding), output in the input's order. Sampled continuations
            (``model.generate_tokens``) draw the batch's rows together, so a seed's draws
            depend on this size and ``predict_window`` (the same seed and sizes: the same
            draws).
        predict_window: ``predict`` reads this many prompts at a time (the input is never
            held whole), sorts them by length and cuts them into batches of
            ``predict_batch_size``, so a batch holds prompts of about one length (little
            padding); the output keeps the input's order (at most one window of results
            waits). Equal to ``predict_batch_size``: each batch holds the prompts it held in
            the input's order.
        vocab: ``word`` (one id per word), ``bpe`` (HuggingFace ``tokenizers`` BPE trained on
            the training split) or ``hybrid_lightrnn`` (K frequent words with a code each, the
            others two codes: a cell of a rows x cols table). The model sees the codes; the
            vocabulary, including the table, is saved in the checkpoint.
        bpe_vocab_size: size of the BPE vocabulary (special tokens and alphabet included).
        lightrnn_frequent: K, the most frequent words with an exclusive code.
        lightrnn_rows, lightrnn_cols: the table (d1 x d2); a missing side is chosen so that
            the table holds the rare words (nearly square when both are missing), and a table
            too small for the vocabulary is grown to fit (with a warning).
        lightrnn_init: initial table, ``frequency`` (row by row in frequency order) or
            ``random``.
        lightrnn_seed: seed of the ``random`` initial table.
        cache_dir: folder of prepared corpora (default ``data/`` below
            ``$OUTPUT_HEADS_CACHE`` or ``~/.cache/output-heads``).
    """

    def __init__(
        self,
        path: str | None = None,
        files: dict[str, str] | None = None,
        hub: str | None = None,
        name: str | None = None,
        revision: str | None = None,
        hub_splits: dict[str, str] | None = None,
        text_column: str = "text",
        held_out: float | None = None,
        batch_size: int = 20,
        eval_batch_size: int = 10,
        bptt: int = 35,
        variable_bptt: bool = False,
        bptt_std: float = 5.0,
        bptt_half_prob: float = 0.05,
        min_bptt: int = 5,
        max_bptt: int | None = None,
        max_vocab_size: int | None = None,
        min_freq: int = 1,
        predict_prompts: list[str] | None = None,
        predict_file: str | None = None,
        predict_batch_size: int = 64,
        predict_window: int = 4096,
        vocab: str = "word",
        bpe_vocab_size: int = 4000,
        lightrnn_frequent: int = 1000,
        lightrnn_rows: int | None = None,
        lightrnn_cols: int | None = None,
        lightrnn_init: str = "frequency",
        lightrnn_seed: int = 0,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        for option, value in (
            ("batch_size", batch_size),
            ("eval_batch_size", eval_batch_size),
            ("bptt", bptt),
            ("predict_batch_size", predict_batch_size),
        ):
            if not isinstance(value, int) or value <= 0:
                raise DataConfigError(f"data.{option} must be a positive integer, got {value!r}")
        check_window_law(bptt_std, bptt_half_prob, min_bptt, max_bptt)
        check_window(predict_window)
        if vocab not in VOCABS:
            raise DataConfigError(f"data.vocab must be one of {', '.join(VOCABS)}, got {vocab!r}")
        check_min_freq(min_freq, vocab)
        if lightrnn_init not in ("frequency", "random"):
            raise DataConfigError(
                f"data.lightrnn_init must be 'frequency' or 'random', got {lightrnn_init!r}"
            )
        check_held_out(held_out)
        self._folder, self._hub = local_or_hub(
            path, CORPORA / "ptb", hub, name, revision, hub_splits
        )
        self.save_hyperparameters()
        self._source: TextSource | None = None
        self._cache: CacheEntry | None = None
        self._identity: dict[str, Any] = {}
        self._vocab: Vocab | None = None
        self._ids: dict[str, torch.Tensor] = {}  # word or BPE ids per split: int32, mapped
        self._num_tokens: dict[str, int] = {}  # stream length per split
        # the vocabulary's streams (whole splits, rank shares) at its `version`
        self._streams: dict[Any, torch.Tensor] = {}
        self._streams_version = -1
        # split -> (tokens that became <unk> without being written so, tokens): see
        # :meth:`_report_unknown`
        self.unknown_tokens: dict[str, tuple[int, int]] = {}
        # the seed of the variable windows: fixed at the first training loader, kept in the
        # checkpoint (a resumed run walks the windows the interrupted one walked)
        self._window_seed: int | None = None
        self._schedule: tuple[tuple, WindowSchedule] | None = None  # (its law, it)
        self._warned_window_lr = False

    def __repr__(self) -> str:
        # Lightning's own __str__ builds every data loader (jsonargparse formats the data module
        # while linking arguments): this one reads nothing.
        hp = self.hparams
        return f"{type(self).__name__}({self.location}, vocab={hp.vocab!r})"

    __str__ = __repr__

    def __getstate__(self) -> dict[str, Any]:
        # pickled (ddp_spawn, DataLoader workers under spawn): the token files are mapped again
        # where it is unpickled, not copied into the pickle
        state = self.__dict__.copy()
        state["_ids"], state["_streams"] = {}, {}
        return state

    # -- source and cache ----------------------------------------------------------------
    @property
    def location(self) -> str:
        """Where the text comes from, for messages: ``path=...`` or ``hub=...``."""
        return data_location(self._folder, self._hub)

    @property
    def source(self) -> TextSource:
        """Where the splits' text comes from (files checked, nothing read yet)."""
        if self._source is None:
            hp = self.hparams
            self._source = text_source(
                self._folder, self._hub, hp.files, hp.text_column, held_out=hp.held_out
            )
            if isinstance(self._source, HeldOutSplits) and process_rank() in (None, 0):
                log.info(self._source.summary())
        return self._source

    @property
    def _level(self) -> str:
        """What the cache holds: word ids (word and Hybrid-LightRNN) or BPE ids."""
        return "bpe" if self.hparams.vocab == "bpe" else "word"

    @property
    def cache(self) -> CacheEntry:
        """This corpus's cache entry: keyed by the training file and the vocabulary options
        (each split's ids also record the identity of the file they come from)."""
        if self._cache is None:
            hp = self.hparams
            options = vocab_options(self._level, hp.bpe_vocab_size, hp.max_vocab_size, hp.min_freq)
            material = {"task": "lm", "train": self._identity_of("train"), "vocab": options}
            label = f"{self.source.label}-{self._level}"
            self._cache = CacheEntry(cache_root(hp.cache_dir), label, material)
        return self._cache

    # -- vocabulary (needed at CLI link time, before setup) ---------------------------
    @property
    def vocab(self) -> Vocab:
        if self._vocab is None:
            self._vocab = self._load_vocab()
        return self._vocab

    def _load_vocab(self) -> Vocab:
        hp = self.hparams
        options = {
            "word": "data.max_vocab_size, data.min_freq",
            "bpe": "data.bpe_vocab_size",
            "hybrid_lightrnn": "data.lightrnn_*",
        }
        try:
            cache = self.cache
            what = f"the {self._level} vocabulary of {self.source.label!r}"
            cache.ensure(lambda: cache.has("vocab.json"), self._build_vocab, what)
            base = vocab_from_state(cache.read_json("vocab.json"))
            vocab = vocab_over(base, hp.vocab, hp)
        except UserError:
            raise
        except ValueError as exc:  # sizes that cannot work: one line naming the options
            raise DataConfigError(f"data.vocab={hp.vocab} ({options[hp.vocab]}): {exc}") from exc
        if process_rank() in (None, 0):  # the size the head and embeddings are built for
            log.info(
                "vocabulary (%s): %s ids%s%s",
                hp.vocab,
                f"{len(vocab):,}",
                codes_text(vocab),
                min_freq_text(hp.min_freq),
            )
        return vocab

    def _build_vocab(self) -> None:
        """Count the training split once (word), or train the BPE on it and encode it once
        (its frequency ranking needs the counts; the ids are kept as the training split's)."""
        hp, cache, source = self.hparams, self.cache, self.source
        if self._level == "word":
            counts = count_words(source.line_batches("train", desc="counting words (train)"))
            vocab = WordVocab.from_counts(counts, hp.max_vocab_size, hp.min_freq)
        else:
            start = time.perf_counter()
            lines = source.line_batches("train", desc="training BPE (train)")
            tokenizer = BPEVocab.train_tokenizer(
                lines, hp.bpe_vocab_size, show_progress=tokenizers_progress()
            )
            log.info(
                "BPE of %d tokens trained in %.1f s",
                tokenizer.get_vocab_size(),
                time.perf_counter() - start,
            )
            warn_if_other_bpe_size(tokenizer.get_vocab_size(), hp.bpe_vocab_size, log)
            counts = np.zeros(tokenizer.get_vocab_size(), dtype=np.int64)
            encoder = StreamEncoder(tokenizer)
            written = 0  # <unk> written in the text

            def theirs():
                nonlocal written
                for lines in source.line_batches("train", desc="encoding train (BPE)"):
                    ids = encoder.encode(lines)
                    counts[:] += np.bincount(ids, minlength=counts.size)
                    written += written_unk(lines)
                    yield ids

            cache.write_ids("train.theirs", theirs())
            vocab = BPEVocab.from_counts(tokenizer, counts)
            unknown = int(counts[tokenizer.token_to_id(UNK)]) - written
            identity = self._identity_of("train")
            cache.remap("train.theirs", "train", vocab.to_ours, source=identity, unknown=unknown)
        cache.write_json("vocab.json", vocab.state_dict())

    @property
    def word_start_mask(self) -> torch.Tensor | None:
        """``[vocab_size]`` bool, True for the ids that begin a word, so that the model can
        report word-level perplexity (sum of code NLLs / number of words); None for ``word``
        (every id is a word)."""
        return getattr(self.vocab, "word_start_mask", None)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    # -- preparing and loading the token files -----------------------------------------
    def prepare_data(self) -> None:
        """Vocabulary and the token files of the splits this run reads (Lightning calls it on
        one process per node before ``setup``; the others then find the cache)."""
        _ = self.vocab
        for split in splits_to_prepare(self.trainer):
            self._split_ids(split)

    def setup(self, stage: str) -> None:
        for split in splits_to_prepare(self.trainer, stage):
            self._split_ids(split)  # memory-maps (prepares only if prepare_data did not)

    def _split_ids(self, split: str) -> torch.Tensor:
        """A split's ids in the cached vocabulary (word or BPE), int32, memory-mapped."""
        if split not in self._ids:
            vocab, cache, source = self.vocab.base, self.cache, self.source
            identity = self._identity_of(split)

            def done() -> bool:
                if not cache.has_ids(split):
                    return False
                meta = cache.read_json(f"{split}.json")
                # an entry of an older version has no unknown-word count: encoded again
                return meta["source"] == identity and "unknown" in meta

            def encode() -> None:
                batches = source.line_batches(split, desc=f"tokenising {split}")
                counter = _UnknownCounter(vocab)
                chunks = map(counter.encode_batch, batches)
                cache.write_ids(split, chunks, source=identity, counted=counter.counted)

            cache.ensure(done, encode, f"{split} token ids")
            self._ids[split] = torch.from_numpy(cache.ids(split))
            self._report_unknown(split, cache.read_json(f"{split}.json"))
        return self._ids[split]

    def _report_unknown(self, split: str, meta: dict[str, Any]) -> None:
        """One line per split (from the cache entry's counts, so also on a cache hit): the
        tokens that became ``<unk>`` without being written ``<unk>`` in the text: in training,
        the words ``max_vocab_size`` or ``min_freq`` dropped; elsewhere, words the training
        split lacks or the limits dropped (BPE: characters it never saw). A warning above 1%,
        whose advice names the limit that cut the vocabulary."""
        unknown, tokens = int(meta["unknown"]), int(meta["tokens"])
        self.unknown_tokens[split] = (unknown, tokens)
        if process_rank() not in (None, 0):
            return
        share = unknown / max(tokens, 1)
        token = "<unk>"
        if self._level == "bpe":
            why, fix = "characters the BPE never saw in training", "check the text's characters"
            if getattr(self._vocab, "unk_char_id", None) is not None:
                token = "<unk_char>"  # a piece inside its word (an older BPE's: <unk>)
        elif split == "train":
            limit, min_freq = self.hparams.max_vocab_size, self.hparams.min_freq
            why = " or ".join(
                [f"words beyond data.max_vocab_size={limit}"] * bool(limit)
                + [f"words seen fewer than data.min_freq={min_freq} times"] * (min_freq > 1)
            )
            why = why or "no max_vocab_size"
            fix = self._raise_limits() or "raise data.max_vocab_size"
        else:
            why = "words not in the training vocabulary"
            fix = "check that the splits are tokenised alike (case, punctuation, numbers)"
            raise_limits = self._raise_limits(explain=True)
            if raise_limits:  # the limits dropped training words too
                fix = f"{raise_limits}, or {fix}"
        line = (
            f"{split}: {unknown:,} of {tokens:,} tokens ({share:.2%}) became {token} ({why}; "
            f"{token} written in the text not counted)"
        )
        if share > UNKNOWN_WARN_SHARE:
            log.warning("warning: %s: over %.0f%%, %s", line, 100 * UNKNOWN_WARN_SHARE, fix)
        else:
            log.info("%s", line)

    def _raise_limits(self, explain: bool = False) -> str:
        """Advice for ``<unk>`` that the word vocabulary's limits made ("" if none cut it):
        raise ``max_vocab_size`` if the cap is reached (it then dropped every word the minimum
        count did, and more), lower ``min_freq`` if it is above 1 (with the cap reached: as
        well, once the cap is raised)."""
        limit, min_freq = self.hparams.max_vocab_size, self.hparams.min_freq
        capped = bool(limit) and len(self.vocab.base) >= limit
        advice = []
        if capped:
            cut = f" (the vocabulary is cut to {limit:,})" if explain else ""
            advice.append(f"raise data.max_vocab_size{cut}")
        if min_freq > 1:
            seen = f" (words seen fewer than {min_freq} times in training)" if explain else ""
            advice.append(f"lower data.min_freq{seen}")
        return " and ".join(advice)

    def num_tokens(self, split: str) -> int:
        """Length of a split's stream (the vocabulary's: e.g. codes), without encoding it."""
        if split not in self._num_tokens:
            self._num_tokens[split] = self.vocab.count_stream(self._split_ids(split))
        return self._num_tokens[split]

    def _stream(self, key: Any, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A stream of the vocabulary (``encode()``), kept until the vocabulary changes it."""
        if self._streams_version != self.vocab.version:
            self._streams.clear()
            self._streams_version = self.vocab.version
        if key not in self._streams:
            self._streams[key] = encode()
        return self._streams[key]

    def split_tokens(self, split: str) -> torch.Tensor:
        """All ids (codes) of a split as one int32 stream (``<eos>`` after every line):
        a view of the memory-mapped token file, or the vocabulary's stream of it (the
        Hybrid-LightRNN codes of the current table)."""
        return self._stream(split, lambda: self.vocab.encode_stream(self._split_ids(split)))

    @property
    def token_counts(self) -> np.ndarray:
        """Training count of every class id the head predicts (``[vocab_size]``, int64): what a
        head's ``setup`` may use, e.g. adaptive ``cutoffs: auto`` ranks classes by it. Read off
        the vocabulary (it holds the training counts of its words or BPE tokens; a code counts
        every word it stands for)."""
        return self.vocab.class_counts()

    def split_word_ids(self, split: str) -> torch.Tensor:
        """Word ids of a split (word and Hybrid-LightRNN vocabularies), int32."""
        if self._level != "word":
            raise DataConfigError(f"data.vocab={self.hparams.vocab} has no word ids")
        return self._split_ids(split)

    # validation and test streams are shared out unevenly where the ranks do not divide them
    # (``stream_layout``): eval_batch_size 10 runs on 4 or 8 GPUs
    uneven_eval_streams = True

    def rank_streams(self, split: str, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
        """This rank's ``[batch_size / world_size, stream_len]`` block of BPTT streams, int32:
        a view of the token file (no copy), or this rank's share of the codes. Validation and
        test: ``batch_size`` need not divide by ``world_size`` (``stream_layout``'s
        ``uneven``)."""
        start, streams, stream_len = stream_layout(
            self.num_tokens(split), batch_size, rank, world_size, uneven=split != "train"
        )
        stop = start + streams * stream_len

        def encode() -> torch.Tensor:
            if split in self._streams:  # the whole stream is already encoded
                return self._streams[split][start:stop]
            return self.vocab.encode_stream_range(self._split_ids(split), start, stop)

        return self._stream((split, start, stop), encode).view(streams, stream_len)

    # -- loaders ---------------------------------------------------------------------------
    def _batches(self, split: str, batch_size: int) -> DataLoader:
        return DataLoader(self._windows(split, batch_size), batch_size=None)

    def train_dataloader(self) -> DataLoader:
        # resumable: a mid-epoch checkpoint saves the position, `fit --ckpt_path` continues there
        if self.hparams.variable_bptt:
            self._check_variable_windows()
        return ResumableLoader(self._windows("train", self.hparams.batch_size))

    def _windows(self, split: str, batch_size: int) -> StreamWindows:
        """BPTT batches over the split's *current* token stream, re-read at every pass; the
        vocabulary is told when a training pass starts (``begin_training_pass``): state it
        scheduled (a re-assigned table) then takes effect, so the next epoch (also after a
        resume) trains and validates with it. Training windows vary with ``variable_bptt``."""
        hp = self.hparams
        before = self.vocab.begin_training_pass if split == "train" else None
        schedule = self.window_schedule if split == "train" else None
        return StreamWindows(self, split, batch_size, hp.bptt, self.num_tokens(split),
                             before_pass=before, schedule=schedule,
                             epoch=self._window_epoch)  # fmt: skip

    @property
    def window_schedule(self) -> WindowSchedule | None:
        """The training windows' law (``variable_bptt``), else None (windows of ``bptt``)."""
        hp = self.hparams
        if not hp.variable_bptt:
            return None
        if self._window_seed is None:
            # the run's seed (LightningCLI's seed_everything sets it, and DDP ranks inherit
            # it): a study's seeds vary the windows, as the reference's seed does
            self._window_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        law = (hp.bptt, self._window_seed, hp.bptt_std, hp.bptt_half_prob, hp.min_bptt, hp.max_bptt)
        if self._schedule is None or self._schedule[0] != law:
            self._schedule = (law, WindowSchedule(*law))
        return self._schedule[1]

    def stepping_batches(self, trainer: Any | None = None) -> int | float:
        """The optimizer steps of the whole fit, what a schedule sized by the run's length
        (OneCycle, a cosine decay) needs: Lightning's ``trainer.estimated_stepping_batches``
        with fixed windows. With ``variable_bptt`` that property multiplies the length of the
        loader it holds (the first epoch's) by ``max_epochs``, where each epoch has its own
        count of windows: a schedule sized by it ends early or late (a OneCycle stepped past
        its ``total_steps`` raises). Here the count is exact: the windows of every epoch are
        a function of (seed, epoch) (:class:`WindowSchedule`), so each epoch's count is
        drawn without data, and Lightning's arithmetic applied to each epoch
        (``limit_train_batches``, ``ceil(batches / accumulate_grad_batches)`` steps, the
        ``max_steps`` cap). ``trainer``: the fitting one (default: this module's)."""
        trainer = trainer if trainer is not None else self.trainer
        schedule = self.window_schedule
        if schedule is None or trainer.overfit_batches:  # the same windows every epoch
            return trainer.estimated_stepping_batches
        max_epochs, max_steps = trainer.max_epochs, trainer.max_steps
        if max_epochs == -1:
            return float("inf") if max_steps == -1 else max_steps
        # the streams' length, alike on every rank
        stream_len = stream_layout(self.num_tokens("train"), self.hparams.batch_size)[2]
        limit, accumulate = trainer.limit_train_batches, trainer.accumulate_grad_batches
        total = 0
        for epoch in range(max(max_epochs, 1)):
            batches = schedule.count(stream_len, epoch)
            # lightning's _parse_num_batches: an int caps, a fraction scales and truncates
            batches = min(batches, limit) if isinstance(limit, int) else int(batches * limit)
            total += -(-batches // accumulate)  # the epoch's last partial accumulation steps
            if max_steps != -1 and total >= max_steps:
                return max_steps
        return total

    def _window_epoch(self) -> int:
        """The epoch whose windows a training pass walks: the trainer's (restored from a
        checkpoint with the loops, so a resumed run continues the same epoch's windows), 0
        without a trainer or with ``overfit_batches`` (the same batches every epoch)."""
        trainer = self.trainer
        if trainer is None or trainer.overfit_batches:
            return 0
        return trainer.current_epoch

    def _check_variable_windows(self) -> None:
        """Lightning reads a training loader's length once unless it reloads the loader, and
        the count of windows changes with the epoch: it reloads it every epoch (else an epoch
        with more windows than the first was cut short, and one with fewer ended without its
        validation). And the run is told once if no callback scales the learning rate by the
        window's length."""
        trainer = self.trainer
        if trainer is None:
            return
        if trainer.reload_dataloaders_every_n_epochs != 1:
            trainer.reload_dataloaders_every_n_epochs = 1
        scaled = any(getattr(c, "scales_lr_by_window", False) for c in trainer.callbacks)
        if not scaled and not self._warned_window_lr and process_rank() in (None, 0):
            log.warning(
                "warning: data.variable_bptt draws the training windows' lengths, but no "
                "callback scales the learning rate by T / bptt as AWD-LSTM does: add "
                "app.callbacks.WindowLR to trainer.callbacks (configs/callbacks/lm_awd.yaml)"
            )
        self._warned_window_lr = True

    def val_dataloader(self) -> DataLoader:
        return self._batches("valid", self.hparams.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self._batches("test", self.hparams.eval_batch_size)

    def predict_dataloader(self) -> DataLoader:
        hp = self.hparams
        prompts = predict_input(hp.predict_prompts, hp.predict_file, "prompts", "the company said")
        # read and encoded a window at a time (memory flat over a long file), sorted by length
        # in the window (LanguageModel.predict_step writes the results in the input's order)
        batches = PromptBatches(prompts, self.vocab, hp.predict_batch_size, hp.predict_window)
        return DataLoader(batches, batch_size=None)

    # -- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"vocab": self.vocab.state_dict()}
        if self.hparams.variable_bptt:
            state["window_seed"] = self.window_schedule.seed
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = vocab_from_state(state_dict["vocab"])
        current = self.vocab
        if not current.accepts(saved):
            raise VocabularyMismatchError(
                f"the checkpoint was trained with another vocabulary ({len(saved)} tokens, "
                f"fingerprint {saved.fingerprint()}) than the data at {self.location} "
                f"gives ({len(current)} tokens, fingerprint {current.fingerprint()}); "
                f"point data.path at the corpus the checkpoint was trained on, and data.vocab "
                f"and its options at the checkpoint's ({state_dict['vocab'].get('type')})"
            )
        current.load_state_dict(state_dict["vocab"])  # its training state (a learnt table)
        if "window_seed" in state_dict:  # the windows the checkpointed run walked
            self._window_seed = int(state_dict["window_seed"])
