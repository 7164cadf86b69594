"""``python -m app.results``: writes ``docs/results.md`` from the JSON under ``docs/results/``.

Every measured table in the docs comes from a JSON file a command wrote (the benchmark's
``--out``, the experiment runner's study file...), so a number and the code that made it
cannot drift apart: rerun the command, copy its JSON into ``docs/results/``, regenerate.

Each JSON file is rendered by the first renderer that recognises it (``RENDERERS``); a file
no renderer knows is listed as such, never silently dropped. Sections are ordered by file name.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.bench.timing import interval_text

RESULTS = Path("docs/results")
OUT = Path("docs/results.md")

# notes for files measured with options since removed (their commands no longer take them)
REMOVED_CPU_BACKEND = (
    "The `@cpu` rows measured the opt-in CPU loss backend; it was removed because these rows "
    "show it no faster than the portable path.",
)
REMOVED_MALLOC_TUNING = (
    "Measured with glibc malloc tuning (`--malloc-tuning`), an option removed with the CPU "
    "loss backend.",
)

# a renderer gets the report, its JSON path and the folder of the markdown file (for links)
Renderer = Callable[[dict[str, Any], Path, Path], str]


def _format(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, list):
        return " ".join(_format(v) for v in value)
    return str(value)


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table; floats to 3 significant figures."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(_format(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def command_of(
    module: str, args: dict[str, Any], skip: tuple[str, ...] = (), repeated: tuple[str, ...] = ()
) -> str:
    """The command line that reproduces a run from its recorded ``args`` (argparse names);
    ``repeated``: list options given once per value (argparse's ``append``)."""
    parts = [f"python -m {module}"]
    for key, value in args.items():
        if key in skip or value is None or value is False or value == []:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list) and key in repeated:
            parts.extend(f"{flag} {v}" for v in value)
        elif isinstance(value, list):
            parts.append(flag + " " + " ".join(str(v) for v in value))
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def link(path: Path, doc_dir: Path) -> str:
    """``path`` as the markdown file in ``doc_dir`` refers to it."""
    return os.path.relpath(path.resolve(), doc_dir.resolve())


def _machine(report: dict[str, Any]) -> str:
    machine = report.get("machine", {})
    load = machine.get("load_average") or machine.get("load_average_before")
    bits = [machine.get("cuda") or machine.get("device"), machine.get("platform"),
            f"torch {machine.get('torch')}", f"{machine.get('threads')} threads",
            load and f"load average {load[0]:.1f}"]  # fmt: skip
    return ", ".join(str(b) for b in bits if b and "None" not in str(b))


# -- the training benchmark (python -m app.bench, same-batch / same-memory) ------------------
def _is_training_bench(report: dict[str, Any]) -> bool:
    return (
        report.get("args", {}).get("mode") in ("same-batch", "same-memory") and "results" in report
    )


def _baseline_note(path: Path) -> list[str]:
    """A ``..._baseline_<commit>...`` file was measured with an earlier commit's code."""
    found = re.search(r"_baseline_([0-9a-f]{7,40})", path.stem)
    if not found:
        return []
    commit = found.group(1)
    return [
        f"Measured with the code of commit `{commit}`: run the command above in "
        f"`git worktree add /tmp/base {commit}` (that commit's benchmark applied glibc malloc "
        "thresholds at start-up; `app/allocator.py` there)."
    ]


