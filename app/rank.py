"""Softmax-bottleneck diagnostic: the singular values and numerical rank of a trained head's
log-probability matrix over N held-out contexts (Yang et al. 2018, "Breaking the softmax
bottleneck"; mos-hybrid-lightrnn-bpe.txt, "Softmax Bottleneck").

``A[i, j] = log P(x_j | c_i)`` for N contexts of the validation (or test) split. A row shift
does not change the distribution, so each row is centred (its mean over the vocabulary
subtracted) before the SVD. A softmax over ``d``-dimensional inputs gives
``A_c = H (W - mean W)^T + (b - mean b)``, of rank at most ``d + 1``; MoS and Mixtape are not
bound by ``d``. The matrix is computed in float64 (the head cast to float64 on the captured
contexts), so the numerical rank uses NumPy's tolerance ``sigma_max * max(N, V) * eps``.

    python -m app.rank --config runs/.../tensorboard/fit/config.yaml --ckpt best.ckpt \\
        --contexts 2000 --out runs/rank/mixtape [--split val] [--trainer.limit_val_batches 50]

Writes ``rank.json`` (the spectrum) and ``spectrum.png`` into ``--out``; any other
``--key value`` goes to the CLI as an override of the config.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from heads import IGNORE_INDEX, Head
from lightning_modules.decoding import DecodeConfig

SCHEMA = "rank/1"
RELATIVE = (1e-2, 1e-4, 1e-6)


@dataclass
class RankReport:
    """The spectrum of the row-centred log-probability matrix ``[contexts, vocab_size]``."""

    rank: int
    tolerance: float
    contexts: int
    vocab_size: int
    hidden_size: int
    singular_values: list[float]
    head: str = ""
    label: str = ""
    split: str = "val"
    checkpoint: str | None = None
    config: list[str] = field(default_factory=list)

    @property
    def softmax_bound(self) -> int:
        """The most a single softmax over the head's ``hidden_size`` inputs can reach."""
        return self.hidden_size + 1

    def relative_ranks(self, thresholds: Sequence[float] = RELATIVE) -> dict[str, int]:
        """Singular values above ``t * sigma_1`` for each ``t``: how much of the rank carries
        weight (the float64 rank also counts directions a million times weaker)."""
        values = torch.tensor(self.singular_values)
        top = float(values[0]) if values.numel() else 0.0
        return {f"{t:.0e}": int((values > t * top).sum()) for t in thresholds}

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            **asdict(self),
            "softmax_bound": self.softmax_bound,
            "relative_ranks": self.relative_ranks(),
        }


def centred_spectrum(log_probs: torch.Tensor) -> torch.Tensor:
    """Singular values (float64, descending) of ``log_probs`` with each row's mean removed."""
    matrix = log_probs.to(torch.float64)
    matrix = matrix - matrix.mean(dim=1, keepdim=True)
    return torch.linalg.svdvals(matrix)


def numerical_rank(
    singular_values: torch.Tensor, shape: Sequence[int], tolerance: float | None = None
) -> tuple[int, float]:
    """Singular values above ``tolerance`` (default NumPy's ``sigma_max * max(shape) * eps``
    for float64), and the tolerance used."""
    if tolerance is None:
        top = float(singular_values.max()) if singular_values.numel() else 0.0
        tolerance = top * max(shape) * torch.finfo(torch.float64).eps
    return int((singular_values > tolerance).sum()), float(tolerance)


@torch.no_grad()
def head_rank(
    head: Head, hidden: torch.Tensor, tolerance: float | None = None, chunk: int = 1024
) -> RankReport:
    """The rank report of ``head`` on contexts ``hidden [N, hidden_size]``, in float64 (on a
    float64 copy of the head in evaluation mode, so the trained one is left as it is)."""
    exact = copy.deepcopy(head).to(device=hidden.device, dtype=torch.float64).eval()
    hidden = hidden.to(torch.float64)
    rows = [exact.log_prob(hidden[i : i + chunk]) for i in range(0, hidden.size(0), chunk)]
    log_probs = torch.cat(rows).cpu()
    values = centred_spectrum(log_probs)
    rank, tol = numerical_rank(values, log_probs.shape, tolerance)
    return RankReport(
        rank=rank,
        tolerance=tol,
        contexts=hidden.size(0),
        vocab_size=head.vocab_size,
        hidden_size=head.hidden_size,
        singular_values=values.tolist(),
        head=type(head).__name__,
    )


