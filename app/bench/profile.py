"""Where a head's training step spends its time: ``python -m app.bench.profile --help``.

The benchmark (``python -m app.bench``) says how long a step of each head takes; this says why.
Each subject (``--heads``, named as for the benchmark: ``softmax``, ``mixtape@rows``,
``torch_adaptive``, ``matmul``...) is built and fed at one size as the benchmark builds and
feeds it (``app/bench/run.py``'s ``build_case``: the head from its CLI fragment, N(0, 1) inputs,
the benchmark's Zipf targets, one forward + backward under autocast as Lightning runs a
training step), one subject at a time. After ``--warmup`` steps:

- ``--steps`` steps timed without the profiler, the device synced before each:
  ``host_ms``, until ``step()`` returns (the host's dispatch, plus any wait for the device that
  a sync in the step forces), and ``wall_ms``, until the device is done too (the benchmark's
  figure). On a CPU the two are one.
- one step under ``torch.profiler`` to warm it up, then ``--steps`` profiled steps (activities
  CPU, plus CUDA on a CUDA device), each counted on its own:
  ``aten_ops``: every ``aten::*`` host event, nested ones included (``aten::linear`` and the
  ``aten::matmul`` and ``aten::mm`` it calls are 3; the profiler itself drops ``aten::is_leaf``,
  ``aten::output_nr`` and ``aten::_version``); ``aten_ops_top``: those under no other
  ``aten::*`` event, the operators Python and the autograd engine dispatched;
  ``outside_ops_ms`` (and ``outside_ops_share`` of the step's profiled host time): host time in
  no profiled event (Python, autograd's glue; approximate);
  on CUDA ``kernels`` (the kernels the device ran), ``launch_calls`` (the host's kernel-launch
  API calls, a cross-check of ``kernels``; a ``+graphs`` subject's replayed kernels are one
  ``cudaGraphLaunch``, not counted there), ``kernel_ms`` (their summed device time),
  ``copies`` (memcpy and memset on the device) and ``device_ms`` (kernels and copies),
  ``syncs`` (calls in the step that block the host on the device: ``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, a blocking ``cudaMemcpy``, and their
  driver twins) and ``dtoh_copies`` (device-to-host copies: an ``.item()``, a ``nonzero``...).
  ``profiled_host_ms``: the step's host time under the profiler (inflated by it).
- ``top``: the ``--top`` kernels and copies (CUDA) or host events (CPU) with the most self time
  per step (the median over the profiled steps), and its share of the median step's device
  time (CUDA) or host time (CPU).

At negligible sizes on a CPU (``--vocab 1000 --hidden 32 --tokens 32 --threads 1``) ``host_ms``
and the op counts are a proxy for the launch-bound regime: what each head costs a GPU whose
kernels take no time. ``--plans cuda`` runs CUDA's execution plans there (compiled bodies,
GPU-sized tiles, launch-bound steps plainly: ``heads.kernels.chunks.GPU_PLAN_DEVICES``), so the
counts are those of the plans a GPU runs; a compiled body counts as its call, not its kernels.
``--triton stub`` (with Triton installed) also runs the rows plans' Triton tiles there, as a GPU
with Triton does: Triton's interpreter takes each launch, which does nothing but leave one host
event, counted as ``triton_launches`` (the tiles' results are then garbage, their host work a
GPU step's: the operators around the kernels, and one launch each).

JSON (``--out``/``--name``.json): ``schema`` (``profile/1``), ``args``, ``options``,
``machine`` and ``results`` (one row per subject) as the benchmark writes them; a ``--note``
is kept as ``note``. ``python -m app.results`` renders it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from app.bench.run import Case, add_subject_args, bench_options, first_step, make_targets
from app.bench.subjects import FRAGMENTS, PRECISIONS, head_config, parse_head, parse_subject
from app.bench.timing import check_device, release_compile_workers, sync
from app.machine import load_average
from heads.errors import UserError
from heads.kernels.chunks import GPU_PLAN_DEVICES

SCHEMA = "profile/1"
STEP, HOST = "profile.step", "profile.host"  # the markers: a step with its sync, its host part
TRITON_LAUNCH = "profile.triton_launch"  # a Triton kernel's launch, stubbed (--triton stub)
# the profiler's activity types -> what is counted: host events (operators, annotations), CUDA
# runtime and driver calls (on the host), kernels and copies (on the device); others ignored
KINDS = {"cpu_op": "cpu", "user_annotation": "cpu", "python_function": "cpu",
         "cuda_runtime": "runtime", "cuda_driver": "runtime",
         "kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "copy"}  # fmt: skip
SYNC_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2",
})  # fmt: skip
# CUDA runtime and driver API calls (cudaLaunchKernel, cuMemcpyDtoH_v2...), by name where the
# profiler names no activity type (torch before 2.12: FunctionEvent has no activity_type)
RUNTIME_CALL = re.compile(r"cu(da)?[A-Z]")
LAUNCH_CALLS = ("cudaLaunch", "cuLaunch")  # name prefixes of the kernel-launch API calls
CUDA_FIELDS = ("kernels", "launch_calls", "kernel_ms", "copies", "device_ms", "syncs",
               "dtoh_copies")  # fmt: skip


@dataclass(frozen=True)
class Event:
    """One profiler event, reduced to what is counted (times in microseconds)."""

    name: str
    kind: str  # "cpu", "runtime" (host side), "kernel", "copy" (device side) or "marker"
    start: float
    end: float
    self_us: float = 0.0  # host events: the time in none of their children
    top: bool = False  # an ``aten::*`` event under no other ``aten::*`` event

    @property
    def duration(self) -> float:
        return self.end - self.start


def reduce_events(function_events: Iterable) -> list[Event]:
    """``torch.profiler``'s ``FunctionEvent``s -> :class:`Event`s (unknown kinds dropped: e.g.
    the device-side copies of the markers)."""
    events = []
    for event in function_events:
        kind = event_kind(event)
        if kind is None:
            continue
        if kind == "cpu" and event.name in (STEP, HOST):
            kind = "marker"
        host = kind in ("cpu", "runtime")
        top = False
        if kind == "cpu" and event.name.startswith("aten::"):
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            top = parent is None
        events.append(Event(event.name, kind, event.time_range.start, event.time_range.end,
                            event.self_cpu_time_total if host else 0.0, top))  # fmt: skip
    return events


def event_kind(event) -> str | None:
    """What a ``FunctionEvent`` counts as (:data:`KINDS`), from its activity type where the
    profiler gives one, else from its device and name; None: not counted."""
    activity = getattr(event, "activity_type", None)
    if activity:
        return KINDS.get(activity)
    if event.device_type == DeviceType.CPU:
        return "runtime" if RUNTIME_CALL.match(event.name) else "cpu"
    if event.name in (STEP, HOST):  # a marker's span on the device's timeline: no kernel
        return None
    return "copy" if event.name.startswith(("Memcpy", "Memset")) else "kernel"


def _windows(events: list[Event], name: str) -> list[tuple[float, float]]:
    return sorted((e.start, e.end) for e in events if e.kind == "marker" and e.name == name)


def _within(events: list[Event], window: tuple[float, float]) -> list[Event]:
    """The events that start in ``window`` (on any thread: CUDA's backward runs on its own)."""
    return [e for e in events if window[0] <= e.start < window[1]]


def summarize(events: list[Event], cuda: bool, top: int = 10) -> dict:
    """The per-step counts of the profiled steps (each a ``HOST`` marker inside a ``STEP``
    marker, the step's closing sync between the two ends: device work is counted up to the
    sync, host calls only inside the step) and the ``top`` entries by self time."""
    hosts, steps = _windows(events, HOST), _windows(events, STEP)
    if not hosts or len(hosts) != len(steps):
        raise ValueError(f"want one {HOST!r} marker in each {STEP!r} marker, got "
                         f"{len(hosts)} and {len(steps)}")  # fmt: skip
    # per step: (its whole time, each name's self time), on the host and on the device (CUDA)
    counted, on_host_spent, on_device_spent = [], [], []
    for host, step in zip(hosts, steps, strict=True):
        totals: dict[str, float] = defaultdict(float)
        host_totals: dict[str, float] = defaultdict(float)
        on_host = [e for e in _within(events, host) if e.kind in ("cpu", "runtime")]
        aten = [e for e in on_host if e.kind == "cpu" and e.name.startswith("aten::")]
        host_us = host[1] - host[0]
        outside = max(0.0, host_us - sum(e.self_us for e in on_host))
        row = {"profiled_host_ms": host_us / 1e3, "aten_ops": len(aten),
               "aten_ops_top": sum(e.top for e in aten), "outside_ops_ms": outside / 1e3,
               "outside_ops_share": outside / host_us if host_us else 0.0,
               "triton_launches": sum(e.name == TRITON_LAUNCH for e in on_host)}  # fmt: skip
        if cuda:
            device = [e for e in _within(events, step) if e.kind in ("kernel", "copy")]
            kernels = [e for e in device if e.kind == "kernel"]
            calls = [e.name for e in on_host if e.kind == "runtime"]
            row.update(
                kernels=len(kernels),
                launch_calls=sum(name.startswith(LAUNCH_CALLS) for name in calls),
                kernel_ms=sum(e.duration for e in kernels) / 1e3,
                copies=len(device) - len(kernels),
                device_ms=sum(e.duration for e in device) / 1e3,
                syncs=sum(name in SYNC_CALLS for name in calls),
                dtoh_copies=sum(e.kind == "copy" and "DtoH" in e.name for e in device),
            )
            for e in device:
                totals[e.name] += e.duration
            on_device_spent.append((sum(totals.values()), totals))
        for e in on_host:
            host_totals[e.name] += e.self_us
        counted.append(row)
        on_host_spent.append((host_us, host_totals))
    summary = {"steps": counted, "top_of": "device" if cuda else "host",
               "top": _ranked(on_device_spent if cuda else on_host_spent, top)}  # fmt: skip
    if cuda:  # which host calls a host-bound step spends its time in (H100, 2026-11-27: the
        # adaptive softmax's 294 operators took 24 ms of host time after a compiled subject)
        summary["top_host"] = _ranked(on_host_spent, top)
    return summary


def _ranked(spent: list[tuple[float, dict[str, float]]], top: int) -> list[dict]:
    """The ``top`` names by their median time per step (robust to one step a busy machine
    stalled) over ``spent`` (per step: its whole time and each name's), with their share of
    the median step's whole."""
    whole = statistics.median(total for total, _ in spent)
    names = {name for _, totals in spent for name in totals}
    median = {name: statistics.median(totals.get(name, 0.0) for _, totals in spent)
              for name in names}  # fmt: skip
    ranked = sorted(median.items(), key=lambda item: (-item[1], item[0]))[:top]
    return [{"name": name[:500], "ms_per_step": us / 1e3, "share": us / whole if whole else 0.0}
            for name, us in ranked]  # fmt: skip


def timed_steps(step: Callable[[], None], device: torch.device, count: int):
    """``count`` steps without the profiler: the host's and the wall's milliseconds of each."""
    host, wall = [], []
    for _ in range(count):
        sync(device)
        start = time.perf_counter()
        step()
        returned = time.perf_counter()
        sync(device)
        host.append((returned - start) * 1e3)
        wall.append((time.perf_counter() - start) * 1e3)
    return host, wall


def profiled_steps(step: Callable[[], None], device: torch.device, count: int, top: int) -> dict:
    """One warm-up step under the profiler, then ``count`` marked steps (:func:`summarize`)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        step()  # the profiler's own first-use costs go here, outside the markers
        sync(device)
        for _ in range(count):
            with record_function(STEP):
                with record_function(HOST):
                    step()
                sync(device)
    return summarize(reduce_events(prof.events()), cuda, top)


def profile_case(case: Case, args: argparse.Namespace, failed: dict[str, str]) -> dict | None:
    """One subject's row: its timed and profiled steps (None where its first step fails:
    recorded in ``failed``, as the benchmark does)."""
    built = first_step(case, failed)
    if built is None:
        return None
    module, step = built
    for _ in range(args.warmup):
        step()
    release_compile_workers()  # compiled: none of its workers beside the timed steps
    host, wall = timed_steps(step, case.device, args.steps)
    counts = profiled_steps(step, case.device, args.steps, args.top)
    steps = counts["steps"]

    def median(key: str):
        return statistics.median(s[key] for s in steps) if key in steps[0] else None

    row = {
        "head": case.name, "vocab_size": case.vocab, "hidden_size": case.hidden,
        "tokens": case.tokens, "precision": case.precision,
        "host_ms": statistics.median(host), "wall_ms": statistics.median(wall),
        "host_times_ms": host, "wall_times_ms": wall,
        **{key: median(key) for key in ("profiled_host_ms", "aten_ops", "aten_ops_top",
                                        "outside_ops_ms", "outside_ops_share",
                                        "triton_launches", *CUDA_FIELDS)},
        **counts, "parameters": sum(p.numel() for p in module.parameters()),
    }  # fmt: skip
    del module, step
    if case.device.type == "cuda":
        torch.cuda.empty_cache()  # the next subject starts from the same free memory
    return row


def run(args: argparse.Namespace, save: Callable[[dict], None] | None = None) -> dict:
    """Every subject profiled in turn; ``save(report)``, where given, gets the report so far
    after each subject (a run cut short by a time limit keeps the subjects it finished)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    emulated = args.plans == "cuda" and args.device == "cpu"
    if emulated:  # the GPU's plans on this CPU: what a launch-bound GPU step dispatches
        GPU_PLAN_DEVICES.add("cpu")
    try:
        with stubbed_triton() if emulated and args.triton == "stub" else contextlib.nullcontext():
            return _run(args, save)
    finally:
        torch.set_num_threads(threads)  # as it was: main() may run inside a longer process
        if emulated:
            GPU_PLAN_DEVICES.discard("cpu")


