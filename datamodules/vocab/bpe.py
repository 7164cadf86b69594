"""Byte-pair-encoding vocabulary: HuggingFace ``tokenizers`` BPE, ids re-ranked by frequency."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from datamodules.vocab.word import EOS, UNK

# Word-start marker of the Metaspace pre-tokenizer: makes the segmentation reversible.
META = "\u2581"


class BPEVocab:
    """Sub-word vocabulary trained with HuggingFace ``tokenizers`` BPE.

    Text is split on spaces with a ``\u2581`` word-start marker (Metaspace), so
    ``detokenize(encode_line(s)) == s`` for any text made of characters seen in training
    (leading and trailing spaces are stripped, as ``WordVocab`` ignores them too).
    ``<unk>`` and ``<eos>`` are special tokens: ``<eos>`` is appended at each line end, and
    a literal ``<unk>`` in the text (PTB writes rare words so) is the one ``<unk>`` token,
    as in ``WordVocab``. Our ids are the tokenizer's ids re-ranked by decreasing frequency
    on the training lines (DESIGN.md, "Vocabularies"), ties by the tokenizer's id.
    """

    def __init__(self, tokenizer: Tokenizer, itos: list[str], counts: list[int]) -> None:
        if tokenizer.get_vocab_size() != len(itos) or len(set(itos)) != len(itos):
            raise ValueError("BPE token list must be a permutation of the tokenizer's vocabulary")
        self.tokenizer = tokenizer
        self.itos = list(itos)
        self.counts = list(counts)
        self.stoi = {token: i for i, token in enumerate(self.itos)}
        # tokenizer id <-> our (frequency-ranked) id
        self._theirs = [tokenizer.token_to_id(token) for token in self.itos]
        if None in self._theirs:
            raise ValueError("a BPE token is missing from the tokenizer")
        self._ours = [0] * len(itos)
        for ours, theirs in enumerate(self._theirs):
            self._ours[theirs] = ours
        self.unk_id = self.stoi[UNK]
        self.eos_id = self.stoi[EOS]
        self.special_ids = frozenset((self.unk_id, self.eos_id))

    @staticmethod
    def _new_tokenizer() -> Tokenizer:
        tokenizer = Tokenizer(models.BPE(unk_token=UNK))
        # Strip applies to the text between special tokens, so " <unk> " leaves no lone marker.
        tokenizer.normalizer = normalizers.Strip()
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=META)
        tokenizer.decoder = decoders.Metaspace(replacement=META)
        return tokenizer

    @classmethod
    def build(cls, lines: Iterable[str], vocab_size: int) -> BPEVocab:
        """Train a BPE of ``vocab_size`` tokens (specials and alphabet included) on ``lines``."""
        if not isinstance(vocab_size, int) or vocab_size < 3:
            raise ValueError(f"BPE vocab_size must be an integer >= 3, got {vocab_size!r}")
        lines = list(lines)
        if not any(line.strip() for line in lines):
            raise ValueError("cannot build a BPE vocabulary from an empty corpus")
        tokenizer = cls._new_tokenizer()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[UNK, EOS], show_progress=False
        )
        tokenizer.train_from_iterator(lines, trainer)
        # Rank by frequency of use on the training lines (not merge order).
        counter: Counter[int] = Counter()
        for encoding in tokenizer.encode_batch(lines):
            counter.update(encoding.ids)
        counter[tokenizer.token_to_id(EOS)] += len(lines)
        size = tokenizer.get_vocab_size()
        order = sorted(range(size), key=lambda theirs: (-counter[theirs], theirs))
        itos = [tokenizer.id_to_token(theirs) for theirs in order]
        return cls(tokenizer, itos, [counter[theirs] for theirs in order])

    def __len__(self) -> int:
        return len(self.itos)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BPEVocab)
            and self.itos == other.itos
            and self.tokenizer.to_str() == other.tokenizer.to_str()
        )

    def encode_line(self, line: str, add_eos: bool = True) -> list[int]:
        ids = [self._ours[i] for i in self.tokenizer.encode(line).ids]
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_lines(self, lines: list[str], add_eos: bool = True) -> list[list[int]]:
        """Batch version of :meth:`encode_line` (the tokenizer encodes in parallel)."""
        ours = self._ours
        tail = [self.eos_id] if add_eos else []
        return [[ours[i] for i in e.ids] + tail for e in self.tokenizer.encode_batch(lines)]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """The token pieces (``\u2581`` marks a word start), like ``WordVocab.decode``."""
        return [self.itos[i] for i in ids]

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text back, special tokens dropped."""
        theirs = [self._theirs[i] for i in ids if i not in self.special_ids]
        return self.tokenizer.decode(theirs, skip_special_tokens=True)

    @property
    def word_start_mask(self) -> torch.Tensor:
        """``[len]`` bool: pieces that begin a word (``▁``-prefixed) and the specials
        (``<unk>`` stands for a whole word, ``<eos>`` is counted as a word as in ``WordVocab``),
        so a stretch of ids holds as many words as it has these."""
        return torch.tensor(
            [t.startswith(META) or i in self.special_ids for i, t in enumerate(self.itos)]
        )

    def fingerprint(self) -> str:
        """Short stable hash of the token list and merges, for error messages and caches."""
        text = "\n".join(self.itos) + self.tokenizer.to_str()
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def state_dict(self) -> dict:
        return {
            "type": "bpe",
            "tokenizer": self.tokenizer.to_str(),
            "tokens": self.itos,
            "counts": self.counts,
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> BPEVocab:
        if state.get("type") != "bpe":
            raise ValueError(f"not a BPE vocabulary state (type {state.get('type')!r})")
        return cls(Tokenizer.from_str(state["tokenizer"]), state["tokens"], state["counts"])

    def to_json(self) -> str:
        return json.dumps(self.state_dict())
