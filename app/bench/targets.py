"""Issue 28's GPU targets, read off the GPU runs' JSON: ``python -m app.bench.targets FILE...``.

``bash .ci/gpu`` ends with it, so whoever runs the GPU command sees at once which of the heads'
claims the run supports. The targets (one GPU, bf16, d = 512, 16,384 tokens; stated for an
H100, so another card's run is named as such):

- softmax at V = 100k runs at >= 80% of the bare matmul's speed (its three products alone);
- softmax is no slower than CCE and Liger in the same run, at every size timed;
- softmax's extra peak memory at V = 100k is <= 1 GiB;
- MoS-15 at V = 100k is within 1.3x of its FLOP floor (15 bare matmuls) and fits >= 16,384
  tokens in 12 GiB (the memory part's same-memory search, ``--memory-budget-mb 12288``: a
  search within a larger budget leaves the target unmeasured, one within a smaller budget
  can meet it but not fail it);
- Mixtape / softmax <= 1.5 at V = 100k and <= 2.0 at V = 10k;
- the adaptive softmax >= 1.5x as fast as PyTorch's ``AdaptiveLogSoftmaxWithLoss``;
- a whole PTB LM step with Mixtape <= 1.15x one with softmax (the lmstep part).

Where a run timed both heads' steps as CUDA graphs too (``+graphs``: a task's opt-in
``cuda_graphs``), the Mixtape / softmax targets get a second row for them, beside the default's;
where it timed the adaptive softmax's so, its target gets one against PyTorch's layer (whose
step reads its clusters' sizes back: it has no graph).

"Our" head at a size is its fastest plan in the run (the default, ``@rows``, ``@fused``,
``@plain``, ``@compiled``: what ``auto`` runs once ``app.bench.fastest``'s table is pasted),
never the field's kernels. Ratios are paired repeat by repeat
(``app.bench.report.paired_row_ratio``), with their 95% interval where the run has 6 repeats or
more; a target is met on the median, and says so where the interval holds the bound (``CI
spans the target``: another run may well decide otherwise).
A target whose subjects the files lack is ``unmeasured``. ``--json`` writes the table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from app.bench.flops import counted_products
from app.bench.report import paired_row_ratio

# a head's subjects that run our own code
OUR_PLANS = ("", "@rows", "@fused", "@plain", "@compiled")
# the same with the training step as CUDA graphs (a task's opt-in cuda_graphs)
GRAPHED = "+graphs"
MOS_COMPONENTS = 15
# the memory target's budget, 12 GiB: a same-memory run searched within another says nothing
MEMORY_BUDGET_MB = 12 * 1024


@dataclass
class Target:
    """One target: what it asks, the run's figure (its 95% interval) and whether it holds."""

    target: str
    figure: float | None = None
    low: float | None = None
    high: float | None = None
    met: bool | None = None  # None: unmeasured
    source: str = ""
    # a ratio's figure in counted FLOPs (the products' work): what the time ratio would be
    # if both sides ran their products equally fast, so how much of it the maths asks
    flops: float | None = None
    # the bound lies within the 95% interval: the median's verdict is the run's, not a sure one
    spans: bool = False

    @property
    def verdict(self) -> str:
        if self.met is None:
            return "unmeasured"
        return ("met" if self.met else "not met") + (" (CI spans the target)" if self.spans else "")

    def row(self) -> str:
        if self.met is None:
            return f"{self.target:62} {'-':>8} {'':13} unmeasured"
        interval = "" if _missing(self.low, self.high) else f"[{self.low:.2f}-{self.high:.2f}]"
        verdict = self.verdict.replace("not met", "NOT met")
        work = "" if self.flops is None else f" FLOPs {self.flops:.3g}"
        return (f"{self.target:62} {self.figure:8.4g} {interval:13} {verdict} ({self.source})"
                f"{work}")  # fmt: skip


def _missing(*values) -> bool:
    return any(v is None or math.isnan(v) for v in values)


