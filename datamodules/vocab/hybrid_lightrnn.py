"""Hybrid-LightRNN vocabulary: frequent words own a code, the others a (row, column) cell.

The encoding table of the paper (section "Increasing the Capacity for Frequent Words") is

    A = [ D    UNK ]
        [ UNK  L   ]

``D`` is diagonal: the K most frequent words are written as one exclusive code each. ``L`` is
a dense d1 x d2 table: every other word owns one cell (r, c) and is written as the two codes
(row r, column c). The off-diagonal blocks are the invalid code pairs; they decode to
``<unk>``. Rows and columns get distinct codes, so the output layer has
``K + d1 + d2`` classes, in this *layout*:

    slots 0 .. K-1               the K most frequent words, by decreasing frequency
    slots K .. K+d1-1            the rows of L (first code of a rare word)
    slots K+d1 .. K+d1+d2-1      the columns of L (second code of a rare word)

The code ids (the classes a head sees) are the slots ranked by decreasing training count, as
every vocabulary's ids are (docs/design.md, "Data"): a row or column code stands for many
rare words, so it is far more frequent than most frequent words (on PTB with K = 2,800 and an
85 x 85 table, 145 of the 170 rank among the 300 most frequent codes, the rest by 1,202).
Heads rely on that order: Mixtape's own gates go to the lowest ids, adaptive softmax's head
cluster holds them, and output biases start at a Zipf prior over them. The ranking is counted
under the initial table and then fixed for the run (``layout_codes``): a class id never moves
under a training head, even when re-assigning the table changes the rows' and columns' counts.

The table (which cell each rare word owns) is re-learnt during training by
:mod:`datamodules.vocab.table_assignment`: a new table is scheduled (:meth:`schedule_cells`) and
installed when the next training pass starts. Both tables are part of the state dict, so a resumed
run continues with the table it had.

A word's probability is its code's, or ``P(row r | context) * P(column c | context, r)``
(paper, Eq. 4): one softmax over all the codes, as the paper's code LM. It also puts mass on
code sequences that spell no word (a column first, a row then a non-column or an empty cell),
so these probabilities sum to less than 1 over the words (brute-forced over PTB's 10k words:
0.80 to 0.92 after 120 training steps, 0.91 to 0.98 on a trained toy table). ``word_ppl`` and
``predict`` report them as they are, not renormalised (the paper's figure): the word perplexity
is an upper bound. Evaluation also logs ``word_ppl_renorm``, the model restricted to valid code
sequences by :meth:`grammar`, each code renormalised over the codes allowed after the previous
one: a distribution over the words (``lightning_modules/word_perplexity.py``), the one the
grammar-masked sampler draws from, comparable with a word-level head's perplexity.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from datamodules.vocab.code_grammar import CodeGrammar
from datamodules.vocab.word import EOS, WordVocab

log = logging.getLogger(__name__)
# Words encoded at a time: the [n, 2] int64 codes of a chunk are 64 MiB, whatever the corpus.
_CHUNK = 1 << 22


class HybridLightRNNVocab:
    """Words -> code sequences (1 code for frequent words, 2 for the others) and back.

    Args:
        words: the word vocabulary (ids sorted by decreasing frequency).
        num_frequent: K, the words with an exclusive code (ids ``0 .. K-1`` of ``words``).
        rows, cols: d1 x d2, the size of the shared table; ``K + d1 * d2 >= len(words)``.
        cells: for each rare word ``K + i``, its cell ``r * cols + c`` (default: frequency
            order, row by row).
        layout_codes: the code id of each slot (see the module docstring); default: the slots
            ranked by decreasing training count under ``cells`` (ties keep the layout order).
    """

    def __init__(
        self,
        words: WordVocab,
        num_frequent: int,
        rows: int,
        cols: int,
        cells: Sequence[int] | torch.Tensor | None = None,
        layout_codes: Sequence[int] | torch.Tensor | None = None,
    ) -> None:
        for name, value in (("num_frequent", num_frequent), ("rows", rows), ("cols", cols)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Hybrid-LightRNN {name} must be a positive integer, got {value!r}"
                )
        if num_frequent + rows * cols < len(words):
            raise ValueError(
                f"Hybrid-LightRNN table too small: K + d1*d2 = {num_frequent} + {rows}*{cols} = "
                f"{num_frequent + rows * cols} < {len(words)} words; raise K (frequent), d1 (rows) "
                f"or d2 (cols)"
            )
        if words.eos_id >= num_frequent:
            raise ValueError(
                f"{EOS} is word {words.eos_id} by frequency: num_frequent (K = {num_frequent}) "
                f"must be larger so that it keeps an exclusive code"
            )
        self.words = words
        self.num_frequent = num_frequent
        self.rows = rows
        self.cols = cols
        self.num_rare = max(len(words) - num_frequent, 0)
        self.unk_id = words.unk_id  # a word id: what invalid code sequences decode to
        self.version = 0  # bumped by every new table: the code streams change
        self.scheduled_cells: torch.Tensor | None = None
        self._grammar: tuple[tuple[int, str], CodeGrammar] | None = None  # (version, device)
        cells = self._checked_cells(torch.arange(self.num_rare) if cells is None else cells)
        if layout_codes is None:
            layout_codes = _rank_by_count(self._slot_counts(cells))
        self._set_layout(layout_codes)
        self.set_cells(cells)

    def _set_layout(self, layout_codes: Sequence[int] | torch.Tensor) -> None:
        """Install the code id of each slot (a permutation of the codes)."""
        codes = torch.as_tensor(layout_codes, dtype=torch.long).flatten().clone()
        if not torch.equal(codes.sort().values, torch.arange(len(self))):
            raise ValueError(f"layout_codes must be a permutation of the {len(self)} codes")
        self.layout_codes = codes
        self.layout_of_code = torch.empty_like(codes)
        self.layout_of_code[codes] = torch.arange(len(codes))
        self._layout_list = self.layout_of_code.tolist()  # decoding reads it code by code
        self.eos_id = int(codes[self.words.eos_id])  # <eos> is frequent: slot = its word id
        K = self.num_frequent
        names = (
            (self.words.itos[:K] + [f"<unused{i}>" for i in range(len(self.words), K)])
            + [f"<row{r}>" for r in range(self.rows)]
            + [f"<col{c}>" for c in range(self.cols)]
        )
        self.itos = [names[slot] for slot in self._layout_list]

    # -- construction --------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        lines: Iterable[str],
        num_frequent: int,
        rows: int | None = None,
        cols: int | None = None,
        init: str = "frequency",
        seed: int = 0,
        max_size: int | None = None,
        min_freq: int = 1,
    ) -> HybridLightRNNVocab:
        """Word vocabulary from ``lines`` (``max_size``, ``min_freq``: see
        :meth:`WordVocab.from_counts`), then the table (see :meth:`from_words`)."""
        return cls.from_words(
            WordVocab.build(lines, max_size, min_freq), num_frequent, rows, cols, init, seed
        )

    @classmethod
    def from_words(
        cls,
        words: WordVocab,
        num_frequent: int,
        rows: int | None = None,
        cols: int | None = None,
        init: str = "frequency",
        seed: int = 0,
    ) -> HybridLightRNNVocab:
        """The table over a word vocabulary, sized by :meth:`table_shape`."""
        if isinstance(num_frequent, int) and num_frequent >= len(words):
            raise ValueError(
                f"num_frequent (K = {num_frequent}) leaves no word for the table: the corpus "
                f"has {len(words)} words; set K below {len(words)}, or use the word vocabulary"
            )
        rare = len(words) - num_frequent if isinstance(num_frequent, int) else 1
        rows, cols = cls.table_shape(rare, rows, cols)
        return cls(words, num_frequent, rows, cols, cls.initial_cells(rare, rows, cols, init, seed))

    @staticmethod
    def table_shape(num_rare: int, rows: int | None, cols: int | None) -> tuple[int, int]:
        """d1 x d2 for ``num_rare`` rare words. Missing sides fit them: ``rows = ceil(sqrt(n))``
        and ``cols = ceil(n / rows)`` (nearly square, the fewest codes). A given table too small
        for the vocabulary (PTB's 85 x 85 on WikiText-103's 267k words) is grown to fit, keeping
        about its shape, with a warning: the vocabulary decides how many words need a cell."""
        if rows is None and cols is None:
            rows = math.ceil(math.sqrt(num_rare))
        if cols is None:
            cols = math.ceil(num_rare / rows) if isinstance(rows, int) and rows > 0 else rows
        if rows is None:
            rows = math.ceil(num_rare / cols) if isinstance(cols, int) and cols > 0 else cols
        valid = all(isinstance(v, int) and v > 0 for v in (rows, cols))
        if valid and rows * cols < num_rare:
            scale = math.sqrt(num_rare / (rows * cols))
            grown = max(rows, round(rows * scale))
            grown_cols = math.ceil(num_rare / grown)
            log.warning(
                "Hybrid-LightRNN table %d x %d (data.lightrnn_rows x data.lightrnn_cols) has "
                "%d cells for %d rare words: using %d x %d, sized from the vocabulary",
                rows, cols, rows * cols, num_rare, grown, grown_cols,
            )  # fmt: skip
            rows, cols = grown, grown_cols
        elif valid and rows * cols > 2 * num_rare:
            # Kept as asked (spare cells give the re-learnt table room), but a table pinned for
            # another corpus (PTB's 85 x 85 on a few hundred rare words) is mostly codes that
            # stand for no word: said once, with the size the vocabulary would choose.
            fit = HybridLightRNNVocab.table_shape(num_rare, None, None)
            log.warning(
                "Hybrid-LightRNN table %d x %d (data.lightrnn_rows x data.lightrnn_cols) has "
                "%d cells for %d rare words, more than half of them empty; set both to null to "
                "size it from the vocabulary (%d x %d)",
                rows, cols, rows * cols, num_rare, *fit,
            )  # fmt: skip
        return rows, cols

    @staticmethod
    def initial_cells(num_rare: int, rows: int, cols: int, init: str, seed: int) -> torch.Tensor:
        """``frequency``: rare words fill the table row by row in frequency order;
        ``random``: a random injective placement (seeded)."""
        if init == "frequency":
            return torch.arange(num_rare)
        if init == "random":
            generator = torch.Generator().manual_seed(seed)
            return torch.randperm(rows * cols, generator=generator)[:num_rare]
        raise ValueError(f"Hybrid-LightRNN init must be 'frequency' or 'random', got {init!r}")

    def set_cells(self, cells: Sequence[int] | torch.Tensor) -> None:
        """Install a new table (cell of each rare word); it must be injective."""
        self.cells = cells = self._checked_cells(cells)
        size = self.rows * self.cols
        # cell -> word id (-1: unused cell, decodes to <unk>)
        self.word_at = torch.full((size,), -1, dtype=torch.long)
        self.word_at[cells] = torch.arange(self.num_rare) + self.num_frequent
        # word id -> its codes; second code -1 for frequent words
        slots = self._word_slots(cells)
        self.word_codes = torch.where(slots >= 0, self.layout_codes[slots.clamp(min=0)], -1)
        self.version += 1

    def _word_slots(self, cells: torch.Tensor) -> torch.Tensor:
        """``[words, 2]``: each word's slots under the table ``cells`` (a frequent word's own
        slot and -1, or a rare word's row and column slots)."""
        K, n = self.num_frequent, len(self.words)
        slots = torch.full((n, 2), -1, dtype=torch.long)
        slots[: min(K, n), 0] = torch.arange(min(K, n))
        slots[K:, 0] = K + cells // self.cols
        slots[K:, 1] = K + self.rows + cells % self.cols
        return slots

    def _checked_cells(self, cells: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """``cells`` as a new int64 tensor, checked to be an injective table."""
        cells = torch.as_tensor(cells, dtype=torch.long).flatten().clone()
        if cells.numel() != self.num_rare:
            raise ValueError(f"expected a cell for each of {self.num_rare} rare words")
        size = self.rows * self.cols
        if cells.numel() and (cells.min() < 0 or cells.max() >= size):
            raise ValueError(f"cells must lie in [0, {size})")
        if torch.unique(cells).numel() != cells.numel():
            raise ValueError("two words share a table cell: the table must be a bijection")
        return cells

    def schedule_cells(self, cells: Sequence[int] | torch.Tensor) -> None:
        """Install a re-assigned table when the next training pass starts
        (:meth:`begin_training_pass`). Until then the vocabulary keeps the table the current
        weights were trained with, so a checkpoint saved in between tests with that table and
        resumes with the new one. The cells are checked now (a bijection into the table)."""
        self.scheduled_cells = self._checked_cells(cells)

    def with_cells(self, cells: Sequence[int] | torch.Tensor) -> HybridLightRNNVocab:
        """This vocabulary (same code ids) over another table."""
        return HybridLightRNNVocab(
            self.words, self.num_frequent, self.rows, self.cols, cells, self.layout_codes
        )

    def begin_training_pass(self) -> None:
        """A training pass starts: the scheduled table, if any, is installed."""
        if self.scheduled_cells is not None:
            self.set_cells(self.scheduled_cells)
            self.scheduled_cells = None

    # -- sizes and code kinds ----------------------------------------------------------
    def __len__(self) -> int:
        """Number of codes: the output layer's vocabulary size."""
        return self.num_frequent + self.rows + self.cols

    @property
    def num_codes(self) -> int:
        return len(self)

    @property
    def word_start_mask(self) -> torch.Tensor:
        """``[num_codes]`` bool: codes that begin a word (frequent codes and rows), so the
        number of words in a stretch of codes is the number of these."""
        mask = torch.ones(len(self), dtype=torch.bool)
        mask[self.col_codes] = False
        return mask

    @property
    def frequent_codes(self) -> torch.Tensor:
        """The code id of each frequent word (word id = position); a K past the words leaves
        codes that stand for nothing, not listed."""
        return self.word_codes[: self.num_frequent, 0]

    @property
    def row_codes(self) -> torch.Tensor:
        """``[rows]``: the code id of each row of the table."""
        return self.layout_codes[self.num_frequent : self.num_frequent + self.rows]

    @property
    def col_codes(self) -> torch.Tensor:
        """``[cols]``: the code id of each column of the table."""
        return self.layout_codes[self.num_frequent + self.rows :]

    @property
    def base(self) -> WordVocab:
        """The vocabulary of the cached ids: the words."""
        return self.words

    def _counts(self, units: torch.Tensor) -> torch.Tensor:
        """Training count of every code (or slot) in ``units`` ``[words, 2]``, each word's
        first and second (-1: none): a unit counts every word it stands for."""
        counts = torch.zeros(len(self), dtype=torch.long)
        per_word = torch.as_tensor(self.words.counts, dtype=torch.long)
        for column in units.unbind(1):
            used = column >= 0
            counts.index_add_(0, column[used], per_word[used])
        return counts

    def _slot_counts(self, cells: torch.Tensor) -> torch.Tensor:
        """Training count of every slot (layout order) under the table ``cells``."""
        return self._counts(self._word_slots(cells))

    def class_counts(self) -> np.ndarray:
        """Training count of every code (``[num_codes]``, int64): a code counts every word it
        stands for (a frequent word's own code, or a rare word's row and column)."""
        return self._counts(self.word_codes).numpy()

    def table(self) -> torch.Tensor:
        """``[rows, cols]`` word ids of the L table (-1 where unused)."""
        return self.word_at.view(self.rows, self.cols)

    def grammar(self, device: torch.device | str = "cpu") -> CodeGrammar:
        """Which code may follow which under the installed table (see
        :mod:`datamodules.vocab.code_grammar`), on ``device``; kept until the table changes."""
        key = (self.version, str(device))
        if self._grammar is None or self._grammar[0] != key:
            size, rows = len(self), self.row_codes
            occupied = self.table() >= 0  # [rows, cols]
            is_row = torch.zeros(size, dtype=torch.bool)
            is_row[rows] = True
            row_of = torch.zeros(size, dtype=torch.long)
            row_of[rows] = torch.arange(self.rows)
            word_start = torch.zeros(size, dtype=torch.bool)
            word_start[self.frequent_codes] = True
            # by value, not by a boolean mask: built in an evaluation step when the table
            # changes, where a mask's data-dependent size would read back (test_host_sync)
            word_start[rows] = occupied.any(1)
            columns = torch.zeros(self.rows, size, dtype=torch.bool)
            columns[:, self.col_codes] = occupied
            self._grammar = key, CodeGrammar(is_row, row_of, word_start, columns).to(device)
        return self._grammar[1]

    # -- encoding ------------------------------------------------------------------------
    def encode_word_ids(self, word_ids: torch.Tensor) -> torch.Tensor:
        """Word-id stream -> code stream (one code per frequent word, two per rare word), in
        the dtype of ``word_ids`` (int32 streams stay int32)."""
        parts = [
            self._encode_chunk(word_ids[i : i + _CHUNK]) for i in range(0, len(word_ids), _CHUNK)
        ]
        return torch.cat(parts) if parts else word_ids.new_empty(0)

    encode_stream = encode_word_ids

    def _encode_chunk(self, word_ids: torch.Tensor) -> torch.Tensor:
        codes = self.word_codes[word_ids.long()]  # [n, 2]
        # row-major: keeps (row, col) order, drops the -1 padding
        return codes[codes >= 0].to(word_ids.dtype)

    def count_stream(self, word_ids: torch.Tensor) -> int:
        """Length of the code stream of ``word_ids`` (it does not depend on the table)."""
        K = self.num_frequent
        rare = sum(
            int((word_ids[i : i + _CHUNK] >= K).sum()) for i in range(0, len(word_ids), _CHUNK)
        )
        return len(word_ids) + rare

    def encode_stream_range(self, word_ids: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``encode_word_ids(word_ids)[start:stop]`` without encoding the rest: a DDP rank's
        streams of a 100M-word corpus cost only its share of memory."""
        K, parts, position = self.num_frequent, [], 0
        for i in range(0, len(word_ids), _CHUNK):
            if position >= stop:
                break
            chunk = word_ids[i : i + _CHUNK]
            size = len(chunk) + int((chunk >= K).sum())
            if position + size > start:
                codes = self._encode_chunk(chunk)
                parts.append(codes[max(start - position, 0) : stop - position])
            position += size
        return torch.cat(parts) if parts else word_ids.new_empty(0)

    def encode_line(self, line: str, add_eos: bool = True) -> list[int]:
        word_ids = torch.tensor(self.words.encode_line(line, add_eos), dtype=torch.long)
        return self.encode_word_ids(word_ids).tolist()

    # -- decoding (generated sequences may be invalid) -------------------------------------
    def decode_word_ids(self, codes: Iterable[int]) -> list[int]:
        """Code sequence -> word ids. Invalid pieces become ``<unk>``: a column code without a
        row before it, a row code not followed by a column code (also at the end), an unused
        cell."""
        K, R = self.num_frequent, self.rows
        out: list[int] = []
        pending_row: int | None = None
        for code in codes:
            code = int(code)
            if not 0 <= code < len(self):
                raise ValueError(f"code {code} is outside [0, {len(self)})")
            slot = self._layout_list[code]
            if slot >= K + R:  # a column
                if pending_row is None:
                    out.append(self.unk_id)
                else:
                    word = int(self.word_at[pending_row * self.cols + slot - K - R])
                    out.append(word if word >= 0 else self.unk_id)
                pending_row = None
                continue
            if pending_row is not None:  # row without its column
                out.append(self.unk_id)
                pending_row = None
            if slot >= K:
                pending_row = slot - K
            else:
                out.append(slot)  # a frequent word's slot is its word id
        if pending_row is not None:
            out.append(self.unk_id)
        return out

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Code sequence -> words (like ``WordVocab.decode`` on the word ids)."""
        return self.words.decode(self.decode_word_ids(ids))

    def decode_words(self, ids: Iterable[int]) -> list[str]:
        """The words the codes spell, ``<unk>`` and ``<eos>`` included (same as ``decode``)."""
        return self.decode(ids)

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text back, ``<unk>`` and ``<eos>`` dropped."""
        return self.words.detokenize(self.decode_word_ids(ids))

    # -- identity and state ----------------------------------------------------------------
    def same_structure(self, other: HybridLightRNNVocab) -> bool:
        """Same words and same table shape (the table itself may differ)."""
        return self.words == other.words and (self.num_frequent, self.rows, self.cols) == (
            other.num_frequent,
            other.rows,
            other.cols,
        )

    def accepts(self, saved: object) -> bool:
        """Whether a checkpoint's vocabulary can be loaded: same words and table shape (the
        learnt table is training state, restored by :meth:`load_state_dict`)."""
        return isinstance(saved, HybridLightRNNVocab) and saved.same_structure(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with a checkpoint's code ids, table (and the table it had scheduled)."""
        self._set_layout(_saved_layout(state))
        self.set_cells(state["cells"])
        scheduled = state.get("scheduled_cells")
        self.scheduled_cells = None if scheduled is None else torch.tensor(scheduled)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, HybridLightRNNVocab)
            and self.same_structure(other)
            and torch.equal(self.cells, other.cells)
            and torch.equal(self.layout_codes, other.layout_codes)
        )

    def fingerprint(self) -> str:
        text = f"{self.words.fingerprint()} {self.num_frequent} {self.rows} {self.cols} "
        text += ",".join(map(str, self.cells.tolist()))
        text += " " + ",".join(map(str, self.layout_codes.tolist()))
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def state_dict(self) -> dict:
        state = {
            "type": "hybrid_lightrnn",
            "words": self.words.state_dict(),
            "num_frequent": self.num_frequent,
            "rows": self.rows,
            "cols": self.cols,
            "cells": self.cells.tolist(),
            "layout_codes": self.layout_codes.tolist(),
        }
        if self.scheduled_cells is not None:
            state["scheduled_cells"] = self.scheduled_cells.tolist()
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> HybridLightRNNVocab:
        if state.get("type") != "hybrid_lightrnn":
            raise ValueError(f"not a Hybrid-LightRNN vocabulary state (type {state.get('type')!r})")
        return cls(
            WordVocab.from_state_dict(state["words"]),
            state["num_frequent"],
            state["rows"],
            state["cols"],
            state["cells"],
            _saved_layout(state),
        )

    def table_text(self, max_rows: int = 10, max_words: int = 12) -> str:
        """Some rows of L with their words, as Table 6 of the paper (for TensorBoard)."""
        lines = []
        table = self.table()
        for r in range(min(self.rows, max_rows)):
            words = [self.words.itos[w] for w in table[r].tolist() if w >= 0][:max_words]
            lines.append(f"row {r}: " + " ".join(words))
        return "\n".join(lines)


def codes_text(vocab: object) -> str:
    """What a Hybrid-LightRNN vocabulary's ids stand for, for a log line ("" for others)."""
    if not isinstance(vocab, HybridLightRNNVocab):
        return ""
    return (
        f" for {len(vocab.words):,} words ({vocab.num_frequent:,} frequent words and the "
        f"{vocab.rows} rows and {vocab.cols} columns of the rare words' table)"
    )


def _rank_by_count(counts: torch.Tensor) -> torch.Tensor:
    """Code id of each slot: its rank by decreasing count (a stable sort: ties keep the
    layout order)."""
    order = torch.sort(counts, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(len(order))
    return ranks


def _saved_layout(state: dict) -> list[int]:
    """A saved vocabulary's code ids; checkpoints from before codes were ranked by count
    (no ``layout_codes``) used the layout itself."""
    if "layout_codes" in state:
        return state["layout_codes"]
    return list(range(state["num_frequent"] + state["rows"] + state["cols"]))
