"""``python -m app.results``: writes ``docs/results.md`` from the JSON under ``docs/results/``.

Every measured table in the docs comes from a JSON file a command wrote (the benchmark's
``--out``, the experiment runner's study file...), so a number and the code that made it
cannot drift apart: rerun the command, copy its JSON into ``docs/results/``, regenerate.

Each JSON file is rendered by the first renderer that recognises it (``RENDERERS``); a file
no renderer knows is listed as such, never silently dropped. Sections follow ``TOPICS`` (by file
name within a topic); the document opens with a summary table, one row per file whose kind has
a headline (``HEADLINES``). A JSON file may carry a ``note``, printed under its section's title,
and a ``partial`` mark (the benchmark's and profiler's JSON of a run cut short), said there too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.bench.report import peer_speedups, row_figures, softmax_reference
from app.bench.timing import interval_text

RESULTS = Path("docs/results")
REPO = Path(__file__).resolve().parents[1]
OUT = Path("docs/results.md")

# the sections in reading order: a file goes under the first topic one of whose file-name
# prefixes it starts with; files no topic claims come last, under "Other measurements"
TOPICS = [
    ("Quality of the heads", ("study_", "rank_", "mixtape_stability")),
    ("Training speed and memory", ("bench_cpu_speed_", "bench_cpu_lm_", "bench_cpu_memory_")),
    ("Compiled heads", ("bench_cpu_adaptive_compile_", "bench_cpu_backends_")),
    ("DS-Softmax inference", ("ds_inference_",)),
    ("Translation", ("bleu_",)),
    ("Data preparation", ("data_",)),
]
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


def _load_average(machine: dict[str, Any]) -> list[float] | None:
    """The load average the command recorded as it started (every mode: ``load_average``)."""
    return machine.get("load_average") or None


def _machine(report: dict[str, Any]) -> str:
    machine = report.get("machine", {})
    load = _load_average(machine)
    bits = [machine.get("cuda") or machine.get("device"), machine.get("platform"),
            f"torch {machine.get('torch')}", f"{machine.get('threads')} threads",
            load and f"load average {load[0]:.1f}"]  # fmt: skip
    return ", ".join(str(b) for b in bits if b and "None" not in str(b))


# -- the training benchmark (python -m app.bench, same-batch / same-memory) ------------------
def _is_training_bench(report: dict[str, Any]) -> bool:
    return (
        report.get("args", {}).get("mode") in ("same-batch", "same-memory") and "results" in report
    )


def _bench_command(report: dict[str, Any]) -> str:
    return command_of("app.bench", report["args"], skip=("out", "name", "note"))


def render_training_bench(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    from app.bench.report import save_plot

    rows = report["results"]
    ratio = f"x {softmax_reference(rows)}"
    header = ["head", "V", "d", "tokens", "ms / batch", "us / token", ratio,
              f"{ratio} 95% CI", "GFLOP", "% matmul rate", "extra peak MiB"]  # fmt: skip
    body = []
    for row in rows:
        rel, low, high, gflop, rate, memory = row_figures(rows, row)
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
           f"clock `{args.get('clock', 'wall')}`, median of {_repeats(report)} repeats "
           + (f"(each the mean of {steps} steps back to back) "
              if (steps := args.get("steps_per_repeat", 1)) > 1 else "")
           + f"(`{ratio}`: the median of the repeats' paired ratios, each repeat timing every "
           "subject in one round, with its distribution-free 95% CI); ")
        + f"{_machine(report)}.",
        f"```bash\n{_bench_command(report)}\n```",
        table(header, body),
        *(["\n".join(f"- {line}" for line in speedups)] if (speedups := peer_speedups(rows))
          else []),
        *(["Failed in this run, left out: " + "; ".join(
            f"`{subject}`: {message}" for subject, message in failed.items())]
          if (failed := report.get("failed")) else []),
        *([IN_PROCESS_MEMORY] if _memory_in_process(report) else []),
        f"![{path.stem}]({link(plot, doc_dir)})",
    ])  # fmt: skip


# what the extra-peak column of a CPU run from before the memory worker (app/bench/memory.py) is
IN_PROCESS_MEMORY = (
    "Extra peak MiB measured in the timing process (a run from before the memory worker): "
    "glibc's heap there depends on the subjects stepped before, so a row can read up to about "
    "a third more or less than the same step measured alone."
)


def _memory_in_process(report: dict[str, Any]) -> bool:
    memory = [r.get("extra_peak_mb") for r in report["results"]]
    method = report.get("machine", {}).get("memory_method")
    return method == "rss_reset_peak" and any(m is not None for m in memory)


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


def _speedups(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """An inference bench's speed-ups over its reference, from its timed blocks as
    ``app.bench.inference.ratios`` takes them now (files written before 2026-11-29 hold
    intervals over every (repeat, block) pair)."""
    from app.bench.inference import ratios

    return ratios(report["latency"], report["reference"], report["args"].get("repeats", 1))


def _figure(value: float, interval: str, unit: str = "x") -> str:
    """``1.75x [1.70-1.79]``; the interval left out where none was measured (``-``)."""
    return f"{value:.2f}{unit}" + ("" if interval == "-" else f" [{interval}]")


def _clock_time(args: dict[str, Any]) -> str:
    """What an inference run's clock measured (``--clock``: wall by default)."""
    return "CPU time" if args.get("clock") == "cpu" else "wall time"


