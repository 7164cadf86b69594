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

Subjects (``--heads``) are named ``<head>[@<backend>][+compile][+graphs]``
(``app/bench/subjects.py``): e.g. ``softmax softmax+compile softmax@rows+graphs softmax@cce cce
liger matmul``.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from app.bench.flops import counted_products, matmul_flops
from app.bench.memory import can_reset_peak_rss, extra_peak_bytes, measure_apart
from app.bench.subjects import (
    DEFAULT_SUBJECTS,
    FRAGMENTS,
    PRECISIONS,
    BenchOptions,
    WholeLM,
    build_head,
    eager_twin,
    graphs_held_bytes,
    head_config,
    parse_head,
    parse_subject,
    step_fn,
)
from app.bench.timing import (
    CLOCKS,
    check_clock,
    check_device,
    release_compile_workers,
    time_once,
)
from app.machine import host_use, host_use_between, load_average
from heads.adaptive_cutoffs import zipf_probabilities
from heads.errors import UserError
from heads.fused_cross_entropy import BACKENDS
from heads.kernels.chunks import FLOAT32_PRODUCTS

TRAINING_MODES = ("same-batch", "same-memory")
MODES = (*TRAINING_MODES, "inference", "data")  # the last two with options of their own


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


@dataclass(frozen=True, eq=False)
class Case:
    """One subject at one size: what a step is built from."""

    name: str
    scope: str
    vocab: int
    hidden: int
    tokens: int
    targets: torch.Tensor
    options: BenchOptions
    device: torch.device
    bptt: int
    precision: str = "32-true"


def build_case(case: Case):
    head = build_head(case.name, case.hidden, case.vocab, case.options)
    device, tokens = case.device, case.tokens
    if case.scope == "lm":
        module = WholeLM(head, case.hidden, case.vocab).to(device)
        streams = max(1, tokens // case.bptt)
        ids = case.targets[: streams * case.bptt].view(streams, case.bptt).to(device)
        return module, step_fn(module, ids, ids, case.precision)
    module = head.to(device)
    # drawn where it is used: same-memory mode builds many cases of up to ~10^5 rows, and a
    # CPU draw then copy took seconds each before a GPU step of milliseconds
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, case.hidden, generator=gen, device=device).requires_grad_(True)
    return module, step_fn(module, x, case.targets[:tokens].to(device), case.precision)


def _child_case(case: Case, threads: int):
    """``build_case``'s step in a child process (``measure_in_child``)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    return build_case(case)[1]


def step_memory(step, case: Case) -> int:
    """Extra peak bytes of one step (``app/bench/memory.py``): ``step`` itself on CUDA (run it
    after a warm-up step); on a CPU, ``case`` rebuilt in the memory worker, apart from what
    the timed subjects left in this process."""
    if case.device.type == "cuda":
        return extra_peak_bytes(step, case.device, clear=getattr(step, "clear", None))
    return measure_apart(functools.partial(_child_case, case, torch.get_num_threads()))


# the same-memory search stops once the largest fit is known within this share of itself: a
# GPU's search at V = 100k took 21 probes of up to 4 s each to pin MoS-15's 60,690 tokens to
# 35 tokens; within 1/64 it takes about half as many
SEARCH_SHARE = 64


def largest_batch(case: Case, budget: int, limit: int) -> int:
    """Largest token count (a multiple of ``bptt``) whose extra peak memory fits ``budget``
    bytes (``case.tokens`` is ignored), within ``1/SEARCH_SHARE`` of the largest: the count
    returned fits, one ``1/SEARCH_SHARE`` larger may too."""

    def fits(tokens: int) -> bool:
        start = time.perf_counter()
        probe = replace(case, tokens=tokens)
        module, step = build_case(probe)
        step()  # warm: lazy initialisation and compilation are not the step's memory
        peak = step_memory(step, probe) + graphs_held_bytes(module)
        # one line per probe: the search can take minutes on big vocabularies
        print(f"    {case.name}: {tokens} tokens, peak {peak / 2**20:.0f} MiB "
              f"({time.perf_counter() - start:.1f} s)", flush=True)  # fmt: skip
        return peak <= budget

    # in units of bptt: ``low`` fits (or is 0), ``high`` misses or is past the limit. Counting
    # in tokens let the search stall for ever once ``high`` was the limit and not a multiple
    # of bptt (the midpoint rounded down onto ``low``).
    bptt = case.bptt
    most = limit // bptt
    low, high = 0, 1
    while high <= most and fits(high * bptt):
        low, high = high, high * 2
    high = min(high, most + 1)
    while high - low > max(1, low // SEARCH_SHARE):  # between the last fit and first miss
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * bptt) else (low, mid)
    return low * bptt


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """The subjects' build options: ``--init-args`` and the named shortcuts over the head
    fragments' ``init_args``, the loss backend and its kept bytes."""
    init_args: dict[str, dict] = {}
    shortcuts = {
        ("mos", "num_components"): args.mos_components,
        ("mixtape", "num_components"): args.mixtape_components,
        ("mixtape", "frequent_ratio"): args.mixtape_ratio,
        ("adaptive", "cutoffs"): args.cutoffs,
        ("adaptive", "div_value"): args.div_value,
    }
    for (fragment, key), value in [*shortcuts.items(), *_init_args(args.init_args).items()]:
        if value is not None:
            init_args.setdefault(fragment, {})[key] = value
    saved = None if args.saved_mb is None else int(args.saved_mb * 2**20)
    return BenchOptions(init_args, args.loss_backend, saved)  # fmt: skip


