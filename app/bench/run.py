"""Timing and memory of output layers: ``python -m app.bench --help``.

Forward + backward of the output layer alone (``--scope head``) or of a whole LSTM language
model around it (``--scope lm``), for every head, vocabulary size, hidden size and batch size
asked for. Heads are interleaved within each repeat so they share the machine's state (each
timed step right after an untimed one of the same head, so none inherits another's cold
allocator), and each figure is the median over repeats after warm-up. Two modes, as in the
Mixtape paper's tables: ``same-batch`` (time per batch at a given batch size) and
``same-memory`` (the largest batch that fits a memory budget, and the time per token at that
batch).
Each row also gives the FLOPs of the matrix products its step ran (counted from the
operators, ``app/bench/flops.py``) and the rate it ran them at: next to the ``matmul`` row,
this says how far a head is from the machine's limit, and how much of a time ratio between
two heads is owed to the work each one does. And its extra peak memory: what one training
step takes above the memory in use before it (``app/bench/memory.py``: peak RSS on a CPU,
the caching allocator's peak on CUDA), which same-memory mode fits to the budget.

Subjects (``--heads``) are named ``<head>[@<backend>][+compile]`` (``app/bench/subjects.py``):
e.g. ``softmax softmax+compile softmax@cce cce liger matmul``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from app.bench.flops import matmul_flops
from app.bench.memory import can_reset_peak_rss, extra_peak_bytes, measure_in_child
from app.bench.subjects import (
    DEFAULT_SUBJECTS,
    PRECISIONS,
    BenchOptions,
    WholeLM,
    build_head,
    parse_subject,
    step_fn,
)
from app.bench.timing import CLOCKS, check_clock, check_device, time_once
from app.machine import load_average
from heads.adaptive_cutoffs import zipf_probabilities
from heads.fused_cross_entropy import BACKENDS


def make_targets(kind: str, vocab: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """Targets drawn from a Zipf law over ids, or PTB's training stream (ids folded into V)."""
    if kind == "zipf":
        probs = torch.from_numpy(zipf_probabilities(vocab))
        return torch.multinomial(probs, count, replacement=True, generator=generator)
    if kind == "ptb":
        from datamodules import LanguageModelingDataModule

        tokens = LanguageModelingDataModule().split_tokens("train")  # the shipped PTB
        return tokens[:count].long().remainder(vocab)  # int32 on disk; heads take int64
    raise ValueError(f"unknown targets {kind!r}: zipf or ptb")


def build_case(name, scope, vocab, hidden, tokens, targets, options, device, bptt,
               precision="32-true"):  # fmt: skip
    head = build_head(name, hidden, vocab, options)
    if scope == "lm":
        module = WholeLM(head, hidden, vocab).to(device)
        streams = max(1, tokens // bptt)
        ids = targets[: streams * bptt].view(streams, bptt).to(device)
        return module, step_fn(module, ids, ids, precision)
    module = head.to(device)
    # drawn where it is used: same-memory mode builds many cases of up to ~10^5 rows, and a
    # CPU draw then copy took seconds each before a GPU step of milliseconds
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen, device=device).requires_grad_(True)
    return module, step_fn(module, x, targets[:tokens].to(device), precision)


