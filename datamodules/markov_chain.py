"""A synthetic corpus whose best possible model is known exactly: a stationary Markov chain over
``V`` tokens whose log-transition matrix has a chosen rank ``r`` (the softmax bottleneck's
test bed, MoS paper Sec. 2: a softmax over ``d`` inputs reaches rank ``d + 1`` at most).

The chain (order ``k``, contexts = the last ``k`` tokens, ``C = V^k`` of them), from ``seed``::

    logits[c, x] = scale * a_c . m_x + zipf_x        a_c ~ N(0, I_r') per context
    P(x | c)     = softmax_x(logits[c])

with ``zipf_x = -log(x + 1)`` (a Zipf-shaped unigram, so that frequency-sorted heads and the
adaptive cut-offs see a realistic skew) and the token factors ``m_x``:

- ``clustered`` (default): ``r`` clusters, ``m_x`` the one-hot of ``x``'s cluster: the next
  token's cluster depends on the context, the token within a cluster only on the Zipf term
  (class-factored language). The row-centred log-transition matrix has rank exactly ``r``
  (``r - 1`` independent cluster directions after centring, plus the Zipf column).
- ``gaussian``: ``m_x ~ N(0, I_{r-1} / (r-1))``: a generic rank-``r`` matrix (``r - 1``
  directions plus the Zipf column).

Token ids are then re-labelled by decreasing stationary frequency (what every vocabulary here
guarantees). The stationary distribution ``pi`` over contexts is found by power iteration
(every transition has positive probability, so the chain is ergodic) and the entropy rate
``H = sum_c pi_c H(P(. | c))`` is the exact optimum cross-entropy of any model of the chain
(nats per token). Each split is one stretch of the same chain started from ``pi`` (train,
then valid, then test); ``optimum_nll[split]`` is the true chain's mean NLL on that split's
transitions: the best any model can score on exactly those tokens (it differs from ``H`` by
sampling noise only).

Prepared once into a cache entry (``datamodules/cache.py``) keyed by every option above, as
the text corpora are: ``chain.json`` (entropy rate, optimum per split, rank...),
``log_transitions.npy`` (``[C, V]`` float64) and the splits' int32 token files, memory-mapped
after. Batches are the text corpora's contiguous BPTT windows.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader

from datamodules.bptt import StreamWindows, stream_layout
from datamodules.cache import CacheEntry, cache_root, splits_to_prepare
from datamodules.errors import DataConfigError, VocabularyMismatchError
from datamodules.resumable import ResumableLoader

log = logging.getLogger(__name__)

STRUCTURES = ("clustered", "gaussian")
SPLITS = ("train", "valid", "test")
# Bump when the chain or its sampling changes: cached corpora of older versions are ignored.
GENERATOR_VERSION = 1
# contexts x vocabulary entries of the transition matrix (float64): 2^26 = 512 MiB at most
MAX_MATRIX_ENTRIES = 1 << 26


class MarkovChain:
    """The chain itself: ``log_transitions [V^order, V]`` (float64, rows normalised, ids sorted
    by decreasing frequency), its stationary distribution over contexts and entropy rate.
    A context ``(t_1, ..., t_k)`` (oldest first) is row ``sum_i t_i V^(k - i)``."""

    def __init__(self, log_transitions: np.ndarray, order: int = 1) -> None:
        self.log_transitions = np.asarray(log_transitions, dtype=np.float64)
        self.order = order
        self.vocab_size = self.log_transitions.shape[1]
        if self.log_transitions.shape[0] != self.vocab_size**order:
            raise ValueError(
                f"{self.log_transitions.shape[0]} contexts for V = {self.vocab_size} and order "
                f"{order} (expected V^order)"
            )
        self.stationary = stationary_distribution(self.log_transitions, order)

    @classmethod
    def generate(
        cls,
        vocab_size: int,
        rank: int,
        order: int = 1,
        structure: str = "clustered",
        scale: float = 3.0,
        seed: int = 0,
    ) -> MarkovChain:
        """The chain of the module docstring, a function of its arguments only."""
        v, contexts = vocab_size, vocab_size**order
        rng = np.random.default_rng(seed)
        if structure == "clustered":
            directions = rng.standard_normal((contexts, rank))
            factors = np.eye(rank)[rng.permutation(v) % rank]  # one-hot cluster of each token
        else:
            directions = rng.standard_normal((contexts, rank - 1))
            factors = rng.standard_normal((v, rank - 1)) / math.sqrt(rank - 1)
        zipf = -np.log(np.arange(1, v + 1, dtype=np.float64))
        logits = scale * directions @ factors.T + zipf
        log_p = logits - _logsumexp(logits)
        # re-label the tokens by decreasing stationary frequency (of the predicted token)
        unigram = cls(log_p, order).unigram
        sort = np.argsort(-unigram, kind="stable")  # new id -> old id
        for axis in range(order):
            shape = (v,) * order + (v,)
            log_p = np.take(log_p.reshape(shape), sort, axis=axis).reshape(contexts, v)
        return cls(log_p[:, sort], order)

    @property
    def unigram(self) -> np.ndarray:
        """Stationary frequency of each token (the distribution of the predicted token)."""
        p = np.exp(self.log_transitions)
        return self.stationary @ p

    @property
    def entropy_rate(self) -> float:
        """``sum_c pi_c H(P(. | c))`` in nats per token: the optimum cross-entropy."""
        p = np.exp(self.log_transitions)
        row_entropy = -(p * self.log_transitions).sum(axis=1)
        return float(self.stationary @ row_entropy)

    def centred_rank(self, relative_tolerance: float = 1e-9) -> int:
        """Numerical rank of the row-centred log-transition matrix (what ``app.rank`` measures
        of a model): singular values above ``relative_tolerance * sigma_1``."""
        matrix = self.log_transitions - self.log_transitions.mean(axis=1, keepdims=True)
        values = np.linalg.svd(matrix, compute_uv=False)
        return int((values > relative_tolerance * values[0]).sum())

    def sample(self, num_tokens: int, seed: int) -> np.ndarray:
        """``num_tokens`` consecutive states of the stationary chain (int32), the first
        ``order`` drawn from the stationary distribution over contexts."""
        rng = np.random.default_rng(seed)
        v, k = self.vocab_size, self.order
        cdf = np.cumsum(np.exp(self.log_transitions), axis=1)
        cdf /= cdf[:, -1:]
        out = np.empty(num_tokens, dtype=np.int32)
        start = int(
            np.searchsorted(np.cumsum(self.stationary), rng.random() * self.stationary.sum())
        )
        start = min(start, len(self.stationary) - 1)
        first = [(start // v ** (k - 1 - i)) % v for i in range(k)]
        out[: min(k, num_tokens)] = first[:num_tokens]
        uniforms = rng.random(num_tokens)
        context, modulus = start, v ** (k - 1)
        rows = list(cdf)  # row views: faster to index than the 2-D array in the loop
        for t in range(k, num_tokens):
            token = int(rows[context].searchsorted(uniforms[t], side="right"))
            token = min(token, v - 1)
            out[t] = token
            context = (context % modulus) * v + token if k > 1 else token
        return out

    def nll(self, tokens: np.ndarray) -> np.ndarray:
        """The true chain's NLL of each token after the first ``order`` (float64)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        k, v = self.order, self.vocab_size
        if len(tokens) <= k:
            return np.empty(0)
        context = np.zeros(len(tokens) - k, dtype=np.int64)
        for i in range(k):
            context = context * v + tokens[i : len(tokens) - k + i]
        return -self.log_transitions[context, tokens[k:]]


