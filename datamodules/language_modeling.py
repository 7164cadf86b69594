"""Language-modelling data: word, BPE or Hybrid-LightRNN vocabulary, cached tokenisation,
truncated-BPTT batches."""

from __future__ import annotations

import itertools
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from datamodules.bptt import BPTTBatches
from datamodules.errors import DataConfigError, VocabularyMismatchError
from datamodules.resumable import ResumableLoader
from datamodules.text_source import load_text_splits
from datamodules.vocab import BPEVocab, WordVocab
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab

VOCABS = ("word", "bpe", "hybrid_lightrnn")
Vocab = WordVocab | BPEVocab | HybridLightRNNVocab


class _LiveBPTT(IterableDataset):
    """BPTT batches over the split's *current* token stream, re-read at every pass. A
    Hybrid-LightRNN table scheduled by the re-assignment is installed when a training pass
    starts, so the next epoch (also after a resume) trains and validates with it. (The number
    of tokens never changes: it depends on which words are frequent, not on the table.)"""

    def __init__(self, data: LanguageModelingDataModule, split: str, batch_size: int) -> None:
        super().__init__()
        trainer = data.trainer
        self.args = (batch_size, data.hparams.bptt)
        self.args += (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        self.data, self.split = data, split
        try:
            self._len = len(BPTTBatches(data.split_tokens(split), *self.args))
        except ValueError as exc:  # too few tokens for the streams, or streams vs. ranks
            option = "data.batch_size" if split == "train" else "data.eval_batch_size"
            raise DataConfigError(f"{split} split with {option}={batch_size}: {exc}") from exc

    def __len__(self) -> int:
        return self._len

    def __iter__(self):
        if self.split == "train":
            self.data.install_scheduled_lightrnn_cells()
        yield from BPTTBatches(self.data.split_tokens(self.split), *self.args)


class LanguageModelingDataModule(L.LightningDataModule):
    """Serves contiguous BPTT batches ``(input [B, T], target [B, T])`` for train/valid/test.

    Args:
        path: a local folder with train/valid/test text files (found by name, or named in
            ``files``), or a HuggingFace hub dataset name (needs network).
        files: split -> file name inside ``path``, e.g. ``{train: ptb.train.txt, ...}``.
        hub_config: configuration name of a hub dataset (e.g. ``wikitext-2-v1``).
        hub_splits: our split -> the hub's split name (default train/validation/test).
        text_column: the hub dataset's text column.
        batch_size: parallel streams in training (global, split across DDP ranks).
        eval_batch_size: parallel streams for validation and test.
        bptt: time steps per batch.
        max_vocab_size: keep only the most frequent words (others become ``<unk>``); for
            ``hybrid_lightrnn`` too (the words that get codes).
        predict_prompts: texts whose continuation ``predict`` reports.
        vocab: ``word`` (one id per word), ``bpe`` (HuggingFace ``tokenizers`` BPE trained on
            the training split) or ``hybrid_lightrnn`` (K frequent words with a code each, the
            others two codes: a cell of a rows x cols table). The model sees the codes; the
            vocabulary, including the table, is saved in the checkpoint.
        bpe_vocab_size: size of the BPE vocabulary (special tokens and alphabet included).
        lightrnn_frequent: K, the most frequent words with an exclusive code.
        lightrnn_rows, lightrnn_cols: the table (d1 x d2); a missing side is chosen so that
            the table holds the rare words (nearly square when both are missing).
        lightrnn_init: initial table, ``frequency`` (row by row in frequency order) or
            ``random``.
        lightrnn_seed: seed of the ``random`` initial table.
    """

    def __init__(
        self,
        path: str = "../shared/data/ptb",
        files: dict[str, str] | None = None,
        hub_config: str | None = None,
        hub_splits: dict[str, str] | None = None,
        text_column: str = "text",
        batch_size: int = 20,
        eval_batch_size: int = 10,
        bptt: int = 35,
        max_vocab_size: int | None = None,
        predict_prompts: list[str] | None = None,
        vocab: str = "word",
        bpe_vocab_size: int = 4000,
        lightrnn_frequent: int = 1000,
        lightrnn_rows: int | None = None,
        lightrnn_cols: int | None = None,
        lightrnn_init: str = "frequency",
        lightrnn_seed: int = 0,
    ) -> None:
        super().__init__()
        for name, value in (
            ("batch_size", batch_size),
            ("eval_batch_size", eval_batch_size),
            ("bptt", bptt),
        ):
            if not isinstance(value, int) or value <= 0:
                raise DataConfigError(f"data.{name} must be a positive integer, got {value!r}")
        if vocab not in VOCABS:
            raise DataConfigError(f"data.vocab must be one of {', '.join(VOCABS)}, got {vocab!r}")
        if lightrnn_init not in ("frequency", "random"):
            raise DataConfigError(
                f"data.lightrnn_init must be 'frequency' or 'random', got {lightrnn_init!r}"
            )
        self.save_hyperparameters()
        self._splits = None
        self._vocab: Vocab | None = None
        self._tokens: dict[str, torch.Tensor] = {}
        self._word_ids: dict[str, torch.Tensor] = {}
        self._scheduled_cells: torch.Tensor | None = None

    # -- vocabulary (needed at CLI link time, before setup) ---------------------------
    @property
    def splits(self):
        if self._splits is None:
            hp = self.hparams
            self._splits = load_text_splits(
                hp.path, hp.files, hp.hub_config, hp.hub_splits, hp.text_column
            )
        return self._splits

    @property
    def vocab(self) -> Vocab:
        if self._vocab is None:
            self._vocab = self._build_vocab()
        return self._vocab

    def _build_vocab(self) -> Vocab:
        hp = self.hparams
        lines = self.splits["train"]["text"]
        try:
            if hp.vocab == "bpe":
                return BPEVocab.build(lines, hp.bpe_vocab_size)
            if hp.vocab == "hybrid_lightrnn":
                return HybridLightRNNVocab.build(
                    lines,
                    hp.lightrnn_frequent,
                    hp.lightrnn_rows,
                    hp.lightrnn_cols,
                    hp.lightrnn_init,
                    hp.lightrnn_seed,
                    hp.max_vocab_size,
                )
        except ValueError as exc:  # sizes that cannot work: one line naming the options
            options = {"bpe": "data.bpe_vocab_size", "hybrid_lightrnn": "data.lightrnn_*"}
            raise DataConfigError(f"data.vocab={hp.vocab} ({options[hp.vocab]}): {exc}") from exc
        return WordVocab.build(lines, hp.max_vocab_size)

    @property
    def word_start_mask(self) -> torch.Tensor | None:
        """``[vocab_size]`` bool, True for the ids that begin a word, so that the model can
        report word-level perplexity (sum of code NLLs / number of words); None for ``word``
        (every id is a word)."""
        return getattr(self.vocab, "word_start_mask", None)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    # -- tokens ------------------------------------------------------------------------
    def split_tokens(self, split: str) -> torch.Tensor:
        """All ids (codes) of a split as one stream (``<eos>`` after every line)."""
        if split not in self._tokens:
            vocab = self.vocab
            if isinstance(vocab, HybridLightRNNVocab):
                self._tokens[split] = vocab.encode_word_ids(self.split_word_ids(split))
            elif isinstance(vocab, BPEVocab):
                ids = vocab.encode_lines(self.splits[split]["text"])
                flat = list(itertools.chain.from_iterable(ids))
                self._tokens[split] = torch.tensor(flat, dtype=torch.long)
            else:
                self._tokens[split] = self.split_word_ids(split)
        return self._tokens[split]

    def split_word_ids(self, split: str) -> torch.Tensor:
        """Word ids of a split (word and Hybrid-LightRNN vocabularies), cached."""
        if split not in self._word_ids:
            vocab = self.vocab
            words = vocab.words if isinstance(vocab, HybridLightRNNVocab) else vocab
            if not isinstance(words, WordVocab):
                raise DataConfigError(f"data.vocab={self.hparams.vocab} has no word ids")
            encoded = self.splits[split].map(
                lambda batch: {"ids": [words.encode_line(t) for t in batch["text"]]},
                batched=True,
                remove_columns=["text"],
                desc=f"tokenising {split}",
            )
            ids = list(itertools.chain.from_iterable(encoded["ids"]))
            self._word_ids[split] = torch.tensor(ids, dtype=torch.long)
        return self._word_ids[split]

    def set_lightrnn_cells(self, cells: torch.Tensor) -> None:
        """Install a Hybrid-LightRNN table now; the loaders follow from their next pass (the
        code streams are re-encoded on demand)."""
        vocab = self.vocab
        if not isinstance(vocab, HybridLightRNNVocab):
            raise DataConfigError("the LightRNN table needs data.vocab=hybrid_lightrnn")
        vocab.set_cells(cells)
        self._tokens.clear()

    def schedule_lightrnn_cells(self, cells: torch.Tensor) -> None:
        """Install a re-assigned table when the next training pass starts. Until then the
        vocabulary keeps the table the current weights were trained with, so a checkpoint
        saved in between tests with that table and resumes with the new one."""
        vocab = self.vocab
        if not isinstance(vocab, HybridLightRNNVocab):
            raise DataConfigError("the LightRNN table needs data.vocab=hybrid_lightrnn")
        # checks the cells now (a bijection into the table), not at the next epoch
        HybridLightRNNVocab(vocab.words, vocab.num_frequent, vocab.rows, vocab.cols, cells)
        self._scheduled_cells = torch.as_tensor(cells, dtype=torch.long).clone()

    def install_scheduled_lightrnn_cells(self) -> None:
        if self._scheduled_cells is not None:
            self.set_lightrnn_cells(self._scheduled_cells)
            self._scheduled_cells = None

    def _batches(self, split: str, batch_size: int) -> DataLoader:
        return DataLoader(_LiveBPTT(self, split, batch_size), batch_size=None)

    def train_dataloader(self) -> DataLoader:
        # resumable: a mid-epoch checkpoint saves the position, `fit --ckpt_path` continues there
        return ResumableLoader(_LiveBPTT(self, "train", self.hparams.batch_size))

    def val_dataloader(self) -> DataLoader:
        return self._batches("valid", self.hparams.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self._batches("test", self.hparams.eval_batch_size)

    def predict_dataloader(self) -> DataLoader:
        prompts = self.hparams.predict_prompts
        if not prompts:
            raise DataConfigError(
                "predict needs prompts: set data.predict_prompts, e.g. "
                "--data.predict_prompts '[\"the company said\"]'"
            )
        items = [
            {
                "prompt": p,
                "ids": torch.tensor(
                    self.vocab.encode_line(p, add_eos=False) or [self.vocab.eos_id]
                ),
            }
            for p in prompts
        ]
        return DataLoader(items, batch_size=None)

    # -- checkpoint --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"vocab": self.vocab.state_dict()}
        if self._scheduled_cells is not None:
            state["lightrnn_scheduled_cells"] = self._scheduled_cells.tolist()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = _vocab_from_state(state_dict["vocab"])
        current = self.vocab
        if isinstance(saved, HybridLightRNNVocab) and isinstance(current, HybridLightRNNVocab):
            if saved.same_structure(current):
                # the learnt table is training state: continue with the checkpoint's
                self.set_lightrnn_cells(saved.cells)
                scheduled = state_dict.get("lightrnn_scheduled_cells")
                self._scheduled_cells = None if scheduled is None else torch.tensor(scheduled)
                return
        if saved != current:
            raise VocabularyMismatchError(
                f"the checkpoint was trained with another vocabulary ({len(saved)} tokens, "
                f"fingerprint {saved.fingerprint()}) than the data at {self.hparams.path!r} "
                f"gives ({len(self.vocab)} tokens, fingerprint {self.vocab.fingerprint()}); "
                f"point data.path at the corpus the checkpoint was trained on, and data.vocab "
                f"and its options at the checkpoint's ({state_dict['vocab'].get('type')})"
            )


def _vocab_from_state(state: dict[str, Any]) -> Vocab:
    kind = state.get("type", "word")
    if kind == "bpe":
        return BPEVocab.from_state_dict(state)
    if kind == "hybrid_lightrnn":
        return HybridLightRNNVocab.from_state_dict(state)
    return WordVocab.from_state_dict(state)