@contextlib.contextmanager
def stubbed_triton():
    """The rows plans' Triton tiles on this CPU (``heads.kernels.rows_ce.TRITON_DEVICES``),
    each launch taken by Triton's interpreter and turned into one :data:`TRITON_LAUNCH` host
    event that runs nothing: the host's work of a GPU step with Triton, kernels aside."""
    if importlib.util.find_spec("triton") is None:
        raise UserError("--triton stub needs Triton (pip install triton): it runs the Triton "
                        "tiles' host side")  # fmt: skip
    os.environ["TRITON_INTERPRET"] = "1"  # read as the kernels' modules are imported
    from triton.runtime import interpreter

    from heads.kernels import rows_ce, triton_rows

    if not isinstance(triton_rows._kernels().tile_statistics, interpreter.InterpretedFunction):
        raise UserError("--triton stub: Triton's kernels were imported before TRITON_INTERPRET=1 "
                        "was set; run it in a process of its own")  # fmt: skip

    def launch(self, *args, **kwargs) -> None:
        with record_function(TRITON_LAUNCH):
            return None

    devices, call = rows_ce.TRITON_DEVICES, interpreter.GridExecutor.__call__
    rows_ce.TRITON_DEVICES, interpreter.GridExecutor.__call__ = (*devices, "cpu"), launch
    try:
        yield
    finally:
        rows_ce.TRITON_DEVICES, interpreter.GridExecutor.__call__ = devices, call