class Runs:
    """One report's benchmark rows, found by subject, vocabulary size, scope and mode (a
    ratio's two rows always come from one run: one machine, one round of repeats)."""

    def __init__(self, path: str, report: dict) -> None:
        self.path, self.report, self.rows = path, report, report.get("results", [])
        self.card = report.get("machine", {}).get("cuda") or "no GPU"

    def mos_components(self) -> int:
        """The run's MoS K (its options; files written before they were kept: the default)."""
        heads = self.report.get("options", {}).get("heads", {})
        return heads.get("mos", {}).get("init_args", {}).get("num_components", MOS_COMPONENTS)

    def find(self, head: str, vocab: int | None = None, scope: str = "head",
             mode: str = "same-batch"):  # fmt: skip
        """``(file, row)`` of ``head`` (its first match; timed, in same-batch mode), or None."""
        for row in self.rows:
            if row["head"] != head or row.get("scope", "head") != scope:
                continue
            if row.get("mode", "same-batch") != mode:
                continue
            if vocab is not None and row["vocab_size"] != vocab:
                continue
            if mode == "same-batch" and row.get("time_ms") is None:
                continue
            return self.path, row
        return None

    def ours(self, head: str, vocab: int | None, scope: str = "head", modifier: str = ""):
        """``(file, row)`` of the fastest of ``head``'s own plans at ``vocab`` (each with
        ``modifier``: ``+graphs``), or None."""
        found = [x for plan in OUR_PLANS if (x := self.find(head + plan + modifier, vocab, scope))]
        return min(found, key=lambda x: x[1]["time_per_token_us"], default=None)

    def fits_nothing(self, head: str, vocab: int) -> bool:
        """Whether ``head`` fitted no batch at ``vocab`` in a same-memory search."""
        return any(x["head"] == head and x["vocab_size"] == vocab
                   for x in self.report.get("fits_nothing", []))  # fmt: skip

    def search_budget(self) -> float | None:
        """The MiB the run's same-memory search had (its ``args``), None where not recorded."""
        return self.report.get("args", {}).get("memory_budget_mb")

    def vocabularies(self, head: str) -> list[int]:
        return sorted({row["vocab_size"] for row in self.rows
                       if row["head"] == head and row.get("scope", "head") == "head"})  # fmt: skip


def _ratio(mine, reference, name: str, most: float | None = None, least: float | None = None,
           scale: float = 1.0, invert: bool = False) -> Target:  # fmt: skip
    """The paired time ratio ``mine / reference`` (times ``scale``; ``invert``: its inverse)
    against a bound."""
    if mine is None or reference is None:
        return Target(name)
    paired = paired_row_ratio(mine[1], reference[1])
    if paired is None:  # no repeat-by-repeat times: the medians
        paired = (mine[1]["time_per_token_us"] / reference[1]["time_per_token_us"], math.nan,
                  math.nan)  # fmt: skip
    median, low, high = (x * scale for x in paired)
    if invert:
        median, low, high = 1 / median, 1 / high, 1 / low
    met = (most is None or median <= most) and (least is None or median >= least)
    bound = most if most is not None else least
    spans = bound is not None and not _missing(low, high) and low <= bound <= high
    return Target(name, median, low, high, met, Path(mine[0]).name,
                  _flop_ratio(mine[1], reference[1], scale, invert), spans)  # fmt: skip


def _flop_ratio(mine: dict, reference: dict, scale: float, invert: bool) -> float | None:
    """``mine / reference`` in counted FLOPs a token (as the time ratio: times ``scale``,
    ``invert``), or None where either row lacks the count."""
    work = [row.get("matmul_gflop") if counted_products(row["head"]) else None
            for row in (mine, reference)]  # fmt: skip
    if any(w is None or w <= 0 or not math.isfinite(w) for w in work):
        return None
    ratio = scale * (work[0] / mine["tokens"]) / (work[1] / reference["tokens"])
    return 1 / ratio if invert else ratio


