"""The Triton tiles' launch settings timed on a GPU: ``python -m app.bench.sweep``.

The rows plan's kernels (``heads.kernels.triton_rows.Launch``: programs an SM, loads in flight
a thread, warps) and Mixtape's frequent-block kernels
(``heads.kernels.triton_mixtape.COLUMNS_PER_THREAD``) are launched as the compiled code and
the GPU's sizes suggest (``python -m app.bench.kernels``: registers, load widths, barriers),
not yet as a GPU's clock says; nor is the choice between cuBLAS's products with those
kernels between them and the fused products (``heads.kernels.triton_gemm``, opt-in:
``rows_ce.FUSED_PRODUCTS``), timed here under their own tiles (``GemmLaunch``; Mixtape's
frequent block's: ``FrequentLaunch``). This times the
subjects that run them (``softmax@rows``, ``mos@rows``, ``mixtape@rows``) under each setting,
the bare matmul beside them, at one size:
each figure the median of ``--repeats``, a repeat ``--steps`` steps back to back (as
``app.bench --steps-per-repeat``). JSON into ``--out``; the fastest settings are the ones to
make the defaults. Without Triton (a CPU) the settings change nothing, and the JSON says so.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from app.bench.run import Case, build_case, make_targets
from app.bench.subjects import BenchOptions
from app.bench.timing import check_device, time_once
from app.machine import load_average
from heads.kernels import rows_ce, triton_gemm, triton_mixtape, triton_mixtape_gemm, triton_rows
from heads.kernels.triton_gemm import GemmLaunch
from heads.kernels.triton_mixtape_gemm import FrequentLaunch
from heads.kernels.triton_rows import Launch, triton_available

SCHEMA = "sweep/1"
# the rows kernels' settings tried: the default, fewer or more rows at once (L2 reuse against
# loads in flight), fewer loads in flight, one 16-warp program an SM (132 rows of 100k: 26 MB)
ROWS_SETTINGS = (Launch(), Launch(1, 4, 8), Launch(3, 4, 8), Launch(4, 2, 8), Launch(2, 2, 8),
                 Launch(1, 4, 16))  # fmt: skip
# Mixtape's: the default, half the columns a thread (fewer registers), 16-byte loads at K = 4
MIXTAPE_SETTINGS = ({2: 8, 4: 4}, {2: 4, 4: 2}, {2: 8, 4: 8})
# the rows plan's tiles as the fused products (rows_ce.FUSED_PRODUCTS): their default tiles,
# the forward's 128 x 256 (255 registers: one program an SM), dz W at 128 x 128 and 64
# columns a step (184), dz^T h at 64 x 256 and 32 rows a step (181), 64-column blocks, four
# operand buffers; each compiles without spills (Triton 3.9)
FUSED_SETTINGS = (
    GemmLaunch(), GemmLaunch(block_n=256),
    GemmLaunch(hidden_block_d=128, hidden_step=64),
    GemmLaunch(weight_block_c=64, weight_block_d=256, block_r=32),
    GemmLaunch(block_n=64, weight_block_c=64), GemmLaunch(stages=4),
)  # fmt: skip
# Mixtape's frequent block as fused products (heads/kernels/triton_mixtape_gemm.py), timed
# through mixtape@rows with the fused products on: its default tile, two operand buffers,
# 32-wide steps of d (141 and 150 registers; each compiles without spills, Triton 3.9)
FREQUENT_SETTINGS = (FrequentLaunch(), FrequentLaunch(stages=2), FrequentLaunch(block_k=32))
# the settings' groups, in the order timed (``--groups``)
GROUPS = ("rows", "fused", "frequent", "mixtape")


def _timed(name: str, args, targets: torch.Tensor) -> list[float]:
    """Milliseconds a step of subject ``name``, one figure a repeat (after two warm-up steps)."""
    device = torch.device(args.device)
    case = Case(name, "head", args.vocab, args.hidden, args.tokens, targets, BenchOptions(),
                device, 35, args.precision)  # fmt: skip
    torch.manual_seed(0)
    _, step = build_case(case)
    step()
    step()
    times = [1e3 * time_once(step, device, steps=args.steps) for _ in range(args.repeats)]
    del step
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def _row(subject: str, setting: dict, times: list[float], default: bool = True) -> dict:
    print(f"  {subject:14} {json.dumps(setting):48} {statistics.median(times):9.3f} ms",
          flush=True)  # fmt: skip
    return {"subject": subject, "setting": setting, "default": default,
            "time_ms": statistics.median(times), "times_ms": times}  # fmt: skip


def run(args: argparse.Namespace, save: Callable[[dict], None] | None = None) -> dict:
    """Every setting of every subject timed; the report. ``save(report)`` (if given) after each
    row: a run cut short (a lent GPU's time limit) keeps the rows it timed."""
    targets = make_targets("zipf", args.vocab, args.tokens, torch.Generator().manual_seed(0))
    default_launch, default_columns = triton_rows.LAUNCH, triton_mixtape.COLUMNS_PER_THREAD
    default_fused, default_gemm = rows_ce.FUSED_PRODUCTS, triton_gemm.GEMM_LAUNCH
    default_frequent = triton_mixtape_gemm.FREQUENT_LAUNCH
    device = torch.device(args.device)
    rows: list[dict] = []
    report = {
        "schema": SCHEMA, "args": vars(args), "results": rows,
        "defaults": {"launch": asdict(default_launch),
                     "columns_per_thread": {str(k): v for k, v in default_columns.items()},
                     "fused_products": asdict(default_gemm) if default_fused else None,
                     "fused_frequent": asdict(default_frequent) if default_fused else None},
        "triton": triton_available() and device.type == "cuda",
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "device": str(device), "load_average": load_average(),
                    "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
    }  # fmt: skip

    def add(subject: str, setting: dict, default: bool = True) -> None:
        rows.append(_row(subject, setting, _timed(subject, args, targets), default))
        if save is not None:
            save(report)

    add("matmul", {})
    groups = set(args.groups)
    try:
        rows_ce.FUSED_PRODUCTS = False
        for launch in ROWS_SETTINGS if "rows" in groups else ():
            triton_rows.LAUNCH = launch
            for subject in ("softmax@rows", "mos@rows"):
                add(subject, asdict(launch), launch == default_launch and not default_fused)
        triton_rows.LAUNCH = default_launch
        rows_ce.FUSED_PRODUCTS = True
        for gemm in FUSED_SETTINGS if "fused" in groups else ():
            triton_gemm.GEMM_LAUNCH = gemm
            for subject in ("softmax@rows", "mos@rows"):
                add(subject, {"fused_products": asdict(gemm)},
                    default_fused and gemm == default_gemm)  # fmt: skip
        for frequent in FREQUENT_SETTINGS if "frequent" in groups else ():
            triton_mixtape_gemm.FREQUENT_LAUNCH = frequent
            add("mixtape@rows", {"fused_frequent": asdict(frequent)},
                default_fused and frequent == default_frequent)  # fmt: skip
        triton_mixtape_gemm.FREQUENT_LAUNCH = default_frequent
        rows_ce.FUSED_PRODUCTS, triton_gemm.GEMM_LAUNCH = default_fused, default_gemm
        for columns in MIXTAPE_SETTINGS if "mixtape" in groups else ():
            triton_mixtape.COLUMNS_PER_THREAD = columns
            add("mixtape@rows", {"columns_per_thread": {str(k): v for k, v in columns.items()}},
                columns == default_columns)  # fmt: skip
    finally:
        triton_rows.LAUNCH, triton_mixtape.COLUMNS_PER_THREAD = default_launch, default_columns
        rows_ce.FUSED_PRODUCTS, triton_gemm.GEMM_LAUNCH = default_fused, default_gemm
        triton_mixtape_gemm.FREQUENT_LAUNCH = default_frequent
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench.sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="steps a repeat, back to back")
    parser.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS),
                        help="which settings to time (all by default): the rows kernels' "
                        "launches, the fused products' tiles, Mixtape's fused frequent block's, "
                        "Mixtape's columns a thread")  # fmt: skip
    parser.add_argument("--out", default="bench_results", help="folder for the JSON")
    parser.add_argument("--name", default="sweep_tiles")
    args = parser.parse_args(argv)
    check_device(parser, args.device)
    for name in ("vocab", "hidden", "tokens", "repeats", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out) / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(report: dict) -> None:
        out.write_text(json.dumps(report, indent=1) + "\n")

    report = run(args, save)
    if not report["triton"]:
        print("no Triton tiles here (Triton on CUDA): the settings changed nothing",
              file=sys.stderr)  # fmt: skip
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