def _run(args: argparse.Namespace, save: Callable[[dict], None] | None) -> dict:
    device = torch.device(args.device)
    options = bench_options(args)
    # the benchmark's targets, drawn as it draws them (app/bench/run.py's _cases)
    targets = make_targets("zipf", args.vocab, args.tokens, torch.Generator().manual_seed(1))
    results, failed = [], {}
    for index, name in enumerate(args.heads, start=1):
        case = Case(name, args.scope, args.vocab, args.hidden, args.tokens, targets, options,
                    device, bptt=35, precision=args.precision)  # fmt: skip
        start = time.perf_counter()
        row = profile_case(case, args, failed)
        if row is not None:
            results.append(row)
        print(f"[{index}/{len(args.heads)}] {name} ({time.perf_counter() - start:.1f} s)",
              flush=True)  # fmt: skip
        if save is not None and index < len(args.heads):
            save({**_report(args, options, device, results, failed),
                  "partial": f"{index} of {len(args.heads)} subjects"})  # fmt: skip
    return _report(args, options, device, results, failed)


def _report(args, options, device: torch.device, results: list[dict], failed: dict) -> dict:
    configs = {name: head_config(name, options) for name in FRAGMENTS
               if any(parse_subject(s).head == name for s in args.heads)}  # fmt: skip
    report = {
        "schema": SCHEMA, "args": vars(args), "options": {**asdict(options), "heads": configs},
        "results": list(results), "failed": dict(failed),
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "device": str(device),
                    "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                    "load_average": load_average()},
    }  # fmt: skip
    if args.note:
        report["note"] = args.note
    return report


