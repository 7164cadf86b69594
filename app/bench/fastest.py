"""``auto``'s table on CUDA from GPU benchmark reports: ``python -m app.bench.fastest FILE...``.

For every head and vocabulary size the reports time, the loss that ran fastest among the head's
default (``torch``: the compiled column plan, or plain maths for an adaptive softmax's small
classifiers), its ``@rows``, ``@fused`` (rows with the fused products), ``@compiled`` and
``@plain`` plans and the field's ``@cce`` and ``@liger`` kernels: an alternative replaces the
default only where its paired ratio's 95% interval lies wholly below 1 (a faster median
inside the noise changes nothing). Prints the
``MEASURED_FASTEST`` literal for ``heads/fused_cross_entropy.py``, each choice with its ratio
and the file it came from, for a person to paste with the run that produced it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from app.bench.report import paired_row_ratio

# the benchmark's subject names -> the head classes the table is keyed by
HEAD_CLASSES = {"softmax": "SoftmaxHead", "mos": "MoSHead", "mixtape": "MixtapeHead",
                "adaptive": "AdaptiveSoftmaxHead"}  # fmt: skip
# what auto may run instead of the default (compiled: the column plan where the default is
# another, e.g. an adaptive softmax's plain classifiers)
ALTERNATIVES = ("rows", "fused", "compiled", "plain", "cce", "liger")


def choices(report: dict) -> list[tuple[str, int, str, str]]:
    """``(head class, V, choice, why)`` for each head and vocabulary size of ``report``'s
    results that timed the head's default (``choice``: ``torch``, or an alternative)."""
    rows = report["results"]
    found = []
    for row in rows:
        if row["head"] not in HEAD_CLASSES:
            continue
        best, why = "torch", "the default: no alternative faster beyond the noise"
        best_ratio = 1.0
        for name in ALTERNATIVES:
            other = next((r for r in rows if r["head"] == f"{row['head']}@{name}"
                          and r["vocab_size"] == row["vocab_size"]), None)  # fmt: skip
            paired = None if other is None else paired_row_ratio(other, row)
            if paired is None:
                continue
            ratio, _, high = paired
            if high < 1.0 and ratio < best_ratio:
                best, best_ratio = name, ratio
                why = f"{ratio:.2f}x the default's time [95% CI up to {high:.2f}]"
        found.append((HEAD_CLASSES[row["head"]], row["vocab_size"], best, why))
    return found


def table(found: list[tuple[str, int, str, str]]) -> dict[str, list[tuple[int, str]]]:
    """``MEASURED_FASTEST``: per head class, ``(largest V, choice)`` in increasing V, only
    the sizes whose choice is not the default (a size up to the first listed bound takes its
    choice: unlisted sizes in between fall to the next bound's, so the defaults are kept as
    ``torch`` entries wherever a larger size has another choice)."""
    by_head: dict[str, list[tuple[int, str]]] = {}
    for head, vocab, choice, _ in sorted(found):
        by_head.setdefault(head, []).append((vocab, choice))
    result = {}
    for head, entries in by_head.items():
        while entries and entries[-1][1] == "torch":  # beyond the last choice: the default
            entries.pop()
        if entries:
            result[head] = entries
    return result


def main(argv: list[str] | None = None) -> dict[str, list[tuple[int, str]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="GPU benchmark JSON files")
    args = parser.parse_args(argv)
    found = []
    for path in args.reports:
        report = json.loads(path.read_text())
        for head, vocab, choice, why in choices(report):
            print(f"# {head} V={vocab}: {choice} ({why}; {path.name})")
            found.append((head, vocab, choice, why))
    measured = table(found)
    print(f"MEASURED_FASTEST = {measured!r}")
    return measured


if __name__ == "__main__":
    main()