def render_training_bench(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    from app.bench.report import peer_speedups, row_figures, save_plot

    rows = report["results"]
    # "extra_peak_mb": memory a step adds to the process (older files: the process's peak)
    memory_key = "extra_peak_mb" if rows and "extra_peak_mb" in rows[0] else "peak_memory_mb"
    header = ["head", "V", "d", "tokens", "ms / batch", "us / token", "x softmax",
              "x softmax 95% CI", "GFLOP", "% matmul rate",
              "extra peak MiB" if memory_key == "extra_peak_mb" else "peak MiB"]  # fmt: skip
    body = []
    for row in rows:
        rel, low, high, gflop, rate, memory = row_figures(rows, row, memory_key)
        body.append([row["head"], row["vocab_size"], row["hidden_size"], row["tokens"],
                     row["time_ms"], row["time_per_token_us"], rel, interval_text(low, high),
                     gflop, rate, memory])  # fmt: skip
    plot = path.with_suffix(".png")
    save_plot(report, plot)
    args = report["args"]
    return "\n\n".join([
        f"Mode `{args['mode']}`, scope `{args['scope']}`, precision `{args.get('precision')}`, "
        + ("not timed (`--time skip`: one warm-up step, then the memory); "
           if args.get("time") == "skip" else
           f"clock `{args.get('clock', 'wall')}`, median of {args['repeats']} repeats "
           "(`x softmax`: the median of the repeats' paired ratios, each repeat timing every "
           "subject in one round, with its distribution-free 95% CI); ")
        + f"{_machine(report)}.",
        # malloc_tuned: recorded in args by older runs, never a flag
        "```bash\n" + command_of("app.bench", args, skip=("out", "name", "malloc_tuned")) + "\n```",
        *_baseline_note(path),
        *REMOVED_CPU_BACKEND * any("@cpu" in h for h in args.get("heads", [])),
        table(header, body),
        *(["\n".join(f"- {line}" for line in speedups)] if (speedups := peer_speedups(rows))
          else []),
        f"![{path.stem}]({link(plot, doc_dir)})",
    ])  # fmt: skip


# -- the inference benchmark (python -m app.bench --mode inference) ----------------------------
def _is_inference_bench(report: dict[str, Any]) -> bool:
    return report.get("args", {}).get("mode") == "inference" and "latency" in report


def _svd_flag(value: Any) -> Any:
    """``--svd`` values as typed (``rank:candidates:min_classes``)."""
    if isinstance(value, list):
        return [_svd_flag(v) for v in value]
    if isinstance(value, dict):
        return f"{value['rank']}:{value['candidates']}:{value['min_classes']}"
    return value


def _ci(speedups: dict[str, Any], key: str) -> str:
    return interval_text(*speedups.get(f"{key}_ci", (math.nan, math.nan)))


def render_inference_bench(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    args, nan = report["args"], float("nan")
    latency, quality = report["latency"], report.get("quality", {})
    speedup = report.get("speedup_vs_softmax") or report.get("latency_speedup", {})
    points = report.get("accuracy_vs_softmax_points", {})
    reference = report.get("reference", "softmax")
    names = list(dict.fromkeys([*latency, *quality]))
    body = []
    for name in names:
        timed, q = latency.get(name, {}), quality.get(name, {})
        fast, delta = speedup.get(name, {}), points.get(name, {})
        body.append([name, timed.get("batch1_us_per_query", nan),
                     timed.get("batched_us_per_query", nan),
                     fast.get("batch1_us_per_query", nan), _ci(fast, "batch1_us_per_query"),
                     fast.get("batched_us_per_query", nan), _ci(fast, "batched_us_per_query"),
                     *(100 * q[a] if a in q else nan for a in ("acc_top1", "acc_top5",
                                                               "acc_top10")),
                     delta.get(f"acc_top{args['k']}", nan), q.get("num_experts", "-"),
                     q.get("flops_speedup", nan)])  # fmt: skip
    k, batch = args["k"], args["batch_size"]
    header = ["model", "batch-1 us/query", f"batch-{batch} us/query", f"batch-1 x {reference}",
              "95% CI", f"batch-{batch} x {reference}", "95% CI", "top-1 %", "top-5 %", "top-10 %",
              f"top-{k} vs {reference} (points)", "experts", "FLOP speed-up"]  # fmt: skip
    command = command_of("app.bench", {**args, "svd": _svd_flag(args.get("svd"))},
                         skip=("out", "name"),
                         repeated=("ds_checkpoint", "softmax_checkpoint", "svd"))  # fmt: skip
    parts = [
        f"Top-{k} latency (median CPU time per query; speed-ups against `{reference}` timed in "
        "the same run: the median of the blocks' paired ratios, each block of queries timed "
        f"for every model back to back, with its 95% CI) and test accuracy; {_machine(report)}.",
        *([f"Checkpoints: {report['recipe']}"] if report.get("recipe") else []),
        f"```bash\n{command}\n```",
        table(header, body),
    ]
    plot = path.with_suffix(".png")
    if plot.exists():
        parts.append(f"![{path.stem}]({link(plot, doc_dir)})")
    return "\n\n".join(parts)


# -- the data benchmark (python -m app.bench --mode data) ---------------------------------------
def _is_data_bench(report: dict[str, Any]) -> bool:
    return report.get("mode") == "data" and "results" in report


def render_data_bench(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    corpus, options, machine = report["corpus"], report["options"], report.get("machine", {})
    header = ["vocab", "classes", "train tokens", "first prepare s", "peak RSS GiB",
              "cached setup s (median)", "cached peak RSS GiB", "read one epoch s",
              "concurrent ranks: max s", "concurrent: ranks that prepared"]  # fmt: skip
    body = []

    def prepared(together: list[dict]) -> str:
        return f"{sum(c['cache_misses'] > 0 for c in together)} of {len(together)}"

    for row in report["results"]:
        prepare, cached, together = row["prepare"], row["cached"], row.get("concurrent") or []
        epoch = next((c["epoch_read_s"] for c in cached if c.get("epoch_read_s")), None)
        body.append([
            row["vocab"], prepare["vocab_size"], prepare["tokens"]["train"], prepare["wall_s"],
            prepare["peak_rss_gib"], row["cached_wall_s"],
            max((c["peak_rss_gib"] for c in cached), default=float("nan")),
            float("nan") if epoch is None else epoch,
            max((c["wall_s"] for c in together), default=float("nan")),
            prepared(together) if together else "-",
        ])  # fmt: skip
    load = machine.get("load_before")
    return "\n\n".join([
        f"Synthetic WikiText-style corpus: {corpus['tokens']:,} training tokens, "
        f"{corpus['types']:,} Zipf({corpus['zipf']}) word types, "
        f"{corpus['line_words']}-word lines; "
        f"{machine.get('cpus')} CPUs, load average before {load[0]:.1f} (other jobs shared the "
        "machine), peak RSS of the whole process."
        if load else f"{corpus['tokens']:,} training tokens.",
        "```bash\n" + command_of("app.bench", options, skip=("out", "name", "corpus_dir",
                                 "cache_dir", "malloc_tuning")) + "\n```",
        *REMOVED_MALLOC_TUNING * bool(options.get("malloc_tuning")),
        table(header, body),
    ])  # fmt: skip


# -- the experiment runner (python -m app.study) and its rank diagnostic (python -m app.rank) ----
def _is_study(report: dict[str, Any]) -> bool:
    return str(report.get("schema", "")).startswith("study/")


def render_study(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    from app.study.report import render_markdown

    prefix = link(path.parent, doc_dir) + "/"
    text = render_markdown(report, path.parent, link_prefix=prefix)
    return text.split("\n", 1)[1].lstrip("\n")  # the section already has its title


def _is_rank(report: dict[str, Any]) -> bool:
    return str(report.get("schema", "")).startswith("rank/")


def render_rank(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    relative = report.get("relative_ranks", {})
    return "\n\n".join([
        f"Softmax-bottleneck diagnostic (`python -m app.rank`) of `{report['head']}` "
        f"({report['checkpoint']}): singular values of the row-centred log-probability matrix "
        f"over {report['contexts']} {report['split']} contexts; a softmax over d inputs has "
        f"rank <= d + 1.",
        table(["numerical rank", "softmax bound", "V",
               *(f"above {t} x sigma_1" for t in relative)],
              [[report["rank"], report["softmax_bound"], report["vocab_size"],
                *relative.values()]]),
    ])  # fmt: skip


# -- one-off demonstrations with a schema of their own -------------------------------------------
def _is_bleu_demo(report: dict[str, Any]) -> bool:
    return str(report.get("schema", "")).startswith("bleu_checkpoint_demo/")


def render_bleu_demo(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    curve = report["validation_curve"]
    test = report["test"]
    return "\n\n".join([
        f"{report['what']} ({report.get('device', '')}).",
        "```bash\n" + "\n".join(report["commands"]) + "\n```",
        table(["epoch", "step", "val/bleu", "val/loss"],
              [[r["epoch"], r["step"], r["val/bleu"], r["val/loss"]] for r in curve]),
        f"Kept checkpoint: `{report['chosen_checkpoint']}`; its test BLEU "
        f"{test['test/bleu']:.2f} (beam {test.get('beam_size')}, {test.get('lines')} lines).",
    ])  # fmt: skip


def _is_mixtape_stability(report: dict[str, Any]) -> bool:
    return str(report.get("schema", "")).startswith("mixtape_stability_cpu/")


def render_mixtape_stability(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    rows = [[start, r["seed"], r["g_abs"], r["context_saturated"]]
            for start, runs in report["mixtape"].items() for r in runs]  # fmt: skip
    others = report.get("other_heads_seed1", {})
    other_rows = [[name, v.get("train_loss", "-"), v.get("g_abs", "-"),
                   v.get("context_saturated", "-")]
                  for name, v in others.items() if isinstance(v, dict)]  # fmt: skip
    parts = [
        report["setting"],
        table(["Mixtape bias start", "seed", "mean abs g_c", "share of saturated contexts"], rows),
    ]
    if other_rows:
        parts += [
            others.get("note", ""),
            table(
                ["head, bias start (seed 1)", "train loss", "mean abs g_c", "saturated"], other_rows
            ),
        ]
    return "\n\n".join(parts)


RENDERERS: list[tuple[Callable[[dict[str, Any]], bool], Renderer]] = [
    (_is_training_bench, render_training_bench),
    (_is_inference_bench, render_inference_bench),
    (_is_data_bench, render_data_bench),
    (_is_study, render_study),
    (_is_rank, render_rank),
    (_is_bleu_demo, render_bleu_demo),
    (_is_mixtape_stability, render_mixtape_stability),
]


def render(results: Path = RESULTS, doc_dir: Path = OUT.parent) -> str:
    """The whole results document from every JSON file in ``results``, for a markdown file in
    ``doc_dir``."""
    sections = [
        "# Measured results",
        "Generated by `python -m app.results` from the JSON files in `docs/results/`; do not "
        "edit by hand. Each section gives the command that wrote its JSON.",
    ]
    for path in sorted(results.glob("*.json")):
        report = json.loads(path.read_text())
        renderer = next((r for known, r in RENDERERS if known(report)), None)
        title = f"## {path.stem}"
        if renderer is None:
            sections.append(f"{title}\n\n`{path.name}`: no renderer knows this file.")
            continue
        sections.append(f"{title}\n\n{renderer(report, path, doc_dir)}")
    return "\n\n".join(sections) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m app.results",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of JSON files")
    parser.add_argument("--out", type=Path, default=OUT, help="the markdown file to write")
    args = parser.parse_args(argv)
    if not args.results.is_dir():
        parser.error(f"--results {args.results} is not a folder")
    args.out.write_text(render(args.results, args.out.parent))
    print(f"wrote {args.out}")
    return args.out


if __name__ == "__main__":
    main()
