"""A study's JSON as markdown and plots: the table (mean +- std over seeds), each head against
the baseline, validation curves with bands, and quality against training time.

``render_markdown(study, image_dir)`` is what the results doc includes: it writes the PNGs
into ``image_dir`` and returns markdown that links them (through ``link_prefix``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from scipy import stats  # noqa: E402


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else math.nan


def _final_stage(run: Mapping[str, Any]) -> Mapping[str, Any]:
    return run.get("finetune") or run.get("fit") or {}


def _curve(run: Mapping[str, Any]) -> list[dict[str, float]]:
    """The run's validation points over all its fit stages, epochs counted on."""
    points, offset, seconds = [], 0, 0.0
    for stage in (run.get("fit"), run.get("finetune")):
        if not stage:
            continue
        curve = stage.get("curve") or []
        for point in curve:
            shifted = dict(point)
            shifted["epoch"] = point["epoch"] + offset
            shifted["train_s"] = (point.get("train_s") or 0.0) + seconds
            points.append(shifted)
        if curve:
            offset += curve[-1]["epoch"] + 1
            seconds += curve[-1].get("train_s") or 0.0
    return points


def labels(study: Mapping[str, Any]) -> list[str]:
    return list(dict.fromkeys(run["label"] for run in study["runs"]))


