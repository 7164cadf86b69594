"""Language-modelling data: word vocabulary, cached tokenisation, truncated-BPTT batches."""

from __future__ import annotations

import itertools
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from app.vocab import VocabularyMismatchError, WordVocab
from datamodules.bptt import BPTTBatches
from datamodules.text_source import DataConfigError, load_text_splits


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
        max_vocab_size: keep only the most frequent words (others become ``<unk>``).
        predict_prompts: texts whose continuation ``predict`` reports.
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
    ) -> None:
        super().__init__()
        for name, value in (
            ("batch_size", batch_size),
            ("eval_batch_size", eval_batch_size),
            ("bptt", bptt),
        ):
            if not isinstance(value, int) or value <= 0:
                raise DataConfigError(f"data.{name} must be a positive integer, got {value!r}")
        self.save_hyperparameters()
        self._splits = None
        self._vocab: WordVocab | None = None
        self._tokens: dict[str, torch.Tensor] = {}

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
    def vocab(self) -> WordVocab:
        if self._vocab is None:
            self._vocab = WordVocab.build(self.splits["train"]["text"], self.hparams.max_vocab_size)
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    # -- tokens ------------------------------------------------------------------------
    def split_tokens(self, split: str) -> torch.Tensor:
        """All ids of a split as one stream (``<eos>`` after every line)."""
        if split not in self._tokens:
            vocab = self.vocab
            encoded = self.splits[split].map(
                lambda batch: {"ids": [vocab.encode_line(t) for t in batch["text"]]},
                batched=True,
                remove_columns=["text"],
                desc=f"tokenising {split}",
            )
            ids = list(itertools.chain.from_iterable(encoded["ids"]))
            self._tokens[split] = torch.tensor(ids, dtype=torch.long)
        return self._tokens[split]

    def _batches(self, split: str, batch_size: int) -> DataLoader:
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        dataset = BPTTBatches(self.split_tokens(split), batch_size, self.hparams.bptt, rank, world)
        return DataLoader(dataset, batch_size=None)

    def train_dataloader(self) -> DataLoader:
        return self._batches("train", self.hparams.batch_size)

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
        return {"vocab": self.vocab.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = WordVocab.from_state_dict(state_dict["vocab"])
        if saved != self.vocab:
            raise VocabularyMismatchError(
                f"the checkpoint was trained with another vocabulary ({len(saved)} tokens, "
                f"fingerprint {saved.fingerprint()}) than the data at {self.hparams.path!r} "
                f"gives ({len(self.vocab)} tokens, fingerprint {self.vocab.fingerprint()}); "
                f"point data.path at the corpus the checkpoint was trained on"
            )
