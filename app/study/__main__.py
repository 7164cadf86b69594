"""``python -m app.study run|status|render|check``: the experiment runner's command line.

python -m app.study run configs/studies/ptb_medium_gpu.yaml --parallel 3
python -m app.study status configs/studies/ptb_medium_gpu.yaml
python -m app.study render runs/studies/ptb_medium_gpu/study.json --images docs/results
python -m app.study check configs/studies/*.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from app.cli.console import exit_status
from app.study.grid import Grid, load_grid
from app.study.preflight import check_grid
from app.study.report import render_markdown
from app.study.runner import StudyInterrupted, run_study, study_status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m app.study",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a grid (finished runs are skipped)")
    run.add_argument("grid", help="a study grid YAML (configs/studies/*.yaml)")
    run.add_argument("--out", default="runs/studies", help="runs go to OUT/<study name>/")
    run.add_argument("--parallel", type=int, default=1, help="runs at once")
    run.add_argument(
        "--devices",
        default=None,
        help="CUDA device ids to spread runs over, e.g. 0,1 (default: all; "
        "'none' runs without pinning)",
    )
    run.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of each run (CPU runs side by side)",
    )
    run.add_argument(
        "--rerun-failed",
        action="store_true",
        help="run again the runs that failed (not the diverged ones)",
    )
    run.add_argument(
        "--skip-check",
        action="store_true",
        help="start without first parsing every cell's command (see `check`)",
    )
    run.add_argument("--json", default=None, help="also copy the study JSON here")
    run.add_argument(
        "--images",
        default=None,
        help="render the report: PNGs here, markdown beside the study JSON",
    )
    render = commands.add_parser("render", help="markdown + PNGs of a study JSON")
    render.add_argument("study_json")
    render.add_argument("--images", default=None, help="PNG folder (default: beside the JSON)")
    render.add_argument(
        "--link-prefix",
        default=None,
        help="prefix of the image links (default: the way from --markdown's folder to the PNGs)",
    )
    render.add_argument("--markdown", default=None, help="write the markdown here (else print)")
    status = commands.add_parser(
        "status", help="what a study's folder holds: each run's state, counts, time left"
    )
    status.add_argument("grid", help="the study grid YAML the runs were run from")
    status.add_argument("--out", default="runs/studies", help="the run command's --out")
    check = commands.add_parser(
        "check",
        help="validate grid files and parse every cell's cli.py fit command (no data, no "
        "training): one line per bad cell, exit status 2",
    )
    check.add_argument("grids", nargs="+")
    return parser


def _link_prefix(images: str | Path, markdown: Path) -> str:
    """What the image links of ``markdown`` start with: the way from its folder to ``images``
    (``""`` where they are one folder)."""
    way = Path(os.path.relpath(Path(images).resolve(), markdown.parent.resolve())).as_posix()
    return "" if way == "." else f"{way}/"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return exit_status(lambda: _command(args))


def _bad_cells(grid: Grid) -> list[str]:
    """The grid's cells whose command the CLI refuses, each said on stderr as found."""
    return check_grid(
        grid,
        echo=lambda line: print(line, flush=True),
        report=lambda line: print(line, file=sys.stderr, flush=True),
    )


def _command(args: argparse.Namespace) -> int:
    if args.command == "check":
        grids = [(path, load_grid(path)) for path in args.grids]  # every file's structure first
        bad = []
        for path, grid in grids:
            print(
                f"{path}: {len(grid.runs())} runs ({len(grid.heads)} heads x "
                f"{max(1, len(grid.variants))} variants x {len(grid.seeds)} seeds)"
            )
            bad += _bad_cells(grid)
        return 2 if bad else 0
    if args.command == "status":
        print("\n".join(study_status(load_grid(args.grid), Path(args.out))))
        return 0
    if args.command == "run":
        grid = load_grid(args.grid)
        # a bad override in one cell: found now, not when that cell comes up days later
        if not args.skip_check and _bad_cells(grid):
            print(
                "error: the cells above would fail; nothing was started (fix them, or "
                "--skip-check)",
                file=sys.stderr,
            )
            return 2
        devices = None
        if args.devices is not None:
            devices = [] if args.devices == "none" else args.devices.split(",")
        try:
            study = run_study(
                grid, Path(args.out), args.parallel, devices, args.threads, args.rerun_failed
            )
        except StudyInterrupted as stopped:
            print(f"interrupted: {stopped}", file=sys.stderr)
            return 128 + stopped.signum
        study_json = Path(args.out) / grid.name / "study.json"
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(study_json, args.json)
        if args.images:
            report = study_json.parent / "report.md"
            markdown = render_markdown(study, args.images, _link_prefix(args.images, report))
            report.write_text(markdown)
            print(markdown)
        bad = [r for r in study["runs"] if r["status"] != "ok"]
        return 1 if any(r["status"] == "failed" for r in bad) else 0
    study = json.loads(Path(args.study_json).read_text())
    images = args.images or str(Path(args.study_json).parent)
    prefix = args.link_prefix
    if prefix is None:
        prefix = _link_prefix(images, Path(args.markdown)) if args.markdown else ""
    markdown = render_markdown(study, images, prefix)
    if args.markdown:
        Path(args.markdown).write_text(markdown)
    else:
        print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