def summarize(study: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per label (head or head+variant) over its seeds."""
    metric, curve_metric = study["metric"], study["curve_metric"]
    pick = min if study["mode"] == "min" else max
    rows = []
    for label in labels(study):
        runs = [r for r in study["runs"] if r["label"] == label]
        ok = [r for r in runs if r["status"] == "ok"]
        values = [r["test"][metric] for r in ok]
        best_val, train_s, epochs, per_epoch = [], [], [], []
        for run in ok:
            points = _curve(run)
            curve = [p[curve_metric] for p in points if p.get(curve_metric) is not None]
            if curve:
                best_val.append(pick(curve))
            # the epochs trained, not the validations (several an epoch with
            # val_check_interval, one every n epochs with check_val_every_n_epoch)
            trained = points[-1]["epoch"] + 1 if points else 0
            epochs.append(trained)
            if run.get("train_s"):
                train_s.append(run["train_s"])
                if trained:  # seconds per epoch: only where the run has both
                    per_epoch.append(run["train_s"] / trained)
        ranks = [r["rank"]["rank"] for r in ok if r.get("rank")]
        rows.append(
            {
                "label": label,
                "runs": len(runs),
                "ok": len(ok),
                "diverged": sum(r["status"] == "diverged" for r in runs),
                "failed": sum(r["status"] == "failed" for r in runs),
                "unstable": sum(bool(r.get("unstable")) for r in runs),
                "seeds": [r["seed"] for r in ok],
                "values": values,
                # every run in grid order, None where it did not finish: the per-seed line
                # stays aligned with the seeds when a middle one failed
                "per_seed": [r["test"][metric] if r["status"] == "ok" else None for r in runs],
                "metric": _mean_std(values),
                "best_val": _mean_std(best_val),
                "train_s": _mean_std(train_s),
                "epoch_s": _mean_std(per_epoch),
                "epochs": _mean_std([float(e) for e in epochs]),
                "rank": sorted(ranks),
                "parameters": next((_final_stage(r).get("parameters") for r in ok), None),
            }
        )
    return rows


def baseline_label(study: Mapping[str, Any], label: str) -> str:
    """The label ``label`` is compared with: the baseline head at the same variant
    (``softmax+d4`` for ``mos8+d4``; head labels hold no ``+``)."""
    _, plus, variant = label.partition("+")
    return f"{study['baseline']}+{variant}" if plus else study["baseline"]


def paired_p_value(row: Mapping[str, Any], base: Mapping[str, Any]) -> tuple[float, int]:
    """The paired t-test's p over the seeds both labels finished, and the number of pairs:
    a grid runs every head with the same seeds (``--seed_everything``), so a seed's runs share
    its draws where the heads draw alike (the backbone's initialisation, the data order) and
    their errors go together; Welch's test takes the groups as independent. (nan, pairs)
    below 2 pairs or where the differences do not vary."""
    mine = dict(zip(row["seeds"], row["values"], strict=True))
    theirs = dict(zip(base["seeds"], base["values"], strict=True))
    common = [seed for seed in mine if seed in theirs]
    differences = [mine[seed] - theirs[seed] for seed in common]
    if len(common) < 2 or statistics.stdev(differences) == 0:
        return math.nan, len(common)
    result = stats.ttest_rel([mine[s] for s in common], [theirs[s] for s in common])
    return float(result.pvalue), len(common)


def compare(study: Mapping[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each label against the baseline at its own variant: difference of means, whether it
    exceeds one standard deviation (the larger of the two groups' that exist: a group of one
    seed has none) in the better direction, Welch's t-test, and the paired t-test over the
    seeds both finished (``paired_p_value``)."""
    by_label = {r["label"]: r for r in rows}
    better = -1.0 if study["mode"] == "min" else 1.0
    out = []
    for row in rows:
        base = by_label.get(baseline_label(study, row["label"]))
        if base is None or row is base or base["ok"] == 0 or row["ok"] == 0:
            continue
        delta = row["metric"][0] - base["metric"][0]
        # (max() with a NaN first or second gives different answers: NaNs left out)
        stds = [s for s in (row["metric"][1], base["metric"][1]) if math.isfinite(s)]
        spread = max(stds, default=math.nan)
        p_value = math.nan
        if row["ok"] > 1 and base["ok"] > 1:
            p_value = float(stats.ttest_ind(row["values"], base["values"], equal_var=False).pvalue)
        paired_p, pairs = paired_p_value(row, base)
        out.append(
            {
                "label": row["label"],
                "baseline": base["label"],
                "delta": delta,
                "spread": spread,
                "better_by_more_than_one_std": bool(
                    math.isfinite(spread) and better * delta > spread
                ),
                "p_value": p_value,
                "paired_p_value": paired_p,
                "pairs": pairs,
            }
        )
    return out


def p_text_of(p_value: float) -> str:
    """``= 0.063``, or ``< 0.001`` (``= 0.000`` would read as no chance at all)."""
    return "< 0.001" if p_value < 0.001 else f"= {p_value:.3f}"


def mean_std_text(pair: tuple[float, float], digits: int = 2) -> str:
    """``mean ± std``; the mean alone where there is no std (one seed), ``-`` for no mean."""
    mean, std = pair
    if math.isnan(mean):
        return "-"
    if math.isnan(std):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def plot_curves(study: Mapping[str, Any], path: Path) -> None:
    """Validation metric per epoch: the mean over a label's finished runs, a band of one
    standard deviation, each run's own curve thin (so a diverging seed stays visible)."""
    metric = study["curve_metric"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for index, label in enumerate(labels(study)):
        color = f"C{index}"
        runs = [r for r in study["runs"] if r["label"] == label and r.get("fit")]
        by_epoch: dict[int, list[float]] = {}
        for run in runs:
            curve = [p for p in _curve(run) if p.get(metric) is not None]
            ax.plot(
                [p["epoch"] + 1 for p in curve],
                [p[metric] for p in curve],
                color=color,
                alpha=0.3,
                linewidth=0.8,
            )
            for point in curve:
                by_epoch.setdefault(point["epoch"], []).append(point[metric])
        if not by_epoch:
            continue
        epochs = sorted(by_epoch)
        means = [statistics.fmean(by_epoch[e]) for e in epochs]
        stds = [statistics.stdev(by_epoch[e]) if len(by_epoch[e]) > 1 else 0 for e in epochs]
        x = [e + 1 for e in epochs]
        ax.plot(x, means, color=color, label=f"{label} (n={len(runs)})", linewidth=2)
        ax.fill_between(
            x,
            [m - s for m, s in zip(means, stds, strict=True)],
            [m + s for m, s in zip(means, stds, strict=True)],
            color=color,
            alpha=0.2,
        )
    ax.set_xlabel("epoch")
    ax.set_ylabel(metric)
    if "ppl" in metric:
        ax.set_yscale("log")
    ax.set_title(f"{study['name']}: validation (mean ± std over seeds)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def timing_label(study: Mapping[str, Any]) -> str:
    """What a study's training times hold: studies written before the epoch timer paused
    during validation inside fit (no ``epoch_time_excludes_validation``) include it."""
    if study.get("epoch_time_excludes_validation"):
        return "validation excluded"
    return "incl. validation"


def plot_quality_vs_time(study: Mapping[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    """Test metric against training time (minutes, see :func:`timing_label`), mean ± std."""
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for index, row in enumerate(rows):
        (x, dx), (y, dy) = row["train_s"], row["metric"]
        if math.isnan(x) or math.isnan(y):
            continue
        ax.errorbar(
            x / 60,
            y,
            xerr=0 if math.isnan(dx) else dx / 60,
            yerr=0 if math.isnan(dy) else dy,
            fmt="o",
            color=f"C{index}",
            capsize=4,
            label=f"{row['label']} (n={row['ok']})",
        )
    ax.set_xlabel(f"training time (min, {timing_label(study)})")
    ax.set_ylabel(study["metric"])
    ax.set_title(f"{study['name']}: quality vs training time")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _where(study: Mapping[str, Any]) -> str:
    env = study.get("environment", {})
    gpus = env.get("gpus") or []
    device = ", ".join(gpus) if gpus else f"CPU ({env.get('cpu_count', '?')} cores)"
    load = env.get("load_average")
    load_text = f", load average {load[0]} at the start" if load else ""
    commit = "commit " + (env.get("git_commit") or "unknown")[:10]
    if runs := env.get("run_commits"):  # a study resumed on other code: each commit's runs
        commit = "commits " + ", ".join(f"{c[:10]} ({n} runs)" for c, n in runs.items())
    if env.get("git_dirty"):  # (studies written before the flag: unknown, not said)
        commit += " with uncommitted changes"
    return f"{device}, torch {env.get('torch', '?')}, {commit}{load_text}"


# -- corpora with a known optimum (the synthetic Markov chain, app.callbacks.DataOptimum) --------
def optimum_rows(study: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per label, where the test logged ``test/optimum_nll``: the excess over the optimum
    (``test/loss - test/optimum_nll``, nats) over seeds, the share of the same width's
    baseline excess the head closes (of all of it, and of what lies above the floor: the
    baseline's excess at the widest width, where d > r leaves only finite data and budget),
    and the runs' ranks against ``d + 1`` and the data's rank ``r``."""
    per_label: dict[str, dict[str, Any]] = {}
    for run in study["runs"]:
        test = run.get("test") or {}
        if run["status"] != "ok" or "test/optimum_nll" not in test or "test/loss" not in test:
            continue
        row = per_label.setdefault(run["label"], {
            "label": run["label"], "head": run["head"], "variant": run.get("variant"),
            "excess": [], "ranks": [], "ranks_1e-2": [], "d": None,
            "data_rank": test.get("test/data_rank"), "optimum": test["test/optimum_nll"],
            "entropy_rate": test.get("test/entropy_rate"),
        })  # fmt: skip
        row["excess"].append(test["test/loss"] - test["test/optimum_nll"])
        if run.get("rank"):
            row["d"] = run["rank"]["hidden_size"]
            row["ranks"].append(run["rank"]["rank"])
            row["ranks_1e-2"].append(run["rank"].get("relative_ranks", {}).get("1e-02"))
    rows = list(per_label.values())
    for row in rows:
        row["mean_std"] = _mean_std(row["excess"])
    base = {r["variant"]: r["mean_std"][0] for r in rows if r["head"] == study["baseline"]}
    widest = max((r for r in rows if r["d"] is not None), key=lambda r: r["d"], default=None)
    floor = base.get(widest["variant"]) if widest else None
    for row in rows:
        reference = base.get(row["variant"])
        row["closed"] = row["closed_above_floor"] = math.nan
        if reference is not None and reference > 0:
            row["closed"] = (reference - row["mean_std"][0]) / reference
            if floor is not None and reference > floor and row["variant"] != widest["variant"]:
                row["closed_above_floor"] = (reference - row["mean_std"][0]) / (reference - floor)
        row["floor"] = floor
    return rows


def render_optimum(study: Mapping[str, Any]) -> list[str]:
    """The excess table of :func:`optimum_rows` (no lines when the study has no optimum)."""
    rows = optimum_rows(study)
    if not rows:
        return []
    first = rows[0]
    rate = first["entropy_rate"]
    lines = [
        f"Excess over the optimum (test/loss - the true chain's NLL on the test split, "
        f"{first['optimum']:.4f} nats; entropy rate "
        f"{'-' if rate is None else f'{rate:.4f}'} nats; data rank r = "
        f"{'-' if first['data_rank'] is None else int(first['data_rank'])}). "
        f"Closed: the share of `{study['baseline']}`'s excess at the same width the head "
        f"closes; above the floor: of `{study['baseline']}`'s excess minus its excess at the "
        f"widest width (floor {first['floor']:.4f} nats).",
        "",
        "| head | d | n | excess (nats) mean ± std | closed | closed above floor | "
        "rank (per seed) | rank > 1e-2 σ₁ | d + 1 | r |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:

        def share(value: float) -> str:
            return "-" if math.isnan(value) else f"{value:.0%}"

        lines.append("| " + " | ".join([
            row["label"], str(row["d"] or "-"), str(len(row["excess"])),
            mean_std_text(row["mean_std"], 4), share(row["closed"]),
            share(row["closed_above_floor"]),
            "/".join(map(str, row["ranks"])) or "-",
            "/".join(str(r) for r in row["ranks_1e-2"] if r is not None) or "-",
            "-" if row["d"] is None else str(row["d"] + 1),
            "-" if row["data_rank"] is None else str(int(row["data_rank"])),
        ]) + " |")  # fmt: skip
    lines.append("")
    return lines


def render_markdown(study: Mapping[str, Any], image_dir: Path | str, link_prefix: str = "") -> str:
    """Markdown for a study (table, comparison, plots); the PNGs are written to ``image_dir``
    as ``<name>_curves.png`` and ``<name>_quality_vs_time.png`` and linked as
    ``<link_prefix><file>``."""
    image_dir = Path(image_dir)
    image_dir.mkdir(parents=True, exist_ok=True)
    name, metric = study["name"], study["metric"]
    rows = summarize(study)
    lines = [f"### Study `{name}`", ""]
    if study.get("description"):
        lines += [study["description"], ""]
    budget = ", ".join(f"{k}={v}" for k, v in (study.get("budget") or {}).items()) or "see grid"
    lines += [f"Budget: {budget}. Ran on: {_where(study)}.", ""]
    lines += _summary_table(study, rows)
    if not study.get("epoch_time_excludes_validation"):
        lines += [
            "Training times include validation: this study was run before the epoch timer "
            "excluded it (`time/train_epoch_s`, issue 33).",
            "",
        ]
    lines += _comparison(study, rows)
    lines += render_optimum(study)
    per_seed = ", ".join(
        f"{row['label']} " + "/".join("-" if v is None else f"{v:.2f}" for v in row["per_seed"])
        for row in rows
    )
    lines += [f"Per seed ({metric}, seeds in grid order): {per_seed}.", ""]
    curves, quality = f"{name}_curves.png", f"{name}_quality_vs_time.png"
    plot_curves(study, image_dir / curves)
    plot_quality_vs_time(study, rows, image_dir / quality)
    lines += [
        f"![validation curves]({link_prefix}{curves})",
        f"![quality vs training time]({link_prefix}{quality})",
        "",
    ]
    return "\n".join(lines)


def _summary_table(study: Mapping[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """One row per head: the metric, best validation, epochs, times, rank (and the paper's)."""
    reference = study.get("reference") or {}
    ref_values = reference.get("values", {})
    header = [
        "head",
        "n (ok/runs)",
        f"{study['metric']} mean ± std",
        f"best {study['curve_metric']}",
        "epochs",
        f"train s/epoch ({timing_label(study)})",
        f"train min ({timing_label(study)})",
        "rank",
    ]
    if ref_values:
        header.append(f"paper ({reference.get('source', '')})")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        notes = [f"{row[k]} {k}" for k in ("diverged", "failed", "unstable") if row[k]]
        count = f"{row['ok']}/{row['runs']}" + (f" ({', '.join(notes)})" if notes else "")
        train_min = (row["train_s"][0] / 60, row["train_s"][1] / 60)
        cells = [
            row["label"],
            count,
            mean_std_text(row["metric"]),
            mean_std_text(row["best_val"]),
            mean_std_text(row["epochs"], 1),
            mean_std_text(row["epoch_s"], 1),
            mean_std_text(train_min, 1),
            "/".join(map(str, row["rank"])) or "-",
        ]
        if ref_values:
            value = ref_values.get(row["label"].split("+")[0])
            cells.append("-" if value is None else f"{value}")
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _comparison(study: Mapping[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """Each head against the baseline: the difference, its spread, Welch's t-test and the
    paired one over seeds."""
    comparisons = compare(study, rows)
    if not comparisons:
        return []
    direction = "lower" if study["mode"] == "min" else "higher"
    # a loss's gaps are hundredths of a nat: four decimals below 10, two for perplexities
    means = [abs(r["metric"][0]) for r in rows if r["ok"]]
    digits = 4 if means and max(means) < 10 else 2
    variants = any(c["baseline"] != study["baseline"] for c in comparisons)
    same = " at the same variant" if variants else ""
    lines = [
        f"Against `{study['baseline']}`{same} ({study['metric']}, {direction} is better):",
        "",
    ]
    for c in comparisons:
        verdict = (
            f"{direction} by more than one std"
            if c["better_by_more_than_one_std"]
            else f"not {direction} by more than one std"
        )
        p_text = "" if math.isnan(c["p_value"]) else f", Welch's t-test p {p_text_of(c['p_value'])}"
        if not math.isnan(c["paired_p_value"]):
            p_text += f", paired by seed ({c['pairs']} pairs) p {p_text_of(c['paired_p_value'])}"
        spread, delta = c["spread"], f"{c['delta']:+.{digits}f}"
        std = "no std: one seed each" if math.isnan(spread) else f"std {spread:.{digits}f}"
        against = f" against `{c['baseline']}`" if c["baseline"] != study["baseline"] else ""
        lines.append(f"- `{c['label']}`{against}: {delta} ({std}): {verdict}{p_text}")
    return [*lines, ""]