def _inference_command(report: dict[str, Any]) -> str:
    args = report["args"]
    return command_of("app.bench", {**args, "svd": _svd_flag(args.get("svd"))},
                      skip=("out", "name"),
                      repeated=("ds_checkpoint", "softmax_checkpoint", "svd"))  # fmt: skip


def render_inference_bench(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    args, nan = report["args"], float("nan")
    latency, quality = report["latency"], report.get("quality", {})
    speedup, reference = _speedups(report), report["reference"]
    points = report.get("accuracy_vs_softmax_points", {})
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
    command = _inference_command(report)
    parts = [
        f"Top-{k} latency (median {_clock_time(args)} per query; speed-ups against "
        f"`{reference}` timed in "
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


def _data_command(report: dict[str, Any]) -> str:
    return command_of("app.bench", report["options"],
                      skip=("out", "name", "corpus_dir", "cache_dir"))  # fmt: skip


def render_data_bench(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    corpus, machine = report["corpus"], report.get("machine", {})
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
    load = _load_average(machine)
    return "\n\n".join([
        f"Synthetic WikiText-style corpus: {corpus['tokens']:,} training tokens, "
        f"{corpus['types']:,} Zipf({corpus['zipf']}) word types, "
        f"{corpus['line_words']}-word lines; "
        f"{machine.get('cpus')} CPUs, load average before {load[0]:.1f} (other jobs shared the "
        "machine), peak RSS of the whole process."
        if load else f"{corpus['tokens']:,} training tokens.",
        f"```bash\n{_data_command(report)}\n```",
        table(header, body),
    ])  # fmt: skip


# -- the experiment runner (python -m app.study) and its rank diagnostic (python -m app.rank) ----
def _is_study(report: dict[str, Any]) -> bool:
    return str(report.get("schema", "")).startswith("study/")


def grid_changes(report: dict[str, Any], root: Path = REPO) -> list[str]:
    """The keys of the grid a study ran (its JSON's ``grid``) that ``configs/studies/<name>.yaml``
    now gives otherwise, ``["the grid file"]`` where it is gone: the command the docs print
    runs the grid as it is now. Nothing for a study without its grid."""
    import yaml

    ran = report.get("grid")
    if not isinstance(ran, dict):
        return []
    grid = root / "configs" / "studies" / f"{report['name']}.yaml"
    if not grid.is_file():
        return ["the grid file"]
    now = yaml.safe_load(grid.read_text()) or {}
    return [key for key in dict.fromkeys([*ran, *now]) if ran.get(key) != now.get(key)]


def _grid_changed(report: dict[str, Any]) -> str:
    """What a study's summary row adds where its grid has changed since it ran."""
    changes = grid_changes(report)
    return f" (**grid changed since the run: {', '.join(changes)}**)" if changes else ""


def render_study(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    from app.study.report import render_markdown

    prefix = link(path.parent, doc_dir) + "/"
    text = render_markdown(report, path.parent, link_prefix=prefix)
    text = text.split("\n", 1)[1].lstrip("\n")  # the section already has its title
    if changes := grid_changes(report):
        text = (f"`configs/studies/{report['name']}.yaml` has changed since this run "
                f"({', '.join(f'`{c}`' for c in changes)}): its command now runs another "
                "grid; the run's own is in its JSON (`grid`).\n\n" + text)  # fmt: skip
    return text


# -- a study on a corpus with a known optimum (the synthetic Markov chain, issue 31) -------------
def _is_optimum_study(report: dict[str, Any]) -> bool:
    runs = report.get("runs") or [] if _is_study(report) else []
    return any("test/optimum_nll" in (run.get("test") or {}) for run in runs)


def render_optimum_study(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    return render_study(report, path, doc_dir)  # the study report has the excess table


def _unfinished(row: dict[str, Any]) -> str:
    """`` (2 of 3 runs)`` where some of a study label's runs failed or diverged."""
    return "" if row["ok"] == row["runs"] else f" ({row['ok']} of {row['runs']} runs)"


def headline_optimum_study(report: dict[str, Any], path: Path) -> tuple[str, str]:
    from app.study.report import mean_std_text, optimum_rows, summarize

    # 4 decimals as the excess table (3 read a std of 0.0004 as 0.000); unfinished runs said
    rows = {row["label"]: row for row in summarize(report)}
    figures = [
        f"{row['label']} {mean_std_text(row['mean_std'], 4)}{_unfinished(rows[row['label']])}"
        for row in optimum_rows(report)
    ]
    return (
        "excess over the optimum (nats, mean ± std over seeds): "
        + ", ".join(figures)
        + _grid_changed(report),
        f"python -m app.study run configs/studies/{report['name']}.yaml",
    )


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


# -- measurements recorded by hand (``recorded/``): prose, commands and tables in order ---------
def _is_recorded(report: dict[str, Any]) -> bool:
    return str(report.get("schema", "")).startswith("recorded/")


def render_recorded(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    """``parts``: each a paragraph (a string), ``{"commands": [...]}`` or a table
    (``{"header": [...], "rows": [[...]]}``)."""
    parts = []
    for part in report["parts"]:
        if isinstance(part, str):
            parts.append(part)
        elif "commands" in part:
            parts.append("```bash\n" + "\n".join(part["commands"]) + "\n```")
        else:
            parts.append(table(part["header"], part["rows"]))
    return "\n\n".join(p for p in parts if p)


# -- the per-step profile (python -m app.bench.profile) ------------------------------------------
def _is_profile(report: dict[str, Any]) -> bool:
    return str(report.get("schema", "")).startswith("profile/")


def _profile_command(report: dict[str, Any]) -> str:
    return command_of("app.bench.profile", report["args"], skip=("out", "name", "note"))


def _lm_scope(args: dict[str, Any]) -> str:
    """How a profile's step is scoped, where it is not the head alone."""
    return " of the whole LSTM language model" if args.get("scope") == "lm" else ""


def render_profile(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    from app.bench.profile import short_name, table_rows

    args, header, rows = report["args"], *table_rows(report)
    device = report["results"][0]["top_of"] == "device" if report["results"] else False
    body = [[*row, ", ".join(f"`{short_name(t['name'], 40)}` {100 * t['share']:.0f}%"
                             for t in result["top"][:3])]
            for row, result in zip(rows, report["results"], strict=True)]  # fmt: skip
    return "\n\n".join([
        f"Per training step (forward + backward{_lm_scope(args)}) at V = {args['vocab']}, "
        f"d = {args['hidden']}, "
        f"{args['tokens']} tokens, `{args['precision']}`; {_machine(report)}. `host ms`: until "
        "the step returns (median of the steps timed without the profiler)"
        + (", `wall ms`: until the device is done; `kernel ms`, `kernels`, `syncs`: the "
           "device's kernel time and kernel count, and the host-device syncs, per profiled "
           "step" if device else "")
        + "; `aten ops`: every `aten::*` event, `top-level ops`: those under no other; "
        "`% outside ops`: the share of the profiled host time in no profiled event (Python, "
        "autograd's glue); the last column: the first 3 "
        + ("kernels by device time" if device else "host events by self time")
        + " with their share.",
        f"```bash\n{_profile_command(report)}\n```",
        table([*header, "top (share)"], body),
    ])  # fmt: skip


# -- the Triton tiles' launch settings (python -m app.bench.sweep) -------------------------------
def _is_sweep(report: dict[str, Any]) -> bool:
    return str(report.get("schema", "")).startswith("sweep/")


def _setting(setting: dict[str, Any]) -> str:
    """``key value, ...``; a nested setting (the fused products' tiles) as ``key: ...``."""
    return ", ".join(f"{k}: {_setting(v)}" if isinstance(v, dict) else f"{k} {v}"
                     for k, v in setting.items())  # fmt: skip


def render_sweep(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    args, rows = report["args"], report["results"]
    base = {r["subject"]: r["time_ms"] for r in rows if r["default"]}
    body = [[r["subject"], _setting(r["setting"]) or "-", r["time_ms"],
             r["time_ms"] / base[r["subject"]] if r["subject"] in base else None]
            for r in rows]  # fmt: skip
    return "\n\n".join([
        f"The Triton tiles' launch settings at V = {args['vocab']}, d = {args['hidden']}, "
        f"{args['tokens']} tokens, `{args['precision']}`: median of {args['repeats']} repeats "
        f"of {args['steps']} steps back to back; `x default`: against the subject under the "
        "defaults of this run"
        + ("" if report["triton"] else " (no Triton tiles ran: the settings changed nothing)")
        + f"; {_machine(report)}.",
        f"```bash\n{command_of('app.bench.sweep', args, skip=('out', 'name'))}\n```",
        table(["subject", "setting", "ms / step", "x default"], body),
    ])  # fmt: skip


# -- the kernels' compiled code (python -m app.bench.kernels) -----------------------------------
def _is_kernels(report: dict[str, Any]) -> bool:
    return str(report.get("schema", "")).startswith("kernels/")


def render_kernels(report: dict[str, Any], path: Path, doc_dir: Path) -> str:
    args = report["args"]
    header = ["kernel", "variant", "registers", "spilled B", "warps / SM", "16-byte loads",
              "narrower loads", "barriers", "barriers in a column loop", "cp.async copies",
              "wgmma"]  # fmt: skip
    body = [[u["kernel"], u["variant"], u["registers"], u["spilled_bytes"], u["warps_per_sm"],
             u["wide_loads"], u["narrow_loads"], u["barriers"], u["loop_barriers"],
             u.get("async_copies", "-"), u.get("tensor_core", "-")]
            for u in report["results"]]  # fmt: skip
    return "\n\n".join([
        f"The heads' Triton kernels compiled for sm_{args['arch']} without a GPU (Triton "
        f"{report['triton']}), as the heads launch them, and read off the machine code: the "
        "loads a thread makes (16 bytes wide, or narrower multi-element ones) and the "
        "barriers, in all and in the most barrier-laden loop over a row's columns (`-`: no "
        "such loop); for the fused products (`gemm.*`, and Mixtape's frequent block's "
        "`frequent.*`), their operands' asynchronous copies into shared memory and Hopper's "
        "warpgroup tensor-core products (their barriers are the pipeline's). Spilled bytes "
        "are `ptxas`'s spill stores. What it shows is how the kernels are built, not how "
        "fast they run.",
        f"```bash\n{command_of('app.bench.kernels', args, skip=('out', 'name'))}\n```",
        table(header, body),
    ])  # fmt: skip


def _repeats(report: dict[str, Any]) -> str:
    """The repeats the rows hold (a run stopped early holds fewer than it asked for)."""
    counts = sorted({len(row["times_ms"]) for row in report["results"] if row.get("times_ms")})
    if not counts:
        return str(report["args"]["repeats"])
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


RENDERERS: list[tuple[Callable[[dict[str, Any]], bool], Renderer]] = [
    (_is_training_bench, render_training_bench),
    (_is_inference_bench, render_inference_bench),
    (_is_data_bench, render_data_bench),
    (_is_optimum_study, render_optimum_study),
    (_is_study, render_study),
    (_is_rank, render_rank),
    (_is_recorded, render_recorded),
    (_is_profile, render_profile),
    (_is_sweep, render_sweep),
    (_is_kernels, render_kernels),
]


# -- the summary table: a headline per file, with its interval and its command -----------------
# a headline function gets the report and its JSON path; it returns the figures (text) and the
# command that made them, or None where the file has no headline
Headline = Callable[[dict[str, Any], Path], "tuple[str, str] | None"]


def headline_training_bench(report: dict[str, Any], path: Path) -> tuple[str, str]:
    rows = report["results"]
    if report["args"].get("time") == "skip":
        # each at its token count where they differ (--tokens-for): MiB alone would compare
        # MoS at 2,048 tokens with softmax at 8,192
        # (a same-memory search's tokens are what it found: always said)
        alike = len({r.get("tokens") for r in rows}) == 1 and report["args"]["mode"] != (
            "same-memory")  # fmt: skip
        figures = [f"{r['head']} {_format(r['extra_peak_mb'])}"
                   + ("" if alike or r.get("tokens") is None else f" ({r['tokens']:,} tokens)")
                   for r in rows]  # fmt: skip
        return "extra peak MiB of a step: " + ", ".join(figures), _bench_command(report)
    ratios, reference = [], softmax_reference(rows)
    for row in rows:
        rel, low, high, *_ = row_figures(rows, row)
        if row["head"] not in (reference, "matmul") and not math.isnan(rel):
            ratios.append(f"{row['head']} {_figure(rel, interval_text(low, high))}")
    figures = [f"step time x {reference}: " + ", ".join(ratios)] if ratios else []
    figures += [line.replace("`", "") for line in peer_speedups(rows)]
    return "; ".join(figures), _bench_command(report)


def headline_inference_bench(report: dict[str, Any], path: Path) -> tuple[str, str]:
    """Each sparse model without a variant (no ``+``) against the reference."""
    k, batch, reference = report["args"]["k"], report["args"]["batch_size"], report["reference"]
    points = report.get("accuracy_vs_softmax_points", {})
    figures = []
    for name, fast in _speedups(report).items():
        if "+" in name or name.startswith("softmax"):
            continue
        delta = points.get(name, {}).get(f"acc_top{k}")
        figures.append(
            f"{name} top-{k} x {reference}: batch 1 "
            f"{_figure(fast['batch1_us_per_query'], _ci(fast, 'batch1_us_per_query'))}, batch "
            f"{batch} {_figure(fast['batched_us_per_query'], _ci(fast, 'batched_us_per_query'))}"
            + ("" if delta is None else f", accuracy {delta:+.2f} points")
        )
    return "; ".join(figures), _inference_command(report)


def headline_data_bench(report: dict[str, Any], path: Path) -> tuple[str, str]:
    figures = [
        f"{row['vocab']}: {report['corpus']['tokens']:,} tokens prepared in "
        f"{row['prepare']['wall_s']:.0f} s ({row['prepare']['peak_rss_gib']:.1f} GiB peak), "
        f"cached setup {row['cached_wall_s']:.2f} s"
        for row in report["results"]
    ]
    return "; ".join(figures), _data_command(report)


def headline_study(report: dict[str, Any], path: Path) -> tuple[str, str]:
    from app.study.report import mean_std_text, summarize

    # (one seed: the mean alone, no "± nan"; a label's unfinished runs said: the mean is of
    # the others only)
    figures = [f"{row['label']} {mean_std_text(row['metric'], 1)}{_unfinished(row)}"
               for row in summarize(report)]  # fmt: skip
    return (
        f"{report['metric']} (mean ± std over seeds): "
        + ", ".join(figures)
        + _grid_changed(report),
        f"python -m app.study run configs/studies/{report['name']}.yaml",
    )


def headline_rank(report: dict[str, Any], path: Path) -> tuple[str, str]:
    config = " ".join(f"--config {c}" for c in report.get("config", []))
    return (
        f"numerical rank {report['rank']} of {report['contexts']} contexts "
        f"(softmax bound {report['softmax_bound']})",
        f"python -m app.rank {config} --ckpt {report['checkpoint']} "
        f"--contexts {report['contexts']} --split {report['split']}",
    )


def headline_recorded(report: dict[str, Any], path: Path) -> tuple[str, str] | None:
    if "headline" not in report:
        return None
    commands = next((p["commands"] for p in report["parts"] if "commands" in p), [""])
    return report["headline"], commands[0]


def headline_profile(report: dict[str, Any], path: Path) -> tuple[str, str]:
    rows = report["results"]
    if rows and rows[0]["top_of"] == "device":
        figures = [f"{r['head']} {_format(r['kernels'])} ({_format(r['kernel_ms'])})" for r in rows]
        text = "kernels per step (kernel ms): "
    else:
        figures = [f"{r['head']} {_format(r['host_ms'])} ({_format(r['aten_ops'])})" for r in rows]
        text = "host ms per step (aten ops): "
    return text + ", ".join(figures), _profile_command(report)


HEADLINES: dict[Renderer, Headline] = {
    render_training_bench: headline_training_bench,
    render_inference_bench: headline_inference_bench,
    render_data_bench: headline_data_bench,
    render_study: headline_study,
    render_optimum_study: headline_optimum_study,
    render_rank: headline_rank,
    render_recorded: headline_recorded,
    render_profile: headline_profile,
}


def left_out(report: dict[str, Any]) -> str:
    """What a summary row adds where its run measured less than its command asks (a run cut
    short, subjects that failed): its figures alone would read as the whole run's."""
    bits = []
    if report.get("partial"):
        # (the benchmark's mark starts with its own "partial: ")
        bits.append(f"partial run: {str(report['partial']).removeprefix('partial: ')}")
    if isinstance(report.get("failed"), dict) and report["failed"]:
        bits.append("failed, left out: " + ", ".join(report["failed"]))
    return f" (**{'; '.join(bits)}**)" if bits else ""


def _place(path: Path) -> tuple[int, int, str]:
    """Where ``path`` goes: its topic's index in ``TOPICS`` (past the end: none claims it),
    the index of the prefix it matched, its name."""
    for number, (_, prefixes) in enumerate(TOPICS):
        for rank, prefix in enumerate(prefixes):
            if path.stem.startswith(prefix):
                return number, rank, path.name
    return len(TOPICS), 0, path.name


def render(results: Path = RESULTS, doc_dir: Path = OUT.parent) -> str:
    """The whole results document from every JSON file in ``results``, for a markdown file in
    ``doc_dir``: the summary table, then the sections in topic order."""
    titles = [title for title, _ in TOPICS] + ["Other measurements"]
    summary, sections, topic = [], [], None
    for path in sorted(results.glob("*.json"), key=_place):
        report = json.loads(path.read_text())
        renderer = next((r for known, r in RENDERERS if known(report)), None)
        if titles[_place(path)[0]] != topic:
            topic = titles[_place(path)[0]]
            sections.append(f"## {topic}")
        if renderer is None:
            sections.append(f"### {path.stem}\n\n`{path.name}`: no renderer knows this file.")
            continue
        note = [report["note"]] if report.get("note") else []
        if report.get("partial"):  # a run cut short (a GPU lease's limit): what it measured
            note.append(f"**Partial run** ({report['partial']}): the command stopped early.")
        body = "\n\n".join([*note, renderer(report, path, doc_dir)])
        sections.append(f"### {path.stem}\n\n{body}")
        headline = HEADLINES.get(renderer, lambda *_: None)(report, path)
        if headline:
            anchor = path.stem.lower().replace(".", "")
            command = f"`{headline[1]}`" if headline[1] else "-"
            figures = headline[0] + left_out(report)
            summary.append([topic, f"[{path.stem}](#{anchor})", figures, command])
    return "\n\n".join([
        "# Measured results",
        "Generated by `python -m app.results` from the JSON files in `docs/results/`; do not "
        "edit by hand. Each section gives the command that wrote its JSON; intervals are 95% "
        "confidence intervals of paired ratios unless marked ± (a standard deviation).",
        "## Summary",
        table(["topic", "file", "headline figures [95% CI]", "command"], summary),
        *gpu_targets(results),
        *sections,
    ]) + "\n"  # fmt: skip


def gpu_targets(results: Path) -> list[str]:
    """The GPU targets section (``app.bench.targets``) over the GPU runs' reports, if any."""
    from app.bench.targets import collect

    paths = sorted(results.glob("bench_gpu_*.json"))
    if not paths:
        return []
    rows = []
    for t in collect({str(path): json.loads(path.read_text()) for path in paths}):
        measured = t.met is not None
        interval = "-" if not measured or t.low is None or math.isnan(t.low) else (
            f"{t.low:.2f}-{t.high:.2f}")  # fmt: skip
        verdict = t.verdict.replace("not met", "**not met**")
        work = "-" if t.flops is None else f"{t.flops:.3g}"
        figure = "-" if not measured else (
            f"{t.figure:,}" if isinstance(t.figure, int) else f"{t.figure:.4g}")  # fmt: skip
        rows.append([t.target, figure, interval, work, verdict, t.source or "-"])
    command = "python -m app.bench.targets " + " ".join(f"docs/results/{p.name}" for p in paths)
    return [
        "## GPU targets",
        "Issue 28's speed and memory targets (stated for one H100; another card is named), "
        "read off the GPU runs' reports by `app.bench.targets`: each ratio paired within one "
        "run, a head's figure its fastest own plan there (each run's date and code: its "
        "section below). FLOPs: the same ratio in the products' counted work, what the "
        "figure would be were both sides' products equally fast. met?: the median's verdict; "
        "(CI spans the target) where the 95% interval holds the target, so that another run "
        "may decide otherwise.",
        f"```bash\n{command}\n```",
        table(["target", "figure", "95% CI", "FLOPs", "met?", "file"], rows),
    ]


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
