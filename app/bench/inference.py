"""Top-k inference benchmark: ``python -m app.bench --mode inference --help``.

Times top-k retrieval per query, at batch 1 and batched, for DS-Softmax (gate, then a softmax
over the selected expert's surviving classes), DS-Softmax with the SVD-softmax preview on its
large experts, and the full softmax followed by ``topk`` (DS-Softmax paper, Tables 1 and 3).
``softmax_1x`` is the same full softmax as a DS head with one expert over every class: at
batch 1 it runs through the same C kernel as DS (``heads/ds/native``), so DS's speed-up against
it is what sparsity alone buys, while the one against ``softmax`` (``F.linear`` +
``log_softmax`` + ``topk``) is what a user of the plain softmax head gains. Heads are
interleaved block by block so they share the machine's state; each figure is the median over
blocks and repeats, and ``*_min`` the fastest block (which other jobs disturb least).

Two sources of heads:

- trained language models: ``--softmax-config`` with one or more ``--softmax-checkpoint``,
  ``--ds-config`` with one or more ``--ds-checkpoint`` (``NAME=PATH`` names a row), as
  ``cli.py`` wrote them. Every model is evaluated on the test split: top-1/5/10 accuracy
  through ``head.topk`` (for DS: expert utilisation ``u_k`` and the FLOP speed-up
  ``|V| / (sum_k |v_k| u_k + K)``); the timed queries are the first DS model's test context
  vectors. The first softmax is the reference of every ratio and accuracy difference.
- synthetic (no checkpoints): a DS head with ``--experts`` experts of ``--expert-size`` random
  classes each, and a softmax of the same ``V`` and ``d``, timed on random context vectors
  (random experts have no low-rank structure: SVD rows measure speed only).

``--svd RANK:CANDIDATES[:MIN_CLASSES]`` (repeatable) adds, for every DS model, a copy that
answers ``topk`` by SVD-softmax (``heads/ds/svd.py``): the paper's SVD-50 on experts over
1,000 classes is ``16:0.5:1000``. ``breakdown`` splits the C kernel's batch-1 time into gate,
expert rows, SVD candidate selection and normaliser/top-k, and the rest of a ``topk`` call
(Python, allocation, ctypes; and the memory stalls of a query whose expert's rows are not in
cache, which the profile's back-to-back queries hide) into ``python_overhead``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.bench.timing import (
    CLOCKS,
    check_clock,
    check_device,
    interval_text,
    paired_ratio,
    time_once,
)
from app.cli.lightning_cli import build
from app.machine import load_average
from heads import DSSoftmaxHead, SoftmaxHead
from heads.ds.native import ds_topk_kernels
from heads.ds.svd import SVDPreview, expert_cost

ACCURACY_K = (1, 5, 10)


def synthetic_ds_head(vocab: int, hidden: int, experts: int, expert_size: int, seed: int = 0):
    """A DS head whose experts hold ``expert_size`` random classes each, every class covered."""
    if not 0 < expert_size <= vocab or experts * expert_size < vocab:
        raise ValueError(
            f"--expert-size must be in [V / K, V] = [{-(-vocab // experts)}, {vocab}], "
            f"got {expert_size}"
        )
    gen = torch.Generator().manual_seed(seed)
    head = DSSoftmaxHead(hidden, vocab, num_experts=1)
    order = torch.randperm(vocab, generator=gen)
    classes = []
    for k in range(experts):
        # a share of the permutation makes every class covered; random classes fill the rest
        own = order[k * vocab // experts : (k + 1) * vocab // experts]
        rest = torch.randperm(vocab, generator=gen)
        rest = rest[~torch.isin(rest, own)][: expert_size - own.numel()]
        classes.append(torch.cat((own, rest)).sort().values)
    row_class = torch.cat(classes)
    weight = torch.randn(row_class.numel(), hidden, generator=gen) * hidden**-0.5
    gate = torch.randn(experts, hidden, generator=gen) * hidden**-0.5
    head.set_structure(weight, row_class, [expert_size] * experts, gate)
    return head


@torch.no_grad()
def softmax_as_one_expert(softmax: SoftmaxHead) -> DSSoftmaxHead:
    """The same full softmax as a DS head with one expert over every class (``G = 1``), so
    its top-k runs through the same code as DS (the C kernel at batch 1): the speed-up
    against it isolates what sparsity buys from what the implementation buys."""
    weight, bias = softmax.weight, softmax.bias
    if softmax.projection is not None:  # fold the linear projection: W (P h + p) + b
        weight, bias = (
            weight @ softmax.projection.weight,
            weight @ softmax.projection.bias + (0.0 if bias is None else bias),
        )
    head = DSSoftmaxHead(softmax.hidden_size, softmax.vocab_size, num_experts=1,
                         bias=bias is not None)  # fmt: skip
    rows = weight if bias is None else torch.cat((weight, bias[:, None]), dim=1)
    head.set_structure(rows.float(), torch.arange(softmax.vocab_size), [softmax.vocab_size],
                       torch.zeros(1, softmax.hidden_size))  # fmt: skip
    return head.to(softmax.weight.dtype)


def with_svd(head: DSSoftmaxHead, spec: SVDPreview) -> DSSoftmaxHead:
    """A copy of ``head`` whose ``topk`` uses the SVD preview ``spec``."""
    copied = copy.deepcopy(head)
    copied.set_svd_preview(spec.rank, spec.candidates, spec.min_classes)
    return copied


def parse_svd(text: str) -> SVDPreview:
    """``RANK:CANDIDATES[:MIN_CLASSES]``, e.g. ``16:0.5:1000`` (the paper's SVD-50)."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--svd takes RANK:CANDIDATES[:MIN_CLASSES], got {text}")
    try:
        numbers = (int(parts[0]), float(parts[1]), *(int(p) for p in parts[2:]))
        return SVDPreview(*numbers)
    except ValueError as error:  # HeadConfigError is a ValueError
        raise argparse.ArgumentTypeError(f"--svd {text}: {error}") from None


def svd_name(name: str, spec: SVDPreview) -> str:
    """``ds+svd16-50`` for the paper's SVD-50 (experts over 1,000 classes), ``ds+svd16-10-over300``
    with another threshold: every ``--svd`` gets its own row."""
    over = "" if spec.min_classes == SVDPreview.min_classes else f"-over{spec.min_classes}"
    return f"{name}+svd{spec.rank}-{round(spec.candidates * 100)}{over}"


def named_paths(values: list[str] | None, kind: str) -> dict[str, str]:
    """``NAME=PATH`` or ``PATH`` arguments: names default to ``kind``, ``kind_2``, ..."""
    named = {}
    for i, value in enumerate(values or []):
        name, _, path = value.rpartition("=") if "=" in value else ("", "", value)
        named[name or (kind if i == 0 else f"{kind}_{i + 1}")] = path
    return named


def load_lm(config: str, checkpoint: str):
    """Model and data module as ``cli.py`` builds them from ``config``, weights from
    ``checkpoint``."""
    cli = build([config])
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    cli.model.load_state_dict(state["state_dict"])
    datamodule = cli.datamodule
    key = type(datamodule).__qualname__
    if key in state and hasattr(datamodule, "load_state_dict"):
        datamodule.load_state_dict(state[key])
    return cli.model.eval(), datamodule


@torch.inference_mode()
def evaluate_lm(
    model, datamodule, heads: dict[str, nn.Module], keep_queries: int, max_batches: int | None
) -> dict[str, Any]:
    """Top-k accuracy on the test split through ``head.topk`` for each of ``heads`` (the
    model's own head and variants of it) on the model's context vectors; utilisation for DS
    heads. Returns ``{"metrics": {name: ...}, "queries": [keep_queries, d]}``."""
    datamodule.setup("test")
    hits = {name: torch.zeros(len(ACCURACY_K), dtype=torch.float64) for name in heads}
    counts = torch.zeros(getattr(model.head, "num_experts", 1), dtype=torch.float64)
    total, state, kept = 0, None, []
    for index, (inputs, targets) in enumerate(datamodule.test_dataloader()):
        if max_batches is not None and index >= max_batches:
            break
        hidden, state = model.backbone(inputs, state)
        hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
        keep = targets != -100
        hidden, targets = hidden[keep], targets[keep]
        for name, head in heads.items():
            _, indices = head.topk(hidden, max(ACCURACY_K))
            found = indices == targets[:, None]
            for i, k in enumerate(ACCURACY_K):
                hits[name][i] += found[:, :k].any(dim=1).sum()
        total += targets.numel()
        if isinstance(model.head, DSSoftmaxHead):
            expert, _ = model.head.select(hidden)
            counts += torch.bincount(expert, minlength=model.head.num_experts).double()
        if sum(h.size(0) for h in kept) < keep_queries:
            kept.append(hidden)
    metrics = {}
    for name, head in heads.items():
        result: dict[str, Any] = {
            f"acc_top{k}": float(hits[name][i] / max(total, 1)) for i, k in enumerate(ACCURACY_K)
        }
        result["tokens"] = total
        if isinstance(head, DSSoftmaxHead):
            result.update(ds_structure(head, counts / counts.sum().clamp_min(1)))
        metrics[name] = result
    return {"metrics": metrics, "queries": torch.cat(kept)[:keep_queries]}


def ds_structure(head: DSSoftmaxHead, utilisation: torch.Tensor, k: int = 10) -> dict[str, Any]:
    """Experts, utilisation and FLOP speed-ups; with an SVD preview, also the speed-up of
    its top-``k`` (``heads.ds.svd.expert_cost``) and how many experts use the preview."""
    sizes = head.expert_sizes()
    result = {
        "num_experts": head.num_experts,
        "expert_sizes": sizes,
        "utilisation": utilisation.tolist(),
        "flops_speedup": head.flops_speedup(utilisation),
        "rows_over_softmax": sum(sizes) / head.vocab_size,
    }
    spec = head.svd_preview
    if spec is not None:
        costs = torch.tensor([expert_cost(n, head.row_size, spec, k) for n in sizes])
        expected = float((costs.double() * utilisation.double()).sum()) + head.num_experts
        result["svd"] = {"rank": spec.rank, "candidates": spec.candidates,
                         "min_classes": spec.min_classes}  # fmt: skip
        result["svd_experts"] = sum(spec.applies_to(n, head.row_size) for n in sizes)
        result[f"svd_flops_speedup_top{k}"] = head.vocab_size / expected
    return result


def _topk_each(head: nn.Module, inputs: list[torch.Tensor], k: int) -> None:
    for queries in inputs:
        head.topk(queries, k)


@torch.inference_mode()
def time_topk(
    heads: dict[str, nn.Module],
    queries: torch.Tensor,
    k: int,
    batch_size: int,
    repeats: int,
    warmup: int,
    block: int = 100,
    clock: str = "wall",
) -> dict[str, dict[str, float]]:
    """Per-query latency (us) of ``head.topk``: one query at a time, and in batches.

    The queries are timed in blocks of ``block`` queries (batch 1) or ``block`` batches, the
    heads interleaved block by block so they share the machine's state. ``*_us_per_query`` is
    the median over all blocks and repeats; ``*_min`` the fastest block, which a machine
    shared with other jobs disturbs least (a whole pass rarely escapes preemption);
    ``*_blocks`` every block's time, in the order timed (paired across heads: ``ratios``)."""
    now, device = CLOCKS[clock], queries.device
    singles = {name: [] for name in heads}
    batched = {name: [] for name in heads}
    n = queries.size(0)
    rows = [queries[i : i + 1] for i in range(n)]  # sliced once: not part of any head's time
    for repeat in range(warmup + repeats):
        for start in range(0, n, block):
            stop = min(start + block, n)
            for name, head in heads.items():
                seconds = time_once(partial(_topk_each, head, rows[start:stop], k), device, now)
                if repeat >= warmup:
                    singles[name].append(seconds / (stop - start) * 1e6)
        for start in range(0, n, block * batch_size):
            stop = min(start + block * batch_size, n)
            starts = range(start, stop, batch_size)
            batches = [queries[i : min(i + batch_size, stop)] for i in starts]
            for name, head in heads.items():
                seconds = time_once(partial(_topk_each, head, batches, k), device, now)
                if repeat >= warmup:
                    batched[name].append(seconds / (stop - start) * 1e6)
    return {
        name: {
            "batch1_us_per_query": statistics.median(singles[name]),
            "batched_us_per_query": statistics.median(batched[name]),
            "batch1_us_per_query_min": min(singles[name]),
            "batched_us_per_query_min": min(batched[name]),
            "batch1_us_per_query_blocks": singles[name],
            "batched_us_per_query_blocks": batched[name],
        }
        for name in heads
    }


def breakdown(
    heads: dict[str, nn.Module], queries: torch.Tensor, k: int, latency: dict[str, dict]
) -> dict[str, dict[str, float]]:
    """Where a batch-1 top-k's time goes, per DS head served by the C kernel: the kernel's
    stages (microseconds per query, summed over ``queries``), and ``python_overhead``, the
    median batch-1 time minus the kernel's: the ``topk`` call, its checks and allocations
    (about 4 us on this project's CPU), plus cache misses the back-to-back profile avoids.
    Both are CPU time of one thread with ``--clock cpu``."""
    result = {}
    for name, head in heads.items():
        if not isinstance(head, DSSoftmaxHead) or queries.device.type != "cpu":
            continue
        profiled = head._inference_cache().profile(queries, k)
        if profiled is None:
            continue
        (_, classes), stages = profiled
        # the profile answers as topk does: a check that the stages timed the real path
        _, expected = head.topk(queries, k)
        stages["same_answers"] = bool(torch.equal(classes, expected))
        stages["python_overhead"] = latency[name]["batch1_us_per_query"] - stages["kernel_total"]
        result[name] = stages
    return result


def ratios(latency: dict[str, dict], reference: str, repeats: int = 1) -> dict[str, dict[str, Any]]:
    """How many times as fast as ``reference`` each other head is, per timing key: for the
    medians, from the blocks' paired ratios (block i of every head timed back to back), with
    its 95% interval as ``<key>_ci``; for the fastest blocks, their ratio. Files written
    before the blocks were kept: the ratio of the medians.

    Where a repeat times several blocks (batch 1: a block of queries each), a block of
    queries timed in every repeat is one unit: the figure is the median of the units' median
    ratios and its interval is over the units, not over every (repeat, block) pair (the same
    queries again are not new data: over them the interval was ~1.8x too narrow)."""
    base = latency[reference]
    result = {}
    for name, times in latency.items():
        if name == reference:
            continue
        speedups: dict[str, Any] = {}
        for key, value in times.items():
            if key.endswith("_blocks"):
                continue
            blocks = f"{key}_blocks"
            if blocks in times and blocks in base:
                pairs = [b / t for b, t in zip(base[blocks], times[blocks], strict=True)]
                units = _per_block_of_queries(pairs, repeats)
                ratio, low, high = paired_ratio(units, [1.0] * len(units))
                speedups[key], speedups[f"{key}_ci"] = ratio, [low, high]
            else:
                speedups[key] = base[key] / value
        result[name] = speedups
    return result


def _per_block_of_queries(pairs: list[float], repeats: int) -> list[float]:
    """``pairs`` in the order timed (repeat by repeat, block by block within one): each
    block's median over the repeats, or ``pairs`` where a repeat is one block."""
    blocks, rest = divmod(len(pairs), max(repeats, 1))
    if rest or blocks <= 1:
        return pairs
    return [statistics.median(pairs[j::blocks]) for j in range(blocks)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    report: dict[str, Any] = {"args": vars(args).copy()}
    report["args"]["svd"] = [vars(spec) for spec in args.svd]
    load_before = load_average()
    softmax_paths = named_paths(args.softmax_checkpoint, "softmax")
    ds_paths = named_paths(args.ds_checkpoint, "ds")
    if softmax_paths or ds_paths:
        heads, queries, reference = _checkpoint_heads(args, softmax_paths, ds_paths, report)
    else:
        heads, queries, reference = _synthetic_heads(args, report)
    report["reference"] = reference
    heads["softmax_1x"] = softmax_as_one_expert(heads[reference])
    for head in heads.values():
        head.eval().to(device)
    queries = queries.to(device)
    report["latency"] = time_topk(heads, queries, args.k, args.batch_size, args.repeats,
                                  args.warmup, args.block, args.clock)  # fmt: skip
    report["speedup_vs_softmax"] = ratios(report["latency"], reference, args.repeats)
    report["speedup_vs_softmax_1x"] = ratios(report["latency"], "softmax_1x", args.repeats)
    report["breakdown"] = breakdown(heads, queries, args.k, report["latency"])
    report["machine"] = {
        "platform": platform.platform(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "native_kernel": ds_topk_kernels() is not None,
        "load_average": load_before,
        "load_average_after": load_average(),
    }
    return report


def _checkpoint_heads(args, softmax_paths, ds_paths, report):
    """Heads of trained checkpoints (and DS's SVD variants), their test-split quality into
    ``report``, and the DS model's test contexts as queries."""
    if not (args.softmax_config and softmax_paths and args.ds_config and ds_paths):
        raise SystemExit("error: give --softmax-config, --softmax-checkpoint, --ds-config and "
                         "--ds-checkpoint together")  # fmt: skip
    heads: dict[str, nn.Module] = {}
    quality, queries = {}, None
    for kind, paths in (("softmax", softmax_paths), ("ds", ds_paths)):
        for name, path in paths.items():
            model, datamodule = load_lm(getattr(args, f"{kind}_config"), path)
            variants = {name: model.head}
            if kind == "ds":
                variants.update({svd_name(name, s): with_svd(model.head, s) for s in args.svd})
            print(f"evaluating {', '.join(variants)} on the test split", flush=True)
            evaluated = evaluate_lm(model, datamodule, variants, args.queries,
                                    args.max_eval_batches)  # fmt: skip
            quality.update(evaluated["metrics"])
            if kind == "ds" and queries is None:
                queries = evaluated["queries"]
            # extra softmax checkpoints are quality references: same latency as the first
            if kind == "ds" or not heads:
                heads.update(variants)
    reference = next(iter(softmax_paths))
    report["quality"] = quality
    report["accuracy_vs_softmax_points"] = {
        name: {key: 100 * (metrics[key] - quality[reference][key])
               for key in (f"acc_top{k}" for k in ACCURACY_K)}
        for name, metrics in quality.items() if name != reference
    }  # fmt: skip
    return heads, queries, reference


def _synthetic_heads(args, report):
    """A synthetic DS head beside a softmax of the same size, random queries."""
    ds = synthetic_ds_head(args.vocab_size, args.hidden_size, args.experts, args.expert_size)
    heads = {"softmax": SoftmaxHead(args.hidden_size, args.vocab_size), "ds": ds}
    heads.update({svd_name("ds", s): with_svd(ds, s) for s in args.svd})
    queries = torch.randn(args.queries, args.hidden_size)
    expert, _ = ds.select(queries)
    counts = torch.bincount(expert, minlength=ds.num_experts).double()
    report["quality"] = {name: ds_structure(head, counts / counts.sum())
                         for name, head in heads.items() if name != "softmax"}  # fmt: skip
    return heads, queries, "softmax"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench --mode inference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=["inference"], default="inference")
    parser.add_argument("--ds-config", help="cli.py YAML of the DS-Softmax language model(s)")
    parser.add_argument("--ds-checkpoint", action="append",
                        help="[NAME=]PATH, repeatable (e.g. one per mitosis stage)")  # fmt: skip
    parser.add_argument("--softmax-config", help="cli.py YAML of the softmax language model(s)")
    parser.add_argument("--softmax-checkpoint", action="append",
                        help="[NAME=]PATH, repeatable: the first is the reference, the others "
                             "are evaluated for accuracy only")  # fmt: skip
    parser.add_argument("--svd", action="append", type=parse_svd, default=[],
                        help="RANK:CANDIDATES[:MIN_CLASSES], repeatable: a DS+SVD row per DS "
                             "model (the paper's SVD-50: 16:0.5:1000)")  # fmt: skip
    parser.add_argument("--max-eval-batches", type=int, default=None,
                        help="evaluate on the first N test batches only")  # fmt: skip
    parser.add_argument("--vocab-size", type=int, default=10_000, help="synthetic heads")
    parser.add_argument("--hidden-size", type=int, default=200, help="synthetic heads")
    parser.add_argument("--experts", type=int, default=64, help="synthetic DS head")
    parser.add_argument("--expert-size", type=int, default=250,
                        help="classes per expert of the synthetic DS head")  # fmt: skip
    parser.add_argument("--k", type=int, default=10, help="top-k retrieved per query")
    parser.add_argument("--queries", type=int, default=500, help="timed context vectors")
    parser.add_argument("--batch-size", type=int, default=100, help="batched timing")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU rows")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall: elapsed time; cpu: process CPU time, steadier on a shared "
                             "machine (one thread)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block", type=int, default=100,
                        help="queries (batch 1) or batches timed together; heads interleave "
                             "block by block")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="bench_results", help="folder for the JSON")
    parser.add_argument("--name", default="inference", help="file stem")
    args = parser.parse_args(argv)
    for name in ("k", "queries", "batch_size", "threads", "repeats", "block", "vocab_size",
                 "hidden_size", "experts", "expert_size"):  # fmt: skip
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    names = [svd_name("ds", spec) for spec in args.svd]
    if len(set(names)) != len(names):
        parser.error(f"--svd options name the same row twice ({', '.join(names)}): give "
                     "distinct RANK:CANDIDATES[:MIN_CLASSES]")  # fmt: skip
    check_device(parser, args.device)
    check_clock(parser, args.clock, args.device)
    return args


