"""Data-preparation benchmark: ``python -m app.bench --mode data --help``.

What a corpus costs before training starts, so that a user sees it before launching a cluster
job: the first preparation (vocabulary and token files into an empty cache) and a cached setup
(what every later run and every DDP rank pays), each with its wall time and peak resident
memory, for the word and BPE vocabularies of ``LanguageModelingDataModule``.

The corpus is WikiText-style and synthetic (made with numpy): ``--types`` word types drawn
from a Zipf law of exponent ``--zipf`` (frequent words short, rare ones long, about WikiText's
4.6 bytes per token), ``--line-words`` words per line, ``--tokens`` training tokens (validation
and test get 1/400 of that each, as WikiText-103's 217k/245k against 103M). It is written once
into ``--corpus-dir`` (default: a folder per size under the system's temporary folder) and
reused. Each phase runs in a fresh Python process: its peak RSS (``getrusage`` of that process)
is its own, not inherited from an earlier phase, and a cached setup really starts cold in
Python (the OS page cache stays warm, as it would on a machine that just prepared the data).
The cache starts empty (a fresh ``--cache-dir``, deleted afterwards unless given).

JSON (``--out``/``--name``.json): ``corpus`` (path, tokens, types, bytes), ``machine`` (CPU
count, load averages before and after), ``results``: one entry per vocabulary with ``prepare``
and ``cached`` (a list of runs) phases, each ``{wall_s, vocab_s, ready_s, first_batch_s,
process_s, epoch_read_s, peak_rss_gib, cache_hits, cache_misses, log, vocab_size, tokens}``
(seconds from the data module's creation; ``process_s`` also counts Python's start and the
imports), the cached phase's median ``cached_wall_s``, and ``concurrent`` (``--concurrent N``:
N processes started together on an empty cache, as DDP ranks launched by torchrun or SLURM
are).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CHUNK_TOKENS = 2_000_000  # written per numpy draw


def _words(types: int, rng: np.random.Generator) -> np.ndarray:
    """``types`` distinct lowercase words, longer with rank (rank 0 has 1-2 letters, rank
    250k about 10): English-like bytes per token under a Zipf law."""
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    lengths = np.maximum(1, np.round(0.45 * np.log2(np.arange(types) + 2)).astype(int) + 1)
    seen: set[str] = set()
    words: list[str] = []
    for length in lengths.tolist():
        while True:
            word = letters[rng.integers(0, 26, size=length)].tobytes().decode()
            if word not in seen:
                break
            length += 1  # this length is crowded: a longer one is free
        seen.add(word)
        words.append(word)
    return np.array(words, dtype=object)


def write_synthetic_corpus(
    folder: str | os.PathLike,
    tokens: int,
    types: int,
    zipf: float = 1.1,
    line_words: int = 20,
    seed: int = 0,
) -> dict[str, Any]:
    """Writes ``wiki.{train,valid,test}.tokens`` into ``folder`` (see the module docstring);
    returns what was written. Deterministic in its arguments."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = _words(types, rng)
    cdf = np.cumsum(np.arange(1, types + 1, dtype=np.float64) ** -zipf)
    cdf /= cdf[-1]
    sizes = {"train": tokens, "valid": max(tokens // 400, line_words), "test": None}
    sizes["test"] = sizes["valid"]
    for split, count in sizes.items():
        with (folder / f"wiki.{split}.tokens").open("w", encoding="utf-8") as out:
            done = 0
            while done < count:
                n = min(CHUNK_TOKENS, count - done)
                ids = np.minimum(np.searchsorted(cdf, rng.random(n)), types - 1)
                drawn = words[ids]
                lines = [" ".join(drawn[i : i + line_words]) for i in range(0, n, line_words)]
                out.write("\n".join(lines) + "\n")
                done += n
    files = sorted(folder.glob("wiki.*.tokens"))
    return {
        "path": str(folder),
        "tokens": tokens,
        "types": types,
        "zipf": zipf,
        "line_words": line_words,
        "seed": seed,
        "bytes": {f.name: f.stat().st_size for f in files},
    }


# -- one phase, in its own process -----------------------------------------------------------
class _Counter(logging.Handler):
    """Counts the data cache's hit and miss lines (and keeps them for the report)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the data module of ``spec`` and make it ready to serve a first training batch:
    ``prepare`` runs ``prepare_data`` (all splits), ``cached`` runs ``setup("fit")``."""
    from datamodules import LanguageModelingDataModule

    counter = _Counter()
    logger = logging.getLogger("datamodules")
    logger.setLevel(logging.INFO)
    logger.addHandler(counter)
    start = time.perf_counter()
    data = LanguageModelingDataModule(**spec["data"])
    vocab_size = data.vocab_size  # what the CLI reads while it builds objects
    vocab_s = time.perf_counter() - start
    if spec["phase"] == "prepare":
        data.prepare_data()
    data.setup("fit")
    ready_s = time.perf_counter() - start
    next(iter(data.train_dataloader()))
    first_batch_s = time.perf_counter() - start
    read_s = None
    if spec.get("read_epoch"):  # every training window of this rank, no model
        begin = time.perf_counter()
        for _ in data.train_dataloader():
            pass
        read_s = time.perf_counter() - begin
    return {
        "wall_s": first_batch_s,
        "vocab_s": vocab_s,
        "ready_s": ready_s,
        "first_batch_s": first_batch_s,
        "epoch_read_s": read_s,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30,
        "cache_misses": sum("cache miss" in line for line in counter.lines),
        "cache_hits": sum("cache hit" in line for line in counter.lines),
        "log": counter.lines,
        "vocab_size": vocab_size,
        "tokens": {split: data.num_tokens(split) for split in ("train", "valid")},
    }


def _spawn(spec: dict[str, Any]) -> subprocess.Popen:
    env = {**os.environ, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    code = "import json, sys; from app.bench.data import run_phase; "
    code += "print(json.dumps(run_phase(json.loads(sys.argv[1]))))"
    process = subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(spec)],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    process.started = time.perf_counter()  # type: ignore[attr-defined]
    return process


def _result(process: subprocess.Popen) -> dict[str, Any]:
    out, err = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"benchmark phase failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    # the whole process: Python's start and the imports (torch, lightning...) included
    result["process_s"] = time.perf_counter() - process.started  # type: ignore[attr-defined]
    return result


def phase(spec: dict[str, Any]) -> dict[str, Any]:
    return _result(_spawn(spec))


# -- the benchmark -----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict[str, Any]:
    corpus_dir = Path(args.corpus_dir or Path(tempfile.gettempdir()) / (
        f"output-heads-bench-corpus-{args.tokens}-{args.types}-{args.zipf}-{args.line_words}"
    ))  # fmt: skip
    report: dict[str, Any] = {
        "mode": "data",
        "corpus": _corpus(args, corpus_dir),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "options": {k: v for k, v in vars(args).items() if k != "out"},
        "results": [],
    }
    for vocab in args.vocab:
        data = {
            "path": str(corpus_dir),
            "vocab": vocab,
            "bpe_vocab_size": args.bpe_vocab_size,
            "batch_size": args.batch_size,
            "bptt": args.bptt,
        }
        cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp("-data-cache"))
        try:
            report["results"].append(_measure_vocab(args, vocab, data, cache))
        finally:
            if not args.cache_dir:
                shutil.rmtree(cache, ignore_errors=True)
    report["machine"]["load_average_after"] = os.getloadavg()
    return report


def _corpus(args: argparse.Namespace, corpus_dir: Path) -> dict[str, Any]:
    """The synthetic corpus's description, written first where it is not there yet."""
    marker = corpus_dir / "corpus.json"
    if marker.is_file():
        print(f"corpus: {corpus_dir} (written before)", flush=True)
        return json.loads(marker.read_text())
    print(f"writing a {args.tokens:,}-token corpus to {corpus_dir} ...", flush=True)
    start = time.perf_counter()
    corpus = write_synthetic_corpus(
        corpus_dir, args.tokens, args.types, args.zipf, args.line_words, args.seed
    )
    corpus["write_s"] = time.perf_counter() - start
    marker.write_text(json.dumps(corpus))
    return corpus


def _measure_vocab(args, vocab: str, data: dict[str, Any], cache: Path) -> dict[str, Any]:
    """One vocabulary: the first preparation, the cached setups, and concurrent preparations."""
    entry: dict[str, Any] = {"vocab": vocab}
    spec = {"data": {**data, "cache_dir": str(cache)}}
    print(f"[{vocab}] first preparation (empty cache {cache}) ...", flush=True)
    entry["prepare"] = phase({**spec, "phase": "prepare"})
    print(f"[{vocab}] {_line(entry['prepare'])}", flush=True)
    entry["cached"] = []
    for repeat in range(args.repeats):
        read = args.read_epoch and repeat == 0
        entry["cached"].append(phase({**spec, "phase": "cached", "read_epoch": read}))
        print(f"[{vocab}] cached setup: {_line(entry['cached'][-1])}", flush=True)
    entry["cached_wall_s"] = statistics.median(r["wall_s"] for r in entry["cached"])
    if args.concurrent > 1:
        fresh = Path(tempfile.mkdtemp("-data-cache"))
        spec_now = {**spec, "data": {**data, "cache_dir": str(fresh)}, "phase": "prepare"}
        print(f"[{vocab}] {args.concurrent} processes at once, empty cache ...", flush=True)
        processes = [_spawn(spec_now) for _ in range(args.concurrent)]
        entry["concurrent"] = [_result(p) for p in processes]
        for result in entry["concurrent"]:
            print(f"[{vocab}]   {_line(result)}", flush=True)
        shutil.rmtree(fresh, ignore_errors=True)
    return entry


def _line(result: dict[str, Any]) -> str:
    return (
        f"{result['wall_s']:.1f} s to the first batch (vocabulary {result['vocab_s']:.1f} s; "
        f"{result['process_s']:.1f} s with Python's start and imports), "
        f"peak RSS {result['peak_rss_gib']:.2f} GiB, {result['cache_misses']} cache misses, "
        f"{result['cache_hits']} hits"
        + (f", one epoch read in {result['epoch_read_s']:.1f} s" if result["epoch_read_s"] else "")
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench --mode data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=["data"], default="data")
    parser.add_argument("--tokens", type=int, default=20_000_000, help="training tokens")
    parser.add_argument("--types", type=int, default=250_000, help="word types")
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent")
    parser.add_argument("--line-words", type=int, default=20, help="words per line")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", nargs="+", choices=["word", "bpe"], default=["word", "bpe"])
    parser.add_argument("--bpe-vocab-size", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=20, help="BPTT streams")
    parser.add_argument("--bptt", type=int, default=35)
    parser.add_argument("--repeats", type=int, default=3, help="cached setups (median)")
    parser.add_argument(
        "--read-epoch",
        action="store_true",
        help="also time reading every training window once (first cached run)",
    )
    parser.add_argument(
        "--concurrent",
        type=int,
        default=0,
        help="N > 1: also start N processes together on an empty cache",
    )
    parser.add_argument("--corpus-dir", default=None, help="where the corpus is written once")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="data cache to use and keep (default: a fresh one, deleted after)",
    )
    parser.add_argument("--out", default="bench_results", help="folder for the JSON")
    parser.add_argument("--name", default=None, help="file stem (default: data-<tokens>)")
    args = parser.parse_args(argv)
    for name in ("tokens", "types", "line_words", "repeats", "bpe_vocab_size", "batch_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if not math.isfinite(args.zipf) or args.zipf <= 0:
        parser.error("--zipf must be positive")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"data-{args.tokens}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / (stem + '.json')}")
    return report