def _logsumexp(logits: np.ndarray) -> np.ndarray:
    top = logits.max(axis=1, keepdims=True)
    return top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True))


def stationary_distribution(
    log_transitions: np.ndarray, order: int = 1, tolerance: float = 1e-14, max_steps: int = 100_000
) -> np.ndarray:
    """The stationary distribution over contexts (``[V^order]``) by power iteration: context
    ``(t_1..t_k)`` moves to ``(t_2..t_k, x)`` with probability ``P(x | t_1..t_k)``."""
    p = np.exp(log_transitions)
    contexts, v = p.shape
    pi = np.full(contexts, 1.0 / contexts)
    blocks = p.reshape(v, contexts // v, v)  # [t_1, (t_2..t_k), x]
    for _ in range(max_steps):
        new = np.einsum("ab,abx->bx", pi.reshape(v, contexts // v), blocks).reshape(contexts)
        new /= new.sum()
        if np.abs(new - pi).max() < tolerance:
            return new
        pi = new
    return pi


class MarkovChainDataModule(L.LightningDataModule):
    """Language-modelling batches from the synthetic Markov chain (module docstring); text-free.

    Args:
        vocab_size: V, the number of tokens.
        rank: r, the rank of the row-centred log-transition matrix (2 <= r <= V).
        order: k, how many previous tokens the next one depends on (``V^k`` contexts).
        structure: ``clustered`` (r clusters of tokens) or ``gaussian`` (generic factors).
        scale: standard deviation of a context's cluster (or factor) logits: larger is peakier.
        train_tokens, valid_tokens, test_tokens: size of each split.
        seed: the chain and its samples are a function of this seed (and the options) only.
        batch_size, eval_batch_size, bptt: the BPTT layout, as for the text corpora.
        cache_dir: folder of prepared corpora (default ``data/`` under ``$OUTPUT_HEADS_CACHE``,
            else ``${XDG_CACHE_HOME:-~/.cache}/output-heads``).
    """

    def __init__(
        self,
        vocab_size: int = 1024,
        rank: int = 32,
        order: int = 1,
        structure: str = "clustered",
        scale: float = 3.0,
        train_tokens: int = 1_000_000,
        valid_tokens: int = 100_000,
        test_tokens: int = 100_000,
        seed: int = 0,
        batch_size: int = 64,
        eval_batch_size: int = 64,
        bptt: int = 32,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        for option, value in (
            ("vocab_size", vocab_size), ("rank", rank), ("order", order),
            ("train_tokens", train_tokens), ("valid_tokens", valid_tokens),
            ("test_tokens", test_tokens), ("batch_size", batch_size),
            ("eval_batch_size", eval_batch_size), ("bptt", bptt),
        ):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise DataConfigError(f"data.{option} must be a positive integer, got {value!r}")
        if vocab_size < 2:
            raise DataConfigError(f"data.vocab_size must be at least 2, got {vocab_size}")
        if not 2 <= rank <= vocab_size:
            raise DataConfigError(f"data.rank must be in [2, vocab_size={vocab_size}], got {rank}")
        if structure not in STRUCTURES:
            raise DataConfigError(
                f"data.structure must be one of {', '.join(STRUCTURES)}, got {structure!r}"
            )
        if not (isinstance(scale, int | float) and scale > 0 and math.isfinite(scale)):
            raise DataConfigError(f"data.scale must be a positive number, got {scale!r}")
        if vocab_size**order * vocab_size > MAX_MATRIX_ENTRIES:
            raise DataConfigError(
                f"data.vocab_size={vocab_size} with data.order={order} needs a "
                f"{vocab_size**order:,} x {vocab_size:,} transition matrix (over "
                f"{MAX_MATRIX_ENTRIES:,} entries): lower the order or the vocabulary"
            )
        self.save_hyperparameters()
        self.bptt = bptt
        self.tokens = {"train": train_tokens, "valid": valid_tokens, "test": test_tokens}
        self._cache: CacheEntry | None = None
        self._chain: MarkovChain | None = None
        self._ids: dict[str, torch.Tensor] = {}
        self._summary: dict[str, Any] | None = None

    def __repr__(self) -> str:
        hp = self.hparams
        return (
            f"{type(self).__name__}(V={hp.vocab_size}, r={hp.rank}, order={hp.order}, "
            f"{hp.structure}, seed={hp.seed})"
        )

    __str__ = __repr__

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ids"] = {}
        return state

    # -- the cache entry: chain.json, log_transitions.npy and the splits' ids -----------------
    @property
    def material(self) -> dict[str, Any]:
        """Everything the corpus depends on (the cache key)."""
        hp = self.hparams
        return {
            "task": "markov_chain",
            "generator": GENERATOR_VERSION,
            **{k: hp[k] for k in ("vocab_size", "rank", "order", "structure", "scale", "seed")},
            "tokens": self.tokens,
        }

    @property
    def cache(self) -> CacheEntry:
        if self._cache is None:
            hp = self.hparams
            label = f"markov-V{hp.vocab_size}-r{hp.rank}-k{hp.order}-{hp.structure}-s{hp.seed}"
            self._cache = CacheEntry(cache_root(hp.cache_dir), label, self.material)
        return self._cache

    def _prepared(self) -> bool:
        cache = self.cache
        return cache.has("chain.json") and all(cache.has_ids(s) for s in SPLITS)

    def _build(self) -> None:
        hp, cache = self.hparams, self.cache
        chain = MarkovChain.generate(
            hp.vocab_size, hp.rank, hp.order, hp.structure, hp.scale, hp.seed
        )
        with cache._atomic("log_transitions.npy") as temp:
            with temp.open("wb") as handle:
                np.save(handle, chain.log_transitions)
        total = sum(self.tokens.values())
        tokens = chain.sample(total, seed=hp.seed + 1)
        optimum, start = {}, 0
        for split in SPLITS:
            part = tokens[start : start + self.tokens[split]]
            start += self.tokens[split]
            optimum[split] = float(chain.nll(part).mean())
            cache.write_ids(split, [part], optimum_nll=optimum[split])
        summary = {
            "vocab_size": hp.vocab_size,
            "rank": hp.rank,
            "centred_rank": chain.centred_rank(),
            "order": hp.order,
            "structure": hp.structure,
            "scale": hp.scale,
            "seed": hp.seed,
            "entropy_rate": chain.entropy_rate,
            "optimum_nll": optimum,
            "unigram_entropy": float(-(chain.unigram * np.log(chain.unigram)).sum()),
            "tokens": self.tokens,
        }
        cache.write_json("chain.json", summary)  # last: its presence means the entry is whole

    def prepare_data(self) -> None:
        self.cache.ensure(self._prepared, self._build, f"the Markov chain {self!r}")

    def setup(self, stage: str | None = None) -> None:
        for split in splits_to_prepare(self.trainer, stage):
            self.split_tokens(split)

    @property
    def summary(self) -> dict[str, Any]:
        """``chain.json``: the entropy rate (optimum), the optimum per split, the rank..."""
        if self._summary is None:
            self.prepare_data()
            self._summary = self.cache.read_json("chain.json")
        return self._summary

    @property
    def entropy_rate(self) -> float:
        return float(self.summary["entropy_rate"])

    def optimum_nll(self, split: str) -> float:
        """The true chain's mean NLL on ``split`` (``train``, ``valid``/``val``, ``test``)."""
        split = "valid" if split == "val" else split
        return float(self.summary["optimum_nll"][split])

    @property
    def chain(self) -> MarkovChain:
        """The chain (from the cache: its log-transition matrix)."""
        if self._chain is None:
            self.prepare_data()
            matrix = np.load(self.cache.path / "log_transitions.npy")
            self._chain = MarkovChain(matrix, self.hparams.order)
        return self._chain

    def split_tokens(self, split: str) -> torch.Tensor:
        """A split's token ids, int32, memory-mapped from the cache."""
        if split not in self._ids:
            if not self._ids:
                self.prepare_data()
            self._ids[split] = torch.from_numpy(self.cache.ids(split))
        return self._ids[split]

    def num_tokens(self, split: str) -> int:
        return len(self.split_tokens(split))

    def rank_streams(self, split: str, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
        """This rank's ``[batch_size / world_size, stream_len]`` block of BPTT streams."""
        start, streams, stream_len = stream_layout(
            self.num_tokens(split), batch_size, rank, world_size
        )
        return self.split_tokens(split)[start : start + streams * stream_len].view(
            streams, stream_len
        )

    # -- what the CLI and the heads read -------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hparams.vocab_size

    @property
    def word_start_mask(self) -> None:
        return None  # every id is a token: no word-level perplexity

    @property
    def token_counts(self) -> np.ndarray:
        """Training count of every token id (for adaptive ``cutoffs: auto``)."""
        return np.bincount(self.split_tokens("train").numpy(), minlength=self.vocab_size)

    # -- loaders -------------------------------------------------------------------------------
    def _windows(self, split: str, batch_size: int) -> StreamWindows:
        return StreamWindows(self, split, batch_size, self.hparams.bptt, self.num_tokens(split))

    def train_dataloader(self) -> DataLoader:
        return ResumableLoader(self._windows("train", self.hparams.batch_size))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._windows("valid", self.hparams.eval_batch_size), batch_size=None)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self._windows("test", self.hparams.eval_batch_size), batch_size=None)

    def predict_dataloader(self) -> DataLoader:
        raise DataConfigError(
            "the Markov chain corpus has no text to prompt: predict is not offered"
        )

    # -- checkpoint: the corpus a model was trained on -----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"markov_chain": self.cache.key}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("markov_chain")
        if saved is not None and saved != self.cache.key:
            raise VocabularyMismatchError(
                f"the checkpoint was trained on another Markov chain (cache key {saved}) than "
                f"{self!r} gives ({self.cache.key}); set data.* to the checkpoint's options"
            )