def _child_case(name, scope, vocab, hidden, tokens, targets, options, device, bptt, precision,
                threads):  # fmt: skip
    """``build_case``'s step in a child process (``measure_in_child``)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    return build_case(name, scope, vocab, hidden, tokens, targets, options, device, bptt,
                      precision)[1]  # fmt: skip


def step_memory(step, device: torch.device, case: tuple) -> int:
    """Extra peak bytes of one step (``app/bench/memory.py``); ``case`` rebuilds it in a child
    process where this one cannot reset its peak RSS. Run after a warm-up step."""
    if device.type == "cuda" or can_reset_peak_rss():
        return extra_peak_bytes(step, device, clear=getattr(step, "clear", None))
    import functools

    return measure_in_child(functools.partial(_child_case, *case, torch.get_num_threads()))


def largest_batch(name, scope, vocab, hidden, budget, targets, options, device, bptt, limit,
                  precision="32-true"):  # fmt: skip
    """Largest token count (a multiple of ``bptt``) whose extra peak memory fits ``budget``
    bytes."""

    def fits(tokens: int) -> bool:
        start = time.perf_counter()
        case = (name, scope, vocab, hidden, tokens, targets, options, device, bptt, precision)
        _, step = build_case(*case)
        step()  # warm: lazy initialisation and compilation are not the step's memory
        peak = step_memory(step, device, case)
        # one line per probe: the search can take minutes on big vocabularies
        print(f"    {name}: {tokens} tokens, peak {peak / 2**20:.0f} MiB "
              f"({time.perf_counter() - start:.1f} s)", flush=True)  # fmt: skip
        return peak <= budget

    # in units of bptt: ``low`` fits (or is 0), ``high`` misses or is past the limit. Counting
    # in tokens let the search stall for ever once ``high`` was the limit and not a multiple
    # of bptt (the midpoint rounded down onto ``low``).
    most = limit // bptt
    low, high = 0, 1
    while high <= most and fits(high * bptt):
        low, high = high, high * 2
    high = min(high, most + 1)
    while high - low > 1:  # binary search between the last fit and the first miss
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * bptt) else (low, mid)
    return low * bptt


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    torch.manual_seed(0)
    options = BenchOptions(
        mos_components=args.mos_components, mixtape_components=args.mixtape_components,
        mixtape_ratio=args.mixtape_ratio, cutoffs=args.cutoffs, div_value=args.div_value,
        loss_backend=args.loss_backend,
        saved_bytes=None if args.saved_mb is None else int(args.saved_mb * 2**20),
    )  # fmt: skip
    results = []
    tokens_for = _tokens_for(args.tokens_for, args.heads)
    configs = [(v, d, b) for v in args.vocab_sizes for d in args.hidden_sizes
               for b in args.batch_sizes]  # fmt: skip
    for index, (vocab, hidden, batch) in enumerate(configs, start=1):
        print(f"[{index}/{len(configs)}] V={vocab} d={hidden} batch={batch}", flush=True)
        max_tokens = max(batch, args.max_batch, *tokens_for.values())
        targets = make_targets(args.targets, vocab, max_tokens, torch.Generator().manual_seed(1))
        tokens = {name: tokens_for.get(name, batch) for name in args.heads}
        if args.mode == "same-memory":
            budget = int(args.memory_budget_mb * 2**20)
            for name in args.heads:
                tokens[name] = largest_batch(
                    name, args.scope, vocab, hidden, budget, targets, options, device,
                    args.bptt, args.max_batch, args.precision,
                )  # fmt: skip
                print(f"  {name}: {tokens[name]} tokens fit {args.memory_budget_mb} MiB")
        names = [name for name in args.heads if tokens[name] > 0]
        case_of = {name: (name, args.scope, vocab, hidden, tokens[name], targets, options,
                          device, args.bptt, args.precision) for name in names}  # fmt: skip
        if args.time == "skip":  # one case at a time: only one head's memory is held
            for name in names:
                torch.manual_seed(0)
                module, step = build_case(*case_of[name])
                step()  # warm: lazy initialisation and compilation are not the step's memory
                results.append(_row(name, module, step, None, args, case_of[name]))
                memory = results[-1]["extra_peak_mb"]
                print(f"  {name}: {tokens[name]} tokens, extra peak "
                      f"{'-' if memory is None else f'{memory:.1f}'} MiB", flush=True)  # fmt: skip
                del module, step
            continue
        cases = {}
        for name in names:
            torch.manual_seed(0)
            cases[name] = build_case(*case_of[name])
        for _ in range(args.warmup):
            for _, step in cases.values():
                step()
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):  # interleaved: every head sees the same machine state
            for name, (_, step) in cases.items():
                # an untimed step first: the previous head's allocations (MoS frees GBs) leave
                # the allocator and caches cold for whichever head comes next
                step()
                times[name].append(time_once(step, device, CLOCKS[args.clock]))
        for name, (module, step) in cases.items():
            results.append(_row(name, module, step, times[name], args, case_of[name]))
    memory_method = (
        "cuda_allocator"
        if device.type == "cuda"
        else ("rss_reset_peak" if can_reset_peak_rss() else "rss_child_process")
    )
    return {
        "args": vars(args), "options": asdict(options), "results": results,
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "device": str(device),
                    "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "load_average": load_average(), "memory_method": memory_method},
    }  # fmt: skip


def _row(name, module, step, times: list[float] | None, args, case: tuple) -> dict:
    """One result row: the median time (None with ``--time skip``), and the FLOPs and memory
    of one more step where asked for."""
    _, scope, vocab, hidden, tokens, targets, options, device, _, precision = case
    median = None if times is None else statistics.median(times)
    flops = None  # not counted (--flops skip)
    if args.flops == "count":
        flops = _flops(name, step, args, vocab, hidden, tokens, targets, options, device)
    memory = None
    if args.memory == "measure":
        memory = step_memory(step, device, case) / 2**20
    row = {
        "head": name, "vocab_size": vocab, "hidden_size": hidden, "tokens": tokens,
        "scope": scope, "mode": args.mode, "precision": precision,
        "time_ms": None if median is None else median * 1e3,
        "time_per_token_us": None if median is None else median / tokens * 1e6,
        "times_ms": None if times is None else [t * 1e3 for t in times],
        "matmul_gflop": None if flops is None else flops / 1e9,
        "matmul_gflop_per_s": None if flops is None or median is None else flops / median / 1e9,
        "extra_peak_mb": memory,
        "parameters": sum(p.numel() for p in module.parameters()),
    }  # fmt: skip
    if hasattr(module, "cutoffs"):
        row["cutoffs"] = module.cutoffs
    return row


def _flops(name, step, args, vocab, hidden, tokens, targets, options, device) -> int:
    """The step's matrix-product FLOPs, counted once and untimed (the counter slows the step);
    a compiled subject's from its eager twin (the counter sees no compiled kernels)."""
    if not parse_subject(name).compiled:
        return matmul_flops(step)
    torch.manual_seed(0)
    _, eager = build_case(name.removesuffix("+compile"), args.scope, vocab, hidden, tokens,
                          targets, options, device, args.bptt, args.precision)  # fmt: skip
    return matmul_flops(eager)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--heads",
        nargs="+",
        default=list(DEFAULT_SUBJECTS),
        help="subjects: <head>[@<backend>][+compile] or a peer (app/bench/subjects.py)",
    )
    parser.add_argument(
        "--loss-backend",
        choices=BACKENDS,
        default="auto",
        help="fused-loss backend of our heads without an @backend",
    )
    parser.add_argument(
        "--saved-mb",
        type=float,
        default=None,
        help="chunk results the fused loss keeps for its backward (default 128; 0: recompute)",
    )
    parser.add_argument(
        "--memory",
        choices=["measure", "skip"],
        default="measure",
        help="extra peak memory of a step per row (app/bench/memory.py)",
    )
    parser.add_argument(
        "--time",
        choices=["measure", "skip"],
        default="measure",
        help="skip: no timed steps, one warm-up step then the memory (and FLOPs) per row",
    )
    parser.add_argument(
        "--tokens-for",
        nargs="+",
        default=[],
        metavar="SUBJECT=TOKENS",
        help="tokens per step for one subject instead of --batch-sizes, e.g. mos=2048",
    )
    parser.add_argument(
        "--flops",
        choices=["count", "skip"],
        default="count",
        help="count the step's matrix-product FLOPs (one more untimed step per row)",
    )
    parser.add_argument("--vocab-sizes", nargs="+", type=int, default=[10_000, 33_000, 100_000])
    parser.add_argument("--hidden-sizes", nargs="+", type=int, default=[512])
    parser.add_argument(
        "--batch-sizes",
        nargs="+",
        type=int,
        default=[2048],
        help="tokens per batch (same-batch mode)",
    )
    parser.add_argument(
        "--mode",
        choices=["same-batch", "same-memory", "inference", "data"],
        default="same-batch",
        help="inference: top-k latency, DS-Softmax vs softmax (own options: --mode inference -h); "
        "data: corpus preparation and cached-load cost (own options: --mode data -h)",
    )
    parser.add_argument("--memory-budget-mb", type=float, default=1024)
    parser.add_argument(
        "--max-batch",
        type=int,
        default=65_536,
        help="largest token count tried in same-memory mode",
    )
    parser.add_argument("--scope", choices=["head", "lm"], default="head")
    parser.add_argument("--bptt", type=int, default=35, help="sequence length for --scope lm")
    parser.add_argument("--targets", choices=["zipf", "ptb"], default="zipf")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--precision",
        choices=list(PRECISIONS),
        default="32-true",
        help="as Lightning's --trainer.precision: the forward under autocast for *-mixed",
    )
    parser.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: process CPU time, steadier on a shared machine",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--mos-components", type=int, default=15)
    parser.add_argument("--mixtape-components", type=int, default=4)
    parser.add_argument("--mixtape-ratio", type=float, default=0.1)
    parser.add_argument(
        "--cutoffs",
        nargs="+",
        type=int,
        default=None,
        help="adaptive cut-offs (default: the paper's dynamic program)",
    )
    parser.add_argument("--div-value", type=float, default=4.0)
    parser.add_argument("--out", default="bench_results", help="folder for JSON and PNG")
    parser.add_argument("--name", default=None, help="file stem (default: mode-scope)")
    args = parser.parse_args(argv)
    for name in ("repeats", "bptt", "max_batch"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if min(args.vocab_sizes + args.hidden_sizes + args.batch_sizes) <= 0:
        parser.error("sizes must be positive")
    check_device(parser, args.device)
    check_clock(parser, args.clock, args.device)
    for name in args.heads:
        try:
            parse_subject(name)
        except ValueError as error:
            parser.error(str(error))
    if args.saved_mb is not None and args.saved_mb < 0:
        parser.error("--saved-mb must be >= 0")
    if args.mode == "same-memory" and args.memory == "skip":
        parser.error("same-memory mode fits the measured memory: drop --memory skip")
    if args.time == "skip" and args.memory == "skip" and args.flops == "skip":
        parser.error("--time skip with --memory skip and --flops skip measures nothing")
    try:  # checked here, used in run
        _tokens_for(args.tokens_for, args.heads)
    except ValueError as error:
        parser.error(str(error))
    return args


def _tokens_for(pairs: list[str], subjects: list[str]) -> dict[str, int]:
    """``["mos=2048", ...]`` -> ``{"mos": 2048}``, each subject one of ``--heads``; a
    ``ValueError`` naming the bad pair otherwise."""
    tokens = {}
    for pair in pairs:
        name, _, count = pair.partition("=")
        if name not in subjects or not count.isdigit() or int(count) <= 0:
            raise ValueError(f"--tokens-for {pair!r}: want SUBJECT=TOKENS with a subject of "
                             f"--heads ({' '.join(subjects)}) and a positive count")  # fmt: skip
        tokens[name] = int(count)
    return tokens


def _mode(argv: list[str]) -> str | None:
    """The ``--mode`` given (the modes with options of their own are dispatched on it)."""
    for i, arg in enumerate(argv):
        if arg.startswith("--mode="):
            return arg.split("=", 1)[1]
        if arg == "--mode" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if _mode(argv) == "inference":
        from app.bench.inference import main as inference_main  # its own options

        return inference_main(argv)
    if _mode(argv) == "data":
        from app.bench.data import main as data_main  # its own options

        return data_main(argv)
    from app.bench.report import print_table, save_plot

    args = parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{args.mode}-{args.scope}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    save_plot(report, out / f"{stem}.png")
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    return report


def ratio(report: dict, numerator: str, denominator: str, vocab: int, key="time_ms") -> float:
    """``numerator / denominator`` of one measured figure at one vocabulary size."""
    rows = {r["head"]: r for r in report["results"] if r["vocab_size"] == vocab}
    return float(np.float64(rows[numerator][key]) / rows[denominator][key])
