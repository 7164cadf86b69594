"""Top-k inference benchmark: ``python -m app.bench --mode inference --help``.

Times top-k retrieval per query, at batch 1 and batched, for DS-Softmax (gate, then a softmax
over the selected expert's surviving classes) against the full softmax followed by ``topk``,
on CPU (DS-Softmax paper, Table 1). ``softmax_1x`` is the same full softmax as a DS head with
one expert over every class: at batch 1 it runs through the same C kernel as DS
(``heads/native``), so DS's speed-up against it is what sparsity alone buys, while the one
against ``softmax`` (``F.linear`` + ``log_softmax`` + ``topk``) is what a user of the plain
softmax head gains. Heads are interleaved within each repeat so they share the
machine's state; each figure is the median over repeats.

Two sources of heads:

- trained language models: ``--ds-config/--ds-checkpoint`` and
  ``--softmax-config/--softmax-checkpoint`` (the YAML configs of ``cli.py`` and checkpoints it
  wrote). Both models are also evaluated on the data module's test split: top-1/5/10 accuracy
  through ``head.topk``, expert utilisation ``u_k`` and the FLOP speed-up
  ``|V| / (sum_k |v_k| u_k + K)``; the timed queries are the test split's context vectors.
- synthetic (no checkpoints): a DS head with ``--experts`` experts of ``--expert-size`` random
  classes each, and a softmax of the same ``V`` and ``d``, timed on random context vectors.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from app.lightning_cli import build
from heads import DSSoftmaxHead, SoftmaxHead
from heads.native import ds_topk_kernel

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
def evaluate_lm(model, datamodule, keep_queries: int, max_batches: int | None) -> dict[str, Any]:
    """Top-k accuracy on the test split through ``head.topk``; utilisation for DS heads."""
    datamodule.setup("test")
    head = model.head
    hits = torch.zeros(len(ACCURACY_K), dtype=torch.float64)
    counts = torch.zeros(getattr(head, "num_experts", 1), dtype=torch.float64)
    total, state, kept = 0, None, []
    for index, (inputs, targets) in enumerate(datamodule.test_dataloader()):
        if max_batches is not None and index >= max_batches:
            break
        hidden, state = model.backbone(inputs, state)
        hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
        keep = targets != -100
        hidden, targets = hidden[keep], targets[keep]
        _, indices = head.topk(hidden, max(ACCURACY_K))
        found = indices == targets[:, None]
        for i, k in enumerate(ACCURACY_K):
            hits[i] += found[:, :k].any(dim=1).sum()
        total += targets.numel()
        if isinstance(head, DSSoftmaxHead):
            expert, _ = head.select(hidden)
            counts += torch.bincount(expert, minlength=head.num_experts).double()
        if sum(h.size(0) for h in kept) < keep_queries:
            kept.append(hidden)
    result: dict[str, Any] = {
        f"acc_top{k}": float(hits[i] / max(total, 1)) for i, k in enumerate(ACCURACY_K)
    }
    result["tokens"] = total
    if isinstance(head, DSSoftmaxHead):
        utilisation = counts / counts.sum().clamp_min(1)
        result.update(ds_structure(head, utilisation))
    return {"metrics": result, "queries": torch.cat(kept)[:keep_queries]}


def ds_structure(head: DSSoftmaxHead, utilisation: torch.Tensor) -> dict[str, Any]:
    sizes = head.expert_sizes()
    return {
        "num_experts": head.num_experts,
        "expert_sizes": sizes,
        "utilisation": utilisation.tolist(),
        "flops_speedup": head.flops_speedup(utilisation),
        "rows_over_softmax": sum(sizes) / head.vocab_size,
    }


@torch.inference_mode()
def time_topk(
    heads: dict[str, nn.Module],
    queries: torch.Tensor,
    k: int,
    batch_size: int,
    repeats: int,
    warmup: int,
    block: int = 100,
) -> dict[str, dict[str, float]]:
    """Per-query latency (us) of ``head.topk``: one query at a time, and in batches.

    The queries are timed in blocks of ``block`` queries (batch 1) or ``block`` batches, the
    heads interleaved block by block so they share the machine's state. ``*_us_per_query`` is
    the median over all blocks and repeats; ``*_min`` the fastest block, which a machine
    shared with other jobs disturbs least (a whole pass rarely escapes preemption)."""
    singles = {name: [] for name in heads}
    batched = {name: [] for name in heads}
    n = queries.size(0)
    for repeat in range(warmup + repeats):
        for start in range(0, n, block):
            for name, head in heads.items():
                stop = min(start + block, n)
                began = time.perf_counter()
                for i in range(start, stop):
                    head.topk(queries[i : i + 1], k)
                single = (time.perf_counter() - began) / (stop - start)
                if repeat >= warmup:
                    singles[name].append(single * 1e6)
        for start in range(0, n, block * batch_size):
            for name, head in heads.items():
                stop = min(start + block * batch_size, n)
                began = time.perf_counter()
                for i in range(start, stop, batch_size):
                    head.topk(queries[i : min(i + batch_size, stop)], k)
                batch = (time.perf_counter() - began) / (stop - start)
                if repeat >= warmup:
                    batched[name].append(batch * 1e6)
    return {
        name: {
            "batch1_us_per_query": statistics.median(singles[name]),
            "batched_us_per_query": statistics.median(batched[name]),
            "batch1_us_per_query_min": min(singles[name]),
            "batched_us_per_query_min": min(batched[name]),
        }
        for name in heads
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    report: dict[str, Any] = {"args": vars(args)}
    if args.ds_checkpoint or args.softmax_checkpoint:
        if not (args.ds_config and args.ds_checkpoint and args.softmax_config
                and args.softmax_checkpoint):  # fmt: skip
            raise SystemExit("error: give --ds-config, --ds-checkpoint, --softmax-config and "
                             "--softmax-checkpoint together")  # fmt: skip
        evaluated = {}
        for name in ("softmax", "ds"):
            model, datamodule = load_lm(getattr(args, f"{name}_config"),
                                        getattr(args, f"{name}_checkpoint"))  # fmt: skip
            print(f"evaluating {name} on the test split", flush=True)
            evaluated[name] = (model.head, evaluate_lm(model, datamodule, args.queries,
                                                       args.max_eval_batches))  # fmt: skip
        heads = {name: head for name, (head, _) in evaluated.items()}
        report["quality"] = {name: ev["metrics"] for name, (_, ev) in evaluated.items()}
        queries = evaluated["ds"][1]["queries"]
    else:
        ds = synthetic_ds_head(args.vocab_size, args.hidden_size, args.experts, args.expert_size)
        softmax = SoftmaxHead(args.hidden_size, args.vocab_size)
        heads = {"softmax": softmax, "ds": ds}
        queries = torch.randn(args.queries, args.hidden_size)
        expert, _ = ds.select(queries)
        counts = torch.bincount(expert, minlength=ds.num_experts).double()
        report["quality"] = {"ds": ds_structure(ds, counts / counts.sum())}
    heads["softmax_1x"] = softmax_as_one_expert(heads["softmax"])
    for head in heads.values():
        head.eval()
    report["latency"] = time_topk(heads, queries, args.k, args.batch_size, args.repeats,
                                  args.warmup, args.block)  # fmt: skip
    ds_times = report["latency"]["ds"]
    report["latency_speedup"] = {  # DS against the PyTorch softmax, then against softmax_1x
        peer: {key: report["latency"][peer][key] / ds_times[key] for key in ds_times}
        for peer in ("softmax", "softmax_1x")
    }
    report["native_kernel"] = ds_topk_kernel() is not None
    report["machine"] = {"platform": platform.platform(), "torch": torch.__version__,
                         "threads": torch.get_num_threads()}  # fmt: skip
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m app.bench --mode inference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=["inference"], default="inference")
    parser.add_argument("--ds-config", help="cli.py YAML of the DS-Softmax language model")
    parser.add_argument("--ds-checkpoint")
    parser.add_argument("--softmax-config", help="cli.py YAML of the softmax language model")
    parser.add_argument("--softmax-checkpoint")
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
    return args


def print_report(report: dict[str, Any]) -> None:
    for name, metrics in report.get("quality", {}).items():
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items()
                 if k not in ("expert_sizes", "utilisation")}  # fmt: skip
        print(f"{name}: {shown}")
    keys = ("batch1_us_per_query", "batched_us_per_query", "batch1_us_per_query_min",
            "batched_us_per_query_min")  # fmt: skip
    widths = (12, 12, 14, 14)
    print(f"\n{'us/query':<18}{'batch-1':>12}{'batched':>12}{'batch-1 min':>14}{'batched min':>14}")
    for name, row in report["latency"].items():
        cells = (f"{row[key]:>{w}.1f}" for key, w in zip(keys, widths, strict=True))
        print(f"{name:<18}" + "".join(cells))
    for peer, speed in report["latency_speedup"].items():
        cells = (f"{speed[key]:>{w - 1}.2f}x" for key, w in zip(keys, widths, strict=True))
        print(f"{'DS vs ' + peer:<18}" + "".join(cells))
    kernel = "C kernel" if report["native_kernel"] else "PyTorch (no C compiler)"
    print(f"batch-1 DS and softmax_1x top-k ran through: {kernel}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=1))
    print_report(report)
    print(f"wrote {out / (args.name + '.json')}")
    return report