def _cases(args, options, vocab: int, hidden: int, batch: int, device,
           fits_nothing: list[dict] | None = None) -> dict[str, Case]:  # fmt: skip
    """The case of every subject with tokens to run at this size (``--tokens-for``, or the
    largest batch in the memory budget in same-memory mode; a subject that fits no batch is
    added to ``fits_nothing``: a measured result, not a missing one)."""
    tokens_for = _tokens_for(args.tokens_for, args.heads)
    max_tokens = max(batch, args.max_batch, *tokens_for.values())
    targets = make_targets(args.targets, vocab, max_tokens, torch.Generator().manual_seed(1))
    cases = {
        name: Case(name, args.scope, vocab, hidden, tokens_for.get(name, batch), targets,
                   options, device, args.bptt, args.precision)
        for name in args.heads
    }  # fmt: skip
    if args.mode == "same-memory":
        budget = int(args.memory_budget_mb * 2**20)
        for name, case in cases.items():
            cases[name] = replace(case, tokens=largest_batch(case, budget, args.max_batch))
            print(f"  {name}: {cases[name].tokens} tokens fit {args.memory_budget_mb} MiB")
            if cases[name].tokens == 0 and fits_nothing is not None:
                fits_nothing.append({"head": name, "vocab_size": vocab, "hidden_size": hidden,
                                     "scope": args.scope,
                                     "budget_mb": args.memory_budget_mb})  # fmt: skip
    return {name: case for name, case in cases.items() if case.tokens > 0}


def first_step(case: Case, failed: dict[str, str]):
    """``build_case(case)`` and its first step (lazy initialisation, compilation), or None
    where the subject fails here: the failure is printed and recorded in ``failed`` and the
    other subjects are still measured (one GPU session measures everything it can). Errors in
    the command itself (``UserError``: a backend this machine lacks...) still stop the run."""
    torch.manual_seed(0)
    try:
        built = build_case(case)
        built[1]()
        return built
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of one subject: reported below
        message = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        failed[f"{case.name} V={case.vocab} d={case.hidden} tokens={case.tokens}"] = message
        print(f"  {case.name}: FAILED, left out ({message})", flush=True)
        if case.device.type == "cuda":
            torch.cuda.empty_cache()
        return None


def _memory_rows(args, cases: dict[str, Case], failed: dict[str, str]) -> list[dict]:
    """``--time skip``: one case at a time (only one head's memory is held)."""
    rows = []
    for name, case in cases.items():
        built = first_step(case, failed)  # warm: initialisation is not the step's memory
        if built is None:
            continue
        module, step = built
        rows.append(_row(module, step, None, args, case))
        memory = rows[-1]["extra_peak_mb"]
        print(f"  {name}: {case.tokens} tokens, extra peak "
              f"{'-' if memory is None else f'{memory:.1f}'} MiB", flush=True)  # fmt: skip
        del module, step
    return rows