def short_name(name: str, width: int = 48) -> str:
    """A kernel's or operator's name for a table: no ``void``, no argument list, no
    ``at::native::`` or anonymous namespaces, at most ``width`` characters."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    name = name.replace("at::native::", "")
    if name.endswith(")"):  # drop the argument list: the ( matching the last )
        depth = 0
        for index in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[index], 0)
            if depth == 0:
                name = name[:index] if index > 0 else name
                break
    return name if len(name) <= width else name[: width - 3] + "..."


def top_text(row: dict, count: int, width: int = 40, key: str = "top") -> str:
    """``name 41%, name 12%, ...``: the first ``count`` of a row's ``key`` entries (``top``,
    or on CUDA ``top_host``)."""
    return ", ".join(f"{short_name(t['name'], width)} {100 * t['share']:.0f}%"
                     for t in row[key][:count])  # fmt: skip


def _cell(value, decimals: int = 0) -> str:
    return "-" if value is None else f"{value:.{decimals}f}"


def table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """The printed (and rendered) table's header and rows: the CUDA columns on CUDA only."""
    cuda = report["machine"]["device"].startswith("cuda")
    stubs = report["args"].get("triton") == "stub"
    header = ["head", "host ms", *(["wall ms", "kernel ms", "kernels", "syncs"] if cuda else []),
              "aten ops", "top-level ops", *(["Triton launches"] if stubs else []),
              "% outside ops"]  # fmt: skip
    rows = []
    for row in report["results"]:
        rows.append([row["head"], _cell(row["host_ms"], 3),
                     *([_cell(row["wall_ms"], 3), _cell(row["kernel_ms"], 3),
                        _cell(row["kernels"]), _cell(row["syncs"])] if cuda else []),
                     _cell(row["aten_ops"]), _cell(row["aten_ops_top"]),
                     *([_cell(row.get("triton_launches"))] if stubs else []),
                     _cell(100 * row["outside_ops_share"])])  # fmt: skip
    return header, rows