class ContextSampler:
    """Forward pre-hook on a head: keeps a uniform sample of ``size`` of the context vectors
    the head is given (rows whose target is ignored are skipped), whatever the number of
    batches, by keeping the rows with the ``size`` largest random priorities."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        self.generator = torch.Generator().manual_seed(seed)
        self.rows: torch.Tensor | None = None
        self.priorities = torch.empty(0)
        self.seen = 0

    def __call__(self, module: Head, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden"]
        target = args[1] if len(args) > 1 else kwargs.get("target")
        rows = hidden.detach()
        if target is not None:
            rows = rows[target != IGNORE_INDEX]
        rows = rows.to("cpu", torch.float32)
        self.seen += rows.size(0)
        priorities = torch.rand(rows.size(0), generator=self.generator)
        if self.rows is not None:
            rows = torch.cat((self.rows, rows))
            priorities = torch.cat((self.priorities, priorities))
        keep = priorities.topk(min(self.size, priorities.numel())).indices.sort().values
        self.rows, self.priorities = rows[keep], priorities[keep]

    def sample(self) -> torch.Tensor:
        if self.rows is None:
            raise RuntimeError("no context reached the head")
        return self.rows


def collect_contexts(cli: Any, checkpoint: str, contexts: int, split: str, seed: int = 0):
    """Run the checkpoint's model over a split (Lightning's ``validate`` / ``test``, so the
    vocabulary and head are restored as for any evaluation) and sample its head's inputs."""
    model = cli.model
    if isinstance(getattr(model, "decode", None), DecodeConfig):
        # translation: teacher-forced contexts only
        model.decode = replace(model.decode, val_beam_size=0)
    sampler = ContextSampler(contexts, seed)
    handle = model.head.register_forward_pre_hook(sampler, with_kwargs=True)
    try:
        run = cli.trainer.validate if split == "val" else cli.trainer.test
        run(model, datamodule=cli.datamodule, ckpt_path=checkpoint, verbose=False)
    finally:
        handle.remove()
    return sampler.sample(), sampler.seen


def plot_spectra(reports: Sequence[RankReport], path: Path) -> None:
    """``sigma_i / sigma_1`` against i for each report (log scale), the softmax bound dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for index, report in enumerate(reports):
        values = torch.tensor(report.singular_values)
        top = float(values[0]) if values.numel() and values[0] > 0 else 1.0
        label = f"{report.label or report.head}: rank {report.rank}"
        ax.semilogy(
            range(1, values.numel() + 1),
            (values / top).clamp_min(1e-18),
            color=f"C{index}",
            label=label,
        )
        ax.axvline(report.softmax_bound, color=f"C{index}", linestyle="--", alpha=0.5)
    ax.set_xlabel("index i")
    ax.set_ylabel("sigma_i / sigma_1 (row-centred log-probabilities)")
    ax.set_title("log-probability spectrum (dashed: softmax bound d + 1)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.rank",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        action="append",
        required=True,
        help="the run's config (its saved config.yaml, or shipped configs)",
    )
    parser.add_argument("--ckpt", required=True, help="the trained checkpoint")
    parser.add_argument("--contexts", type=int, default=2000, help="N held-out contexts")
    parser.add_argument("--split", choices=("val", "test"), default="val")
    parser.add_argument("--out", required=True, help="folder for rank.json and spectrum.png")
    parser.add_argument("--label", default="", help="name in the plot and JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed of the context sample")
    parser.add_argument("--tol", type=float, default=None, help="rank tolerance (absolute)")
    return parser


def main(argv: Sequence[str] | None = None) -> RankReport:
    from app.cli.lightning_cli import build
    from lightning_modules.errors import CheckpointPathError

    args, overrides = _parser().parse_known_args(argv)
    if not Path(args.ckpt).is_file():
        raise CheckpointPathError(f"--ckpt {args.ckpt!r} does not exist or is not a file")
    if args.contexts < 2:
        raise SystemExit("--contexts must be at least 2")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quiet = [
        "--trainer.logger",
        "false",
        "--trainer.callbacks",
        "null",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.enable_model_summary",
        "false",
        "--trainer.devices",
        "1",
        "--trainer.strategy",
        "auto",
        "--trainer.num_nodes",
        "1",
        "--trainer.default_root_dir",
        str(out),
    ]
    cli = build(args.config, [*quiet, *overrides])
    hidden, seen = collect_contexts(cli, args.ckpt, args.contexts, args.split, args.seed)
    report = head_rank(cli.model.head, hidden, args.tol)
    report.label, report.split = args.label, args.split
    report.checkpoint, report.config = str(args.ckpt), list(args.config)
    (out / "rank.json").write_text(json.dumps(report.to_json(), indent=1))
    plot_spectra([report], out / "spectrum.png")
    print(
        f"{report.label or report.head}: numerical rank {report.rank} of "
        f"{report.contexts} contexts (sampled from {seen}) x {report.vocab_size} classes; a "
        f"softmax over d = {report.hidden_size} reaches at most {report.softmax_bound}; "
        f"tolerance {report.tolerance:.3g}; above 1e-2/1e-4/1e-6 of the largest: "
        f"{'/'.join(map(str, report.relative_ranks().values()))}; wrote {out / 'rank.json'}"
    )
    return report


def console_main(argv: Sequence[str] | None = None) -> int:
    from app.cli.console import exit_status, quiet_lightning, show_app_log

    quiet_lightning()
    show_app_log()
    # the callbacks are left out on purpose: only the head's inputs are wanted
    warnings.filterwarnings("ignore", ".*callbacks used to create the checkpoint need to be.*")
    return exit_status(lambda: main(argv))


if __name__ == "__main__":
    sys.exit(console_main())