def _timed_rows(args, cases: dict[str, Case], failed: dict[str, str], save=None) -> list[dict]:
    """Every case timed, interleaved: each repeat steps every subject once (after its first
    step, and ``--warmup`` more of every subject). ``save(rows, note)``, where given, gets the
    times so far after every round (a run cut short by a time limit keeps what it measured)."""
    built = {}
    for name, case in cases.items():
        subject = first_step(case, failed)
        if subject is not None:
            built[name] = subject
    for _ in range(args.warmup):
        for _, step in built.values():
            step()
    release_compile_workers()  # every subject compiled: nothing of it beside the timed steps
    before = host_use()
    times: dict[str, list[float]] = {name: [] for name in built}
    quick = argparse.Namespace(**{**vars(args), "flops": "skip", "memory": "skip"})
    for round_ in range(1, args.repeats + 1):  # interleaved: every head sees the same state
        for name, (_, step) in built.items():
            # an untimed step first: the previous head's allocations (MoS frees GBs) leave
            # the allocator and caches cold for whichever head comes next
            step()
            times[name].append(time_once(step, cases[name].device, CLOCKS[args.clock],
                                         args.steps_per_repeat))  # fmt: skip
        if save is not None and round_ < args.repeats:
            save([_row(module, step, times[name], quick, cases[name])
                  for name, (module, step) in built.items()],
                 f"partial: {round_} of {args.repeats} repeats, no FLOPs or memory")  # fmt: skip
    # the host's work over the timed rounds: this process's CPU beside the wall clock, and any
    # child process's (a busy one slows a host-bound step's launches)
    host = host_use_between(before, host_use())
    return [{**_row(module, step, times[name], args, cases[name]), "host_during_timing": host}
            for name, (module, step) in built.items()]  # fmt: skip


def run(args: argparse.Namespace, save=None) -> dict:
    """Every subject at every size; ``save(report)``, where given, gets the report so far
    after every timed round (the JSON of a run cut short keeps what it measured)."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    options = bench_options(args)
    results, failed, fits_nothing = [], {}, []
    sizes = [(v, d, b) for v in args.vocab_sizes for d in args.hidden_sizes
             for b in args.batch_sizes]  # fmt: skip

    def save_partial(rows: list[dict], note: str) -> None:
        report = _report(args, options, device, results + rows, failed, fits_nothing)
        save({**report, "partial": note})

    for index, (vocab, hidden, batch) in enumerate(sizes, start=1):
        print(f"[{index}/{len(sizes)}] V={vocab} d={hidden} batch={batch}", flush=True)
        cases = _cases(args, options, vocab, hidden, batch, device, fits_nothing)
        if args.time == "skip":
            results += _memory_rows(args, cases, failed)
        else:
            results += _timed_rows(args, cases, failed, save_partial if save else None)
        if save is not None and index < len(sizes):
            save({**_report(args, options, device, results, failed, fits_nothing),
                  "partial": f"{index} of {len(sizes)} sizes"})  # fmt: skip
    return _report(args, options, device, results, failed, fits_nothing)


def _report(args, options: BenchOptions, device: torch.device, results: list[dict],
            failed: dict[str, str], fits_nothing: list[dict] = ()) -> dict:  # fmt: skip
    memory_method = (
        "cuda_allocator"
        if device.type == "cuda"
        else ("rss_reset_peak_in_worker" if can_reset_peak_rss() else "rss_child_process")
    )
    configs = {name: head_config(name, options) for name in FRAGMENTS
               if any(parse_subject(s).head == name for s in args.heads)}  # fmt: skip
    note = {"note": args.note} if getattr(args, "note", None) else {}
    return {
        **note,
        "args": vars(args), "options": {**asdict(options), "heads": configs}, "results": results,
        "failed": dict(failed), "fits_nothing": list(fits_nothing),
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "device": str(device),
                    "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "load_average": load_average(), "memory_method": memory_method,
                    # which form of half-precision products into float32 gradients ran
                    "float32_products": dict(FLOAT32_PRODUCTS)},
    }  # fmt: skip


def _row(module, step, times: list[float] | None, args, case: Case) -> dict:
    """One result row: the median time (None with ``--time skip``), and the FLOPs and memory
    of one more step where asked for."""
    median = None if times is None else statistics.median(times)
    # memory first, of the step as it was timed: the FLOP count runs it under a dispatch mode
    memory = None if args.memory == "skip" else step_memory(step, case) / 2**20
    if memory is not None:  # +graphs: the graphs' memory, kept since their capture
        memory += graphs_held_bytes(module) / 2**20
    flops = None if args.flops == "skip" else _flops(step, case)
    row = {
        "head": case.name, "vocab_size": case.vocab, "hidden_size": case.hidden,
        "tokens": case.tokens, "scope": case.scope, "mode": args.mode,
        "precision": case.precision,
        "time_ms": None if median is None else median * 1e3,
        "time_per_token_us": None if median is None else median / case.tokens * 1e6,
        "times_ms": None if times is None else [t * 1e3 for t in times],
        "matmul_gflop": None if flops is None else flops / 1e9,
        "matmul_gflop_per_s": None if flops is None or median is None else flops / median / 1e9,
        "extra_peak_mb": memory,
        "parameters": sum(p.numel() for p in module.parameters()),
    }  # fmt: skip
    if hasattr(module, "cutoffs"):
        row["cutoffs"] = module.cutoffs
    return row


def _flops(step, case: Case) -> int | None:
    """The step's matrix-product FLOPs, counted once and untimed (the counter slows the step);
    a compiled or graphed subject's from its eager twin (the counter sees neither compiled
    kernels nor a graph's replay); None for products in Triton's or the field's kernels."""
    if not counted_products(case.name):
        return None
    subject = parse_subject(case.name)
    if not (subject.compiled or subject.graphs):
        return matmul_flops(step)
    torch.manual_seed(0)
    _, eager = build_case(replace(case, name=eager_twin(case.name)))
    return matmul_flops(eager)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"want a positive integer, got {text!r}")
    return int(text)


