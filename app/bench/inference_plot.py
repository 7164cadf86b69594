"""Top-k accuracy against top-k latency, from ``python -m app.bench --mode inference`` JSON.

    python -m app.bench.inference_plot docs/results/ds_inference_ptb.json \\
        --out docs/results/ds_inference_ptb.png

One panel per k in (1, 5, 10): accuracy on the test split (y) against the median latency
per query (x, log scale) at batch 1, and in a second row batched, for the softmax, every DS
model and every DS+SVD variant of the report. The shaded band is the reference softmax's
accuracy +- 0.3 points ("equal accuracy" in issue 19); the dotted verticals mark 15x and 20x
the softmax's speed. Needs a report made from checkpoints (synthetic heads have no accuracy).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter  # noqa: E402

ACCURACY_K = (1, 5, 10)
BAND_POINTS = 0.3
SPEEDUP_MARKS = (15, 20)
TIMINGS = (("batch1_us_per_query", "batch 1"), ("batched_us_per_query", "batched"))


def kind_of(name: str) -> str:
    if "+svd" in name:
        return "DS+SVD"
    return "softmax" if name.startswith("softmax") else "DS"


STYLE = {"softmax": ("k", "s"), "DS": ("tab:blue", "o"), "DS+SVD": ("tab:orange", "^")}


def plot(report: dict[str, Any], out: Path) -> Path:
    quality = report.get("quality", {})
    if not any("acc_top1" in metrics for metrics in quality.values()):
        raise SystemExit("error: this report has no accuracy (synthetic heads): plot a report "
                         "made from checkpoints")  # fmt: skip
    reference = report["reference"]
    batch_size = report["args"].get("batch_size", "?")
    fig, axes = plt.subplots(len(TIMINGS), len(ACCURACY_K), figsize=(13, 7.5), squeeze=False)
    for row, (key, label) in enumerate(TIMINGS):
        base_time = report["latency"][reference][key]
        for col, k in enumerate(ACCURACY_K):
            ax = axes[row][col]
            metric = f"acc_top{k}"
            base = quality[reference][metric]
            ax.axhspan(base - BAND_POINTS / 100, base + BAND_POINTS / 100, color="0.9",
                       label=f"softmax +- {BAND_POINTS} pt")  # fmt: skip
            for speedup in SPEEDUP_MARKS:
                ax.axvline(base_time / speedup, color="0.6", linestyle=":", linewidth=1)
                ax.annotate(f"{speedup}x", (base_time / speedup, 0.02), xycoords=("data",
                            "axes fraction"), fontsize=7, color="0.4")  # fmt: skip
            for name, metrics in quality.items():  # accuracy-only softmax checkpoints
                if name not in report["latency"] and metric in metrics:
                    ax.axhline(metrics[metric], color="0.5", linestyle="--", linewidth=0.8)
                    ax.annotate(name, (0.01, metrics[metric]), xycoords=("axes fraction",
                                "data"), fontsize=6, color="0.4", va="bottom")  # fmt: skip
            seen = set()
            timed = [n for n in report["latency"] if metric in quality.get(n, {})]
            for i, name in enumerate(timed):
                times, kind = report["latency"][name], kind_of(name)
                color, marker = STYLE[kind]
                ax.scatter(times[key], quality[name][metric], color=color, marker=marker,
                           label=None if kind in seen else kind, zorder=3)  # fmt: skip
                seen.add(kind)
                # alternate above/below: DS variants often share an accuracy
                ax.annotate(name, (times[key], quality[name][metric]), fontsize=6,
                            xytext=(3, 4 if i % 2 else -9), textcoords="offset points")  # fmt: skip
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_title(f"top-{k}, {label}" + (f" ({batch_size})" if row else ""), fontsize=9)
            ax.set_xlabel("us per query (median)", fontsize=8)
            if col == 0:
                ax.set_ylabel("test accuracy", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, loc="best")
    machine = report.get("machine", {})
    # None where the OS has no load average (app.machine.load_average)
    load = (machine.get("load_average") or [float("nan")])[0]
    fig.suptitle(f"top-{report['args'].get('k', 10)} latency vs accuracy; {machine.get('device')}, "
                 f"{machine.get('threads')} thread(s), load average "
                 f"{load:.2f}", fontsize=10)  # fmt: skip
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench.inference_plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("report", help="JSON written by python -m app.bench --mode inference")
    parser.add_argument("--out", default=None, help="PNG path (default: beside the JSON)")
    args = parser.parse_args(argv)
    path = Path(args.report)
    out = Path(args.out) if args.out else path.with_suffix(".png")
    written = plot(json.loads(path.read_text()), out)
    print(f"wrote {written}")
    return written


if __name__ == "__main__":
    main()