def evaluate(runs: Runs) -> list[Target]:
    """Every target from ``runs`` (module docstring)."""
    big, small = 100_000, 10_000
    targets = [
        _ratio(runs.ours("softmax", big), runs.find("matmul", big),
               "softmax speed / bare matmul's at 100k (>= 0.8)", least=0.8, invert=True),
    ]  # fmt: skip
    for vocab in runs.vocabularies("softmax"):
        for peer in ("cce", "liger"):
            found = runs.find(f"softmax@{peer}", vocab)
            if found:
                targets.append(_ratio(runs.ours("softmax", vocab), found,
                                      f"softmax / {peer.upper()} at {vocab // 1000}k (<= 1)",
                                      most=1.0))  # fmt: skip
    softmax = runs.ours("softmax", big)
    memory = None if softmax is None else softmax[1].get("extra_peak_mb")
    targets.append(
        Target("softmax extra peak MiB at 100k (<= 1024)", memory, met=memory <= 1024,
               source=Path(softmax[0]).name)
        if memory is not None else Target("softmax extra peak MiB at 100k (<= 1024)")
    )  # fmt: skip
    floor = "MoS-15 time / its FLOP floor at 100k (<= 1.3)"
    targets.append(
        _ratio(
            runs.ours("mos", big),
            runs.find("matmul", big),
            floor,
            most=1.3,
            scale=1 / MOS_COMPONENTS,
        )  # fmt: skip
        if runs.mos_components() == MOS_COMPONENTS
        else Target(floor)
    )
    fit = runs.find("mos", big, mode="same-memory")
    name = "MoS-15 tokens in 12 GiB at 100k (>= 16384)"
    budget = runs.search_budget()
    if budget is None or budget > MEMORY_BUDGET_MB or runs.mos_components() != MOS_COMPONENTS:
        # a larger budget's (or another K's) count says nothing of MoS-15 in 12 GiB: 48 GiB
        # fit 4x
        targets.append(Target(name))
    elif fit is not None and (fit[1]["tokens"] >= 16_384 or budget == MEMORY_BUDGET_MB):
        # (what fits in less fits in 12 GiB: a smaller budget's count meets it, never fails it)
        tokens = fit[1]["tokens"]
        targets.append(Target(name, tokens, met=tokens >= 16_384, source=Path(fit[0]).name))
    elif budget == MEMORY_BUDGET_MB and runs.fits_nothing("mos", big):  # measured, and 0
        targets.append(Target(name, 0, met=False, source=Path(runs.path).name))
    else:
        targets.append(Target(name))
    for vocab, bound in ((big, 1.5), (small, 2.0)):
        targets.append(_ratio(runs.ours("mixtape", vocab), runs.ours("softmax", vocab),
                              f"Mixtape / softmax at {vocab // 1000}k (<= {bound})",
                              most=bound))  # fmt: skip
        targets.extend(_graphed(runs, f"Mixtape / softmax at {vocab // 1000}k", bound, vocab))
    for vocab in runs.vocabularies("torch_adaptive"):
        name = f"adaptive speed / PyTorch's at {vocab // 1000}k"
        theirs = runs.find("torch_adaptive", vocab)  # (its step reads back: no graph of it)
        targets.append(_ratio(runs.ours("adaptive", vocab), theirs, f"{name} (>= 1.5)",
                              least=1.5, invert=True))  # fmt: skip
        graphed = runs.ours("adaptive", vocab, modifier=GRAPHED)
        if graphed is not None:
            targets.append(_ratio(graphed, theirs, f"{name}, cuda_graphs on (>= 1.5)",
                                  least=1.5, invert=True))  # fmt: skip
    targets.append(_ratio(runs.find("mixtape", scope="lm"), runs.find("softmax", scope="lm"),
                          "whole PTB LM step: Mixtape / softmax (<= 1.15)", most=1.15))  # fmt: skip
    targets.extend(_graphed(runs, "whole PTB LM step: Mixtape / softmax", 1.15, scope="lm"))
    return targets


def _graphed(runs: Runs, name: str, bound: float, vocab: int | None = None,
             scope: str = "head") -> list[Target]:  # fmt: skip
    """Mixtape / softmax with both heads' steps as CUDA graphs (``cuda_graphs``, opt-in: its
    own target row, beside the default's), where the run timed both."""
    mine = runs.ours("mixtape", vocab, scope, GRAPHED)
    reference = runs.ours("softmax", vocab, scope, GRAPHED)
    if mine is None or reference is None:
        return []
    return [_ratio(mine, reference, f"{name}, cuda_graphs on (<= {bound})", most=bound)]


def main(argv: list[str] | None = None) -> list[Target]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "files",
        nargs="+",
        type=Path,
        help="GPU benchmark JSON files (others are named and skipped)",
    )
    parser.add_argument("--json", type=Path, help="write the targets here as JSON")
    args = parser.parse_args(argv)
    reports = {str(path): json.loads(path.read_text()) for path in args.files}
    for path in [p for p, report in reports.items() if not is_bench_report(report)]:
        print(f"skipped {path}: not a benchmark report (python -m app.bench's)", file=sys.stderr)
        del reports[path]
    targets = collect(reports)
    for target in targets:
        print(target.row())
    if args.json:
        args.json.write_text(json.dumps([asdict(t) for t in targets], indent=1) + "\n")
    return targets


def is_bench_report(report) -> bool:
    """Whether ``report`` is ``python -m app.bench``'s JSON (a sweep's, a profile's or the
    compile report's are not: ``docs/results/*.json`` holds them all)."""
    rows = report.get("results") if isinstance(report, dict) else None
    return isinstance(rows, list) and all(
        isinstance(row, dict) and {"head", "vocab_size"} <= row.keys() for row in rows
    )


def collect(reports: dict[str, dict]) -> list[Target]:
    """Each report's measured targets (named with its GPU where that is no H100), then the
    targets no report measured."""
    measured, names = [], []
    for path, report in reports.items():
        runs = Runs(path, report)
        for target in evaluate(runs):
            names.append(target.target)
            if target.met is not None:
                if "H100" not in runs.card:
                    target.target += f" [{runs.card}]"
                measured.append(target)
    seen = {t.target.split(" [")[0] for t in measured}
    unmeasured = [Target(name) for name in dict.fromkeys(names) if name not in seen]
    return measured + unmeasured


if __name__ == "__main__":
    main()
