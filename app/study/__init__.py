"""The experiment runner: heads x variants x seeds through the CLI, results as JSON, a report
(``python -m app.study``; grid files in ``configs/studies/``)."""

from app.study.grid import Grid, RunSpec, StudyConfigError, load_grid, parse_grid
from app.study.report import render_markdown, summarize
from app.study.runner import run_study

__all__ = [
    "Grid",
    "RunSpec",
    "StudyConfigError",
    "load_grid",
    "parse_grid",
    "render_markdown",
    "run_study",
    "summarize",
]