def print_report(report: dict[str, Any]) -> None:
    nan = float("nan")
    for name, metrics in report.get("quality", {}).items():
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()
                 if k not in ("expert_sizes", "utilisation")}  # fmt: skip
        print(f"{name}: {shown}")
    for name, delta in report.get("accuracy_vs_softmax_points", {}).items():
        print(f"{name}: points vs softmax " + ", ".join(f"{k} {v:+.2f}" for k, v in delta.items()))
    keys = ("batch1_us_per_query", "batched_us_per_query", "batch1_us_per_query_min",
            "batched_us_per_query_min")  # fmt: skip
    widths = (12, 12, 14, 14)
    width = max(18, *(len(name) + 10 for name in report["latency"]))
    print(f"\n{'us/query':<{width}}{'batch-1':>12}{'batched':>12}{'batch-1 min':>14}"
          f"{'batched min':>14}")  # fmt: skip
    for name, row in report["latency"].items():
        cells = (f"{row[key]:>{w}.1f}" for key, w in zip(keys, widths, strict=True))
        print(f"{name:<{width}}" + "".join(cells))
    for peer in ("softmax", "softmax_1x"):
        for name, speed in report[f"speedup_vs_{peer}"].items():
            if name.startswith("softmax"):
                continue
            cells = (f"{speed[key]:>{w - 1}.2f}x" for key, w in zip(keys, widths, strict=True))
            intervals = ", ".join(
                f"{label} {interval_text(*speed.get(f'{key}_ci', (nan, nan)))}"
                for label, key in (("batch-1", keys[0]), ("batched", keys[1]))
            )
            print(f"{name + ' vs ' + peer:<{width}}" + "".join(cells) + f"  95% CI {intervals}")
    for name, stages in report["breakdown"].items():
        shown = ", ".join(f"{k} {v:.1f}" for k, v in stages.items() if isinstance(v, float))
        print(f"batch-1 us/query, {name}: {shown}")
    kernel = "C kernel" if report["machine"]["native_kernel"] else "PyTorch (no C compiler)"
    print(
        f"DS and softmax_1x top-k ran through: {kernel}; load average before/after: "
        f"{report['machine']['load_average']} / {report['machine']['load_average_after']}"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"wrote {out / (args.name + '.json')}")
    return report