def _subject(text: str) -> str:
    try:
        parse_subject(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_subject_args(parser: argparse.ArgumentParser) -> None:
    """What is benchmarked: the subjects and how their heads are built."""
    group = parser.add_argument_group("subjects (app/bench/subjects.py)")
    group.add_argument("--heads", nargs="+", type=_subject, default=list(DEFAULT_SUBJECTS),
                       help="<head>[@<backend>][+compile][+graphs] or a peer; our heads (and torch_"
                       "adaptive's cut-offs) from configs/heads/<head>.yaml")  # fmt: skip
    group.add_argument("--init-args", nargs="+", default=[], metavar="HEAD.KEY=VALUE",
                       help="override a head fragment's init_args (VALUE in YAML), e.g. "
                       "mixtape.gate_dropout=0 adaptive.cutoffs=[2000,10000]")  # fmt: skip
    group.add_argument("--mos-components", type=int, help="= --init-args mos.num_components=")
    group.add_argument("--mixtape-components", type=int,
                       help="= --init-args mixtape.num_components=")  # fmt: skip
    group.add_argument("--mixtape-ratio", type=float, help="= mixtape.frequent_ratio")
    group.add_argument("--cutoffs", nargs="+", type=int, help="= adaptive.cutoffs")
    group.add_argument("--div-value", type=float, help="= adaptive.div_value")
    group.add_argument("--loss-backend", choices=BACKENDS, default="auto",
                       help="fused-loss backend of our heads without an @backend")  # fmt: skip
    group.add_argument("--saved-mb", type=float, help="chunk results the fused loss keeps for "
                       "its backward (default 128; 0: recompute)")  # fmt: skip


def _add_case_args(parser: argparse.ArgumentParser) -> None:
    """The sizes, inputs, device and precision of the cases."""
    sizes = dict(nargs="+", type=_positive)
    parser.add_argument("--vocab-sizes", **sizes, default=[10_000, 33_000, 100_000])
    parser.add_argument("--hidden-sizes", **sizes, default=[512])
    parser.add_argument("--batch-sizes", **sizes, default=[2048],
                        help="tokens per batch (same-batch mode)")  # fmt: skip
    parser.add_argument("--tokens-for", nargs="+", default=[], metavar="SUBJECT=TOKENS",
                        help="tokens per step for one subject instead of --batch-sizes, "
                        "e.g. mos=2048")  # fmt: skip
    parser.add_argument("--memory-budget-mb", type=float, default=1024)
    parser.add_argument("--max-batch", type=_positive, default=65_536,
                        help="largest token count tried in same-memory mode")  # fmt: skip
    parser.add_argument("--scope", choices=["head", "lm"], default="head")
    parser.add_argument("--bptt", type=_positive, default=35, help="sequence length (--scope lm)")
    parser.add_argument("--targets", choices=["zipf", "ptb"], default="zipf")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="32-true",
                        help="as Lightning's --trainer.precision: the forward under autocast "
                        "for *-mixed")  # fmt: skip