def print_table(report: dict, top: int = 5) -> None:
    """The counts, one line per subject, then each subject's first ``top`` entries."""
    header, rows = table_rows(report)
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    print()
    for line in [header, *rows]:
        print("  ".join(f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}"
                        for i, (cell, w) in enumerate(zip(line, widths, strict=True))))  # fmt: skip
    args = report["args"]
    print(f"(V={args['vocab']} d={args['hidden']} tokens={args['tokens']} {args['precision']} "
          f"on {report['machine']['cuda'] or report['machine']['device']}; medians of "
          f"{args['steps']} steps; ops counted per step)")  # fmt: skip
    which = "kernels by device time" if rows and report["results"][0]["top_of"] == "device" else (
        "host events by self time")  # fmt: skip
    print(f"top {which} (share):")
    for row in report["results"]:
        print(f"  {row['head']}: {top_text(row, top)}")
    if any("top_host" in row for row in report["results"]):
        print("top host events by self time (share of the step's host time):")
        for row in report["results"]:
            print(f"  {row['head']}: {top_text(row, top, key='top_host')}")


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"want a positive integer, got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.bench.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # fmt: skip
    add_subject_args(parser)  # --heads and how the heads are built, as the benchmark's
    parser.add_argument("--vocab", type=_positive, default=10_000)
    parser.add_argument("--hidden", type=_positive, default=512)
    parser.add_argument("--tokens", type=_positive, default=2048, help="tokens per step")
    parser.add_argument("--scope", choices=["head", "lm"], default="head",
                        help="lm: a step of the whole LSTM language model around each head "
                        "(the benchmark's --scope lm: streams of 35 tokens)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="32-true",
                        help="as Lightning's --trainer.precision")  # fmt: skip
    parser.add_argument("--threads", type=_positive, default=None,
                        help="torch's intra-op threads (default: its own); 1 for the CPU "
                        "launch-bound proxy, steadier on a shared machine")  # fmt: skip
    parser.add_argument("--plans", choices=["device", "cuda"], default="device",
                        help="cuda (with --device cpu): run CUDA's execution plans on the CPU "
                        "(compiled bodies, GPU-sized tiles, launch-bound steps plainly): at "
                        "negligible sizes, the operators a GPU step dispatches")  # fmt: skip
    parser.add_argument("--triton", choices=["none", "stub"], default="none",
                        help="stub (with --plans cuda on a CPU, Triton installed): the rows "
                        "plans' Triton tiles too, each launch one host event that runs "
                        "nothing (their results garbage): a GPU step's host work")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--steps", type=_positive, default=3,
                        help="steps timed, then as many profiled")  # fmt: skip
    parser.add_argument("--top", type=_positive, default=10, help="entries by self time kept")
    parser.add_argument("--out", default="bench_results", help="folder for the JSON")
    parser.add_argument("--name", default="profile", help="file stem")
    parser.add_argument("--note", default=None, help="kept in the JSON as its note")
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.triton == "stub" and not (args.plans == "cuda" and args.device == "cpu"):
        parser.error("--triton stub goes with --plans cuda --device cpu (on a GPU the kernels run)")
    try:  # a bad override, named now rather than after the first subjects
        options = bench_options(args)
        for name in sorted({parse_subject(s).head for s in args.heads} & set(FRAGMENTS)):
            parse_head(head_config(name, options), 8, 64)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}.json"

    def save(report: dict) -> None:  # the partial reports too, each over the last
        path.write_text(json.dumps(report, indent=1))

    report = run(args, save)
    save(report)
    print_table(report)
    print(f"wrote {path}")
    for subject, message in report["failed"].items():
        print(f"FAILED {subject}: {message}", file=sys.stderr)
    return report


if __name__ == "__main__":
    from app.bench.run import exit_code
    from app.cli.console import exit_status

    sys.exit(exit_status(lambda: exit_code(main())))
