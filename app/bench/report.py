"""Table and plot of a benchmark report."""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import matplotlib

from app.bench.flops import counted_products
from app.bench.timing import interval_text, paired_ratio

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _peer(rows: list[dict], row: dict, head: str) -> dict | None:
    """The ``head`` row measured at the same vocabulary and hidden size as ``row``."""
    return next((r for r in rows if r["head"] == head and r["vocab_size"] == row["vocab_size"]
                 and r["hidden_size"] == row["hidden_size"]), None)  # fmt: skip


def softmax_reference(rows: list[dict]) -> str:
    """The head that ``x softmax`` divides by: ``softmax``, or in a run without that row (one
    that times only plans, as ``softmax@rows`` against ``softmax@rows+graphs``) its first row of
    the softmax family."""
    family = [r["head"] for r in rows if r["head"].split("+")[0].partition("@")[0] == "softmax"]
    return "softmax" if "softmax" in family or not family else family[0]


class Figures(NamedTuple):
    """A row's derived figures, nan where not measured."""

    rel: float  # time per token over the softmax's (same V and d; softmax_reference)
    rel_low: float  # 95% confidence interval of ``rel`` (nan: not paired, or too few repeats)
    rel_high: float
    gflop: float  # the step's matrix-product GFLOP
    rate: float  # their rate in % of the bare matmul row's
    memory: float  # MiB: the step's extra peak (older files: the process's peak)


def paired_row_ratio(row: dict, reference: dict) -> tuple[float, float, float] | None:
    """``row``'s time per token over ``reference``'s, repeat by repeat: the benchmark runs
    the subjects in rounds, so repeat i of both saw the same machine state. The median of
    those ratios and its 95% confidence interval (``app.bench.timing.paired_ratio``). None
    without paired times."""
    mine, theirs = row.get("times_ms"), reference.get("times_ms")
    if not mine or not theirs or len(mine) != len(theirs):
        return None
    scale = reference["tokens"] / row["tokens"]
    return paired_ratio([t * scale for t in mine], theirs)


def row_figures(rows: list[dict], row: dict, memory_key: str = "extra_peak_mb") -> Figures:
    """``row``'s derived figures (``Figures``); ``memory_key``: older files hold the
    process's peak instead of the step's extra peak."""
    nan = float("nan")
    softmax = _peer(rows, row, softmax_reference(rows))
    matmul = _peer(rows, row, "matmul")
    rel = low = high = nan  # no softmax row, or not timed (--time skip)
    if softmax and row.get("time_per_token_us") and softmax.get("time_per_token_us"):
        paired = paired_row_ratio(row, softmax)
        if paired is None:  # no repeat-by-repeat times: the ratio of the medians
            rel = row["time_per_token_us"] / softmax["time_per_token_us"]
        else:
            rel, low, high = paired
    # None: --flops skip, or (older files: a count of 0 or a fraction) kernels it cannot see
    counted = counted_products(row["head"])
    gflop = row.get("matmul_gflop") if counted else None
    rate = nan
    if counted and matmul and row.get("matmul_gflop_per_s") and matmul.get("matmul_gflop_per_s"):
        rate = row["matmul_gflop_per_s"] / matmul["matmul_gflop_per_s"] * 100
    memory = row.get(memory_key)
    return Figures(rel, low, high, nan if gflop is None else gflop, rate,
                   nan if memory is None else memory)  # fmt: skip


# the field's implementations each of our heads is timed against, where a bench has them
PEERS_OF = {"adaptive": ("torch_adaptive",), "softmax": ("cce", "liger")}


def peer_speedups(rows: list[dict]) -> list[str]:
    """One line per (our head, the field's peer) pair timed at the same V and d: how many
    times as fast ours is, from the repeats' paired ratios, with the 95% interval."""
    lines = []
    for row in rows:
        head = row["head"].split("+")[0].partition("@")[0]  # no modifier, no backend
        for name in PEERS_OF.get(head, ()):
            peer = _peer(rows, row, name)
            paired = None if peer is None else paired_row_ratio(row, peer)
            if paired is None:
                continue
            ratio, low, high = paired
            lines.append(
                f"`{row['head']}` against `{name}` (V={row['vocab_size']}, "
                f"d={row['hidden_size']}): {1 / ratio:.2f}x as fast, 95% CI "
                f"{interval_text(1 / high, 1 / low)}"
            )
    return lines


def print_table(report: dict) -> None:
    """One line per row (``-`` where not measured). ``x softmax``: time per token over the
    softmax's (the median of the repeats' paired ratios), ``95% CI`` its confidence interval;
    ``GFLOP``: the step's matrix products; ``% matmul``: their rate over the bare matmul row's;
    ``extra MiB``: the step's extra peak memory (``app/bench/memory.py``)."""
    rows = report["results"]
    ratio = f"x {softmax_reference(rows)}"
    width = max(11, len(ratio) + 2)
    print(f"\n{'head':<22}{'V':>8}{'d':>6}{'tokens':>8}{'ms/batch':>11}{'us/token':>10}"
          f"{ratio:>{width}}{'95% CI':>14}{'GFLOP':>9}{'% matmul':>10}"
          f"{'extra MiB':>11}")  # fmt: skip
    for row in rows:
        rel, low, high, gflop, rate, memory = row_figures(rows, row)
        print(f"{row['head']:<22}{row['vocab_size']:>8}{row['hidden_size']:>6}{row['tokens']:>8}"
              f"{_number(row['time_ms'], 11, 2)}{_number(row['time_per_token_us'], 10, 3)}"
              f"{_number(rel, width, 2)}{interval_text(low, high):>14}{_number(gflop, 9, 1)}"
              f"{_number(rate, 10, 0)}{_number(memory, 11, 1)}")  # fmt: skip
    for line in peer_speedups(rows):
        print(line.replace("`", ""))


def _number(value: float | None, width: int, decimals: int) -> str:
    missing = value is None or math.isnan(value)  # (not measured, or no row to compare with)
    return f"{'-':>{width}}" if missing else f"{value:>{width}.{decimals}f}"


def save_plot(report: dict, path: Path) -> None:
    rows = report["results"]
    heads = list(dict.fromkeys(r["head"] for r in rows))
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for head in heads:
        mine = sorted((r for r in rows if r["head"] == head), key=lambda r: r["vocab_size"])
        vocab = [r["vocab_size"] for r in mine]
        timed = [float("nan") if r.get("time_per_token_us") is None else r["time_per_token_us"]
                 for r in mine]  # fmt: skip
        ax_time.plot(vocab, timed, marker="o", label=head)
        memory = [float("nan") if r.get("extra_peak_mb") is None else r["extra_peak_mb"]
                  for r in mine]  # fmt: skip
        ax_mem.plot(vocab, memory, marker="o", label=head)
    args = report["args"]
    for ax, label in (
        (ax_time, "time per token (us), fwd+bwd"),
        (ax_mem, "extra peak memory of a step (MiB)"),
    ):
        ax.set_xscale("log")
        if any((line.get_ydata(orig=False) > 0).any() for line in ax.lines):
            ax.set_yscale("log")  # not when nothing was measured (--memory skip: all nan)
        ax.set_xlabel("vocabulary size")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend()
    fig.suptitle(f"{args['mode']}, scope={args['scope']}, device={report['machine']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