def _add_measure_args(parser: argparse.ArgumentParser) -> None:
    """What is measured, how often, and where it is written."""
    measure = dict(choices=["measure", "skip"], default="measure")
    parser.add_argument("--time", **measure, help="skip: no timed steps, one warm-up step then "
                        "the memory (and FLOPs) per row")  # fmt: skip
    parser.add_argument(
        "--memory", **measure, help="extra peak memory of a step per row (app/bench/memory.py)"
    )
    parser.add_argument(
        "--flops",
        choices=["count", "skip"],
        default="count",
        help="count the step's matrix-product FLOPs (one more untimed step)",
    )
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: process CPU time, steadier on a shared "
                        "machine (summed over the threads: ms / batch is then CPU ms, the "
                        "ratios alike)")  # fmt: skip
    parser.add_argument("--repeats", type=_positive, default=7)
    parser.add_argument("--steps-per-repeat", type=_positive, default=1,
                        help="steps a repeat times back to back, the device synced after the "
                        "last only (a training loop's pace on a GPU: each step's host work "
                        "overlaps the device's queue); the figure is their mean")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="bench_results", help="folder for JSON and PNG")
    parser.add_argument("--name", default=None, help="file stem (default: mode-scope)")
    parser.add_argument("--note", default=None, help="kept in the JSON as its note (what the "
                        "run shows, why it was made; docs/results.md prints it)")  # fmt: skip


def _mode_parser(add_help: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m app.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     add_help=add_help, allow_abbrev=False)  # fmt: skip
    parser.add_argument("--mode", choices=MODES, default="same-batch",
                        help="inference: top-k latency, DS-Softmax vs softmax; data: "
                        "corpus preparation (own options: --mode MODE -h)")  # fmt: skip
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of the training modes (same-batch, same-memory), checked together."""
    parser = _mode_parser(add_help=True)
    add_subject_args(parser)
    _add_case_args(parser)
    _add_measure_args(parser)
    args = parser.parse_args(argv)
    if args.mode not in TRAINING_MODES:
        parser.error(f"--mode {args.mode} has its own options: python -m app.bench --mode "
                     f"{args.mode} -h")  # fmt: skip
    check_device(parser, args.device)
    check_clock(parser, args.clock, args.device)
    if args.saved_mb is not None and args.saved_mb < 0:
        parser.error("--saved-mb must be >= 0")
    if args.mode == "same-memory" and args.memory == "skip":
        parser.error("same-memory mode fits the measured memory: drop --memory skip")
    if args.time == "skip" and args.memory == "skip" and args.flops == "skip":
        parser.error("--time skip with --memory skip and --flops skip measures nothing")
    try:  # checked here, used in run
        _tokens_for(args.tokens_for, args.heads)
        options = bench_options(args)
        for name in sorted({parse_subject(s).head for s in args.heads} & set(FRAGMENTS)):
            parse_head(head_config(name, options), 8, 64)  # a bad override, named now
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


def _init_args(pairs: list[str]) -> dict[tuple[str, str], Any]:
    """``["mixtape.gate_dropout=0", ...]`` -> ``{("mixtape", "gate_dropout"): 0}`` (values
    read as YAML); a ``ValueError`` naming the bad pair otherwise."""
    fragments = sorted(set(FRAGMENTS.values()))
    values = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        fragment, dot, name = key.partition(".")
        if not (equals and dot and name) or fragment not in fragments:
            raise ValueError(f"--init-args {pair!r}: want HEAD.KEY=VALUE with HEAD one of "
                             f"{', '.join(fragments)}")  # fmt: skip
        values[fragment, name] = yaml.safe_load(value)
    return values


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    mode = _mode_parser(add_help=False).parse_known_args(argv)[0].mode
    if mode == "inference":
        from app.bench.inference import main as inference_main  # its own options

        return inference_main(argv)
    if mode == "data":
        from app.bench.data import main as data_main  # its own options

        return data_main(argv)
    from app.bench.report import print_table, save_plot

    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"{args.mode}-{args.scope}"

    def save(report: dict) -> None:  # also the partial reports, each over the last
        (out / f"{stem}.json").write_text(json.dumps(report, indent=1))

    report = run(args, save)
    save(report)
    print_table(report)
    save_plot(report, out / f"{stem}.png")
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.png')}")
    for subject, message in report["failed"].items():
        print(f"FAILED {subject}: {message}", file=sys.stderr)
    return report


def exit_code(report: dict) -> int:
    """1 where a subject failed (its JSON still written with the others), else 0."""
    return 1 if report.get("failed") else 0


def ratio(report: dict, numerator: str, denominator: str, vocab: int, key="time_ms") -> float:
    """``numerator / denominator`` of one measured figure at one vocabulary size."""
    rows = {r["head"]: r for r in report["results"] if r["vocab_size"] == vocab}
    return float(np.float64(rows[numerator][key]) / rows[denominator][key])
