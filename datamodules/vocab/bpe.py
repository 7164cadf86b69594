"""Byte-pair-encoding vocabulary: HuggingFace ``tokenizers`` BPE, ids re-ranked by frequency."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from datamodules.vocab.stream import CachedIdsVocab
from datamodules.vocab.word import EOS, UNK, lengths_from_eos, words_of

# Word-start marker of the Metaspace pre-tokenizer: makes the segmentation reversible.
META = "\u2581"
# The BPE model's unknown token: a character never seen in training, inside a word (not a word
# of its own, unlike the <unk> word PTB writes for a rare word). Tokenizers trained before it
# existed use <unk> for both; they are loaded and encode as they did (``BPEVocab.unk_char_id``).
UNK_CHAR = "<unk_char>"
SPECIALS = (UNK, EOS, UNK_CHAR)  # the trainer's special tokens, in their tokenizer-id order
# Lines encoded as one piece "l1 <eos> l2 <eos> ...": the tokenizer splits on the special token
# and normalises each line on its own (spaces, Strip), so the ids are those of the lines encoded
# one by one, each followed by <eos> (tested); pieces are encoded in parallel, with a fraction of
# the per-line Python objects.
_LINES_PER_PIECE = 32
_EOS_JOIN = f" {EOS} "
# Every whitespace character (str.isspace: what str.split splits words on; tested).
_SPACES = (
    " \n\t\x0b\x0c\r\x1c\x1d\x1e\x1f\x85\xa0\u1680"
    + "".join(map(chr, range(0x2000, 0x200B)))
    + "\u2028\u2029\u202f\u205f\u3000"
)
# The tokenizer's normaliser turns each run of them into one space, so its words are those of
# str.split. A literal marker counts as a space too: Metaspace splits a word there anyway, and
# a word starting with one would otherwise encode differently alone (no marker prepended) and
# after a space. (No regex metacharacter among them; a single space, the common case, is left
# as it is: no replacement per word.)
_SPACE_RUN = f"[{_SPACES}{META}]{{2,}}|[{_SPACES[1:]}{META}]"
# For tokenizers without that normaliser (trained before it): whitespace at a line's ends that
# both Python's split and the tokenizer's Strip drop, and every whitespace character but the
# space and the line break, and the marker (those lines are encoded as they are).
_ENDS = " \t\n\r\x0b\x0c"
_OTHER_SPACE = re.compile(f"[{_SPACES[2:]}{META}]")


class _TypeIndex(dict):
    """Word type -> type id; a type not seen yet gets the next id and waits in ``new`` to be
    encoded (``map(index.__getitem__, words)`` stays a C loop for the types already seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.new: list[str] = []

    def __missing__(self, word: str) -> int:
        self[word] = index = len(self)
        self.new.append(word)
        return index


def written_unk(lines: list[str], token: str = UNK) -> int:
    """How many ``<unk>`` (or another special ``token``) the text itself writes (the tokenizer
    matches a special token anywhere, also inside a word)."""
    return sum(line.count(token) for line in lines if token in line)


def collapses_spaces(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer's normaliser makes every run of whitespace one space (those
    trained before it did not: there a double space or a tab makes other pieces)."""
    normalizer = tokenizer.normalizer
    probe = f"{_SPACES}a{_SPACES}{META}b{META}{_SPACES}"
    return normalizer is not None and normalizer.normalize_str(probe) == "a b"


class StreamEncoder:
    """Encodes line batches of a large corpus with a BPE tokenizer by word *type*.

    The normaliser makes every run of whitespace one space and the Metaspace pre-tokenizer
    encodes each space-separated word on its own (special tokens, which hold no whitespace,
    split a word the same way whether it stands alone or in its line), so a line encodes as
    the concatenation of the encodings of its ``str.split`` words. Each new type is encoded
    once by the tokenizer; the batch's ids are then gathered from that table with numpy: a
    Zipf corpus of 20M tokens has 250k types, so this is several times faster than encoding
    the running text. A tokenizer trained before that normaliser (:func:`collapses_spaces`)
    encodes a double space, a tab or a Unicode space inside a line otherwise: such batches are
    encoded directly. Either way the ids are those of :meth:`BPEVocab.encode_theirs` (tested).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.type_id = _TypeIndex()
        self.starts = np.zeros(0, dtype=np.int64)  # type -> its pieces in ``flat``
        self.lengths = np.zeros(0, dtype=np.int64)
        self.flat = np.zeros(0, dtype=np.int32)
        self.any_spacing = collapses_spaces(tokenizer)

    @staticmethod
    def single_spaced(lines: list[str]) -> bool:
        """Whether the words of every line are separated by single spaces (whitespace at the
        ends of a line, which the tokenizer strips, aside) and hold no ``\u2581``: what a
        tokenizer that does not collapse spaces needs to encode by word type."""
        text = "\n".join(lines)
        if text.count("\n") != len(lines) - 1:  # line breaks in a line (hub rows end with one)
            text = "\n".join(line.strip(_ENDS) for line in lines)
            if text.count("\n") != len(lines) - 1:
                return False
        return "  " not in text and not _OTHER_SPACE.search(text)

    def encode(self, lines: list[str]) -> np.ndarray:
        """The tokenizer's ids of ``lines``, ``<eos>`` after each (int32)."""
        if not lines:
            return np.empty(0, dtype=np.int32)
        if not self.any_spacing and not self.single_spaced(lines):
            return BPEVocab.encode_theirs(self.tokenizer, lines)
        words = words_of(lines)  # <eos> after each line: a type that encodes to <eos>
        type_ids = np.fromiter(map(self.type_id.__getitem__, words), np.int64, len(words))
        if self.type_id.new:
            self._add(self.type_id.new)
            self.type_id.new = []
        lengths = self.lengths[type_ids]
        ends = np.cumsum(lengths)
        # output position p of word k reads flat[starts[k] + p - (ends[k] - lengths[k])]
        offsets = np.repeat(self.starts[type_ids] - (ends - lengths), lengths)
        return self.flat[offsets + np.arange(int(ends[-1]))]

    def _add(self, new: list[str]) -> None:
        encodings = self.tokenizer.encode_batch_fast(new, add_special_tokens=False)
        pieces = [np.asarray(e.ids, dtype=np.int32) for e in encodings]
        lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        self.starts = np.concatenate([self.starts, len(self.flat) + np.cumsum(lengths) - lengths])
        self.lengths = np.concatenate([self.lengths, lengths])
        self.flat = np.concatenate([self.flat, *pieces])


class BPEVocab(CachedIdsVocab):
    """Sub-word vocabulary trained with HuggingFace ``tokenizers`` BPE.

    Runs of whitespace become one space and the text is split on spaces with a ``\u2581``
    word-start marker (Metaspace), so the words are those of ``WordVocab`` (``str.split``;
    a literal ``\u2581`` separates words too) and ``detokenize(encode_line(s)) ==
    " ".join(s.split())`` for any text made of characters seen in training. ``<unk>``,
    ``<eos>`` and ``<unk_char>`` are special tokens: ``<eos>`` is appended at each line end,
    a literal ``<unk>`` in the text (PTB writes rare words so) is the one ``<unk>`` token, a
    word as in ``WordVocab``, and ``<unk_char>`` stands for a character never seen in
    training, inside its word. Our ids are the tokenizer's ids re-ranked by decreasing
    frequency on the training lines (docs/design.md, "Data"), ties by the tokenizer's id.

    A tokenizer trained before ``<unk_char>`` and the whitespace normaliser (in an older
    checkpoint) keeps its behaviour: ``<unk>`` also for an unseen character (a word start
    there), and a lone ``\u2581`` piece for a double space.
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
        self._ours_array = np.asarray(self._ours, dtype=np.int32)
        self._stream: StreamEncoder | None = None
        self.unk_id = self.stoi[UNK]
        self.eos_id = self.stoi[EOS]
        # the specials that are words of their own (word starts, words in decode_words)
        self.special_ids = frozenset((self.unk_id, self.eos_id))
        # the unseen character's token, None for a tokenizer whose <unk> is also that
        self.unk_char_id = self.stoi[UNK_CHAR] if tokenizer.model.unk_token == UNK_CHAR else None
        self._dropped = self.special_ids | {self.unk_char_id}  # what detokenize leaves out

    @staticmethod
    def _new_tokenizer() -> Tokenizer:
        tokenizer = Tokenizer(models.BPE(unk_token=UNK_CHAR))
        # Normalisers apply to the text between special tokens: whitespace runs become one
        # space (no lone marker for a double space, a tab separates words as in str.split) and
        # Strip leaves no lone marker around " <unk> ".
        tokenizer.normalizer = normalizers.Sequence(
            [normalizers.Replace(Regex(_SPACE_RUN), " "), normalizers.Strip()]
        )
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement=META)
        tokenizer.decoder = decoders.Metaspace(replacement=META)
        return tokenizer

    @classmethod
    def train_tokenizer(
        cls, line_batches: Iterable[list[str]], vocab_size: int, show_progress: bool = False
    ) -> Tokenizer:
        """Train the BPE of ``vocab_size`` tokens (specials and alphabet included) on a stream
        of line batches (read once; the tokenizer counts words in Rust)."""
        if not isinstance(vocab_size, int) or vocab_size < 3:
            raise ValueError(f"BPE vocab_size must be an integer >= 3, got {vocab_size!r}")
        has_text = False

        def checked() -> Iterator[list[str]]:
            nonlocal has_text
            for lines in line_batches:
                has_text = has_text or any(line.strip() for line in lines)
                yield lines

        tokenizer = cls._new_tokenizer()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=list(SPECIALS), show_progress=show_progress
        )
        tokenizer.train_from_iterator(checked(), trainer)
        if not has_text:
            raise ValueError("cannot build a BPE vocabulary from an empty corpus")
        return tokenizer

    @staticmethod
    def encode_theirs(tokenizer: Tokenizer, lines: list[str]) -> np.ndarray:
        """The tokenizer's ids of ``lines``, ``<eos>`` after each, concatenated (int32)."""
        pieces = [
            _EOS_JOIN.join(lines[i : i + _LINES_PER_PIECE]) + _EOS_JOIN
            for i in range(0, len(lines), _LINES_PER_PIECE)
        ]
        encodings = tokenizer.encode_batch_fast(pieces, add_special_tokens=False)
        if not encodings:
            return np.empty(0, dtype=np.int32)
        return np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in encodings])

    @classmethod
    def from_counts(cls, tokenizer: Tokenizer, counts: np.ndarray) -> BPEVocab:
        """Our ids: the tokenizer's re-ranked by decreasing ``counts`` (uses of each of its ids
        on the training lines, ``np.bincount`` of :meth:`encode_theirs`), ties by its id."""
        counts = np.asarray(counts, dtype=np.int64)
        order = np.argsort(-counts, kind="stable")
        itos = [tokenizer.id_to_token(int(theirs)) for theirs in order]
        return cls(tokenizer, itos, counts[order].tolist())

    @classmethod
    def build(cls, lines: Iterable[str], vocab_size: int) -> BPEVocab:
        """Train a BPE of ``vocab_size`` tokens (specials and alphabet included) on ``lines``."""
        lines = list(lines)
        tokenizer = cls.train_tokenizer([lines], vocab_size)
        theirs = cls.encode_theirs(tokenizer, lines)
        return cls.from_counts(tokenizer, np.bincount(theirs, minlength=tokenizer.get_vocab_size()))

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

    def to_ours(self, theirs: np.ndarray) -> np.ndarray:
        """Tokenizer ids -> our (frequency-ranked) ids, int32."""
        return self._ours_array[theirs]

    def encode_batch(self, lines: list[str]) -> np.ndarray:
        """``[encode_line(l) for l in lines]`` concatenated, int32, without per-token Python
        objects (:class:`StreamEncoder`)."""
        if self._stream is None:
            self._stream = StreamEncoder(self.tokenizer)
        return self.to_ours(self._stream.encode(lines))

    def encode_batch_unknown(self, lines: list[str]) -> tuple[np.ndarray, int]:
        """``encode_batch(lines)`` and how many of its ids are ``<unk_char>`` for characters
        the BPE never saw (one each; a ``<unk_char>`` written in the text, matched anywhere as
        the special token it is, is not counted). For an older tokenizer: its ``<unk>`` ids
        but those the text writes."""
        ids = self.encode_batch(lines)
        if self.unk_char_id is None:
            return ids, int(np.count_nonzero(ids == self.unk_id)) - written_unk(lines)
        unknown = int(np.count_nonzero(ids == self.unk_char_id))
        return ids, unknown - (written_unk(lines, UNK_CHAR) if unknown else 0)

    def line_lengths(self, lines: list[str], ids: np.ndarray) -> np.ndarray:
        """Ids per line of ``ids = encode_batch(lines)`` (``<eos>`` included)."""
        return self.theirs_line_lengths(self.tokenizer, lines, ids, self.eos_id)

    @staticmethod
    def theirs_line_lengths(
        tokenizer: Tokenizer, lines: list[str], ids: np.ndarray, eos_id: int
    ) -> np.ndarray:
        """Ids per line of ``ids``, the encoding of ``lines`` (our ids or the tokenizer's:
        ``eos_id`` says which ``<eos>`` to look for)."""
        lengths = lengths_from_eos(ids, eos_id, len(lines))
        if lengths is None:  # a literal <eos> inside a line: encode line by line
            encodings = tokenizer.encode_batch_fast(lines, add_special_tokens=False)
            lengths = np.fromiter((len(e.ids) + 1 for e in encodings), np.int64, len(lines))
        return lengths

    def decode(self, ids: Iterable[int]) -> list[str]:
        """The token pieces (``\u2581`` marks a word start), like ``WordVocab.decode``."""
        return [self.itos[i] for i in ids]

    def decode_words(self, ids: Iterable[int]) -> list[str]:
        """The words the pieces spell: a ``▁`` piece starts a word, any other piece
        continues the current one; ``<unk>`` and ``<eos>`` stay words of their own (a sampled
        continuation shows them, where ``detokenize`` drops them). ``<unk_char>`` continues
        its word and spells nothing, as the tokenizer writes it."""
        words: list[str] = []
        joinable = False  # whether the next plain piece continues the last word
        for i in ids:
            piece = "" if i == self.unk_char_id else self.itos[i]
            if i in self.special_ids:
                words.append(piece)
                joinable = False
            elif piece.startswith(META) or not joinable:
                words.append(piece.removeprefix(META))
                joinable = True
            else:
                words[-1] += piece
        return [word for word in words if word]  # a lone marker before a word start spells none

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text back, special tokens (and unseen characters) dropped."""
        theirs = [self._theirs[i] for i in ids if i not in self._dropped]
        return self.tokenizer.decode(theirs, skip_special_tokens=True)

    @property
    def word_start_mask(self) -> torch.Tensor:
        """``[len]`` bool: pieces that begin a word (``▁``-prefixed) and the specials
        (``<unk>`` stands for a whole word, ``<eos>`` is counted as a word as in ``WordVocab``),
        so a stretch of ids holds as many words as it has these, the words of ``str.split``
        and one per line. ``<unk_char>`` (an unseen character) is inside its word."""
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


def warn_if_other_bpe_size(size: int, asked: int, log: logging.Logger) -> None:
    """A warning line when the BPE's vocabulary is not the ``bpe_vocab_size`` asked: smaller
    where the training text supports fewer pieces (every word type already one piece), larger
    where its characters alone (each a piece, with the special tokens) are more."""
    if size > asked:
        log.warning(
            "data.bpe_vocab_size asked %d tokens but the training text's characters and the "
            "special tokens alone are %d: the BPE vocabulary has %d (no merge learnt)",
            asked,
            size,
            size,
        )
    if size < asked:
        log.warning(
            "data.bpe_vocab_size asked %d tokens but the training text gives only %d (every word "
            "is one piece by then): the BPE vocabulary has %d",
            asked,
            size,
            size,
        )
