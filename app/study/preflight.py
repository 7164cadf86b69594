"""Every cell of a grid through the CLI's parser before anything runs: a typo'd option, a
wrong class path or a value the CLI or the data module refuses in one cell was found only when
that cell's fit started, maybe days into the study.

A cell is a (head, variant) of the grid: its seeds run the same command but for
``--seed_everything``, so each is parsed once (and its fine-tuning stage's configs over it).
Parsing is :class:`app.cli.lightning_cli.AppCLI` on the runner's own ``fit`` arguments with
the CLI's checks before instantiation (task and data, trainer options, the model's optimizer),
then the data module and the model built as the CLI builds them but on the meta device and with
stand-in vocabulary sizes (the real one needs the data prepared), so the constructors' checks
of their options run; the trainer is not built (a GPU grid is checked on a machine without
one). About 0.5 s a cell after the imports.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

from app.study.grid import Grid, RunSpec, fit_extra_args, override_args

if TYPE_CHECKING:
    from jsonargparse import Namespace


def fit_args(grid: Grid, run: RunSpec) -> list[str]:
    """The options of a run's ``cli.py fit`` that the grid sets (configs, head, overrides),
    as :func:`app.study.runner.execute_run` passes them."""
    configs = [a for config in grid.run_base(run) for a in ("--config", config)]
    return configs + fit_extra_args(grid, run)


def cells(grid: Grid) -> list[tuple[str, list[str]]]:
    """``(cell name, fit arguments)`` for each distinct command of the grid (seeds aside),
    and each fine-tuning stage's arguments over it."""
    found: dict[str, tuple[str, list[str]]] = {}
    for run in grid.runs():
        args = fit_args(grid, run)
        stages = [(run.label, args)]
        if grid.finetune is not None:  # (the fit's saved config stands for the fit above)
            stage = [a for c in grid.finetune["configs"] for a in ("--config", c)]
            stage += override_args(grid.finetune["overrides"])
            stages.append((f"{run.label} (finetune)", args + stage))
        for name, stage_args in stages:
            found.setdefault(json.dumps(stage_args), (name, stage_args))
    return list(found.values())


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


# two vocabulary sizes the model is built with in place of the data's (unknown before the data
# is prepared): an error both give does not depend on the size; one that one alone gives
# (adaptive cut-offs above a small one) is the data's to decide, and is not reported
STAND_IN_VOCAB_SIZES = (10, 1_000_000)


def _model_error(parser: Any, config: Namespace) -> str | None:
    """The user error the CLI's model (and data module) would raise when built, where it does
    not depend on the vocabulary size: built twice, on the meta device (no memory, no data),
    with the data module's vocabulary sizes stood in by :data:`STAND_IN_VOCAB_SIZES`."""
    import torch  # (here: `status` and `render` need none of this)

    from app.cli.console import error_line
    from heads.errors import UserError
    from lightning_modules.checkpoint_file import check_checkpoint_file

    config = config.clone()
    init_args = config.model.get("init_args") if config.get("model") else None
    if init_args is not None and init_args.get("pretrained_checkpoint") is not None:
        try:  # the file must be there now; read into meta tensors, its weights say nothing
            check_checkpoint_file(init_args.pretrained_checkpoint, "model.pretrained_checkpoint")
        except UserError as error:
            return str(error)
        init_args.pretrained_checkpoint = None
    data_class = _import(config.data.class_path) if config.get("data") else None
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    said = []
    for size in STAND_IN_VOCAB_SIZES:
        with contextlib.ExitStack() as stack:
            for name in ("vocab_size", "src_vocab_size"):  # what the CLI links into the model
                if isinstance(getattr(data_class, name, None), property):
                    stand_in = property(lambda self, size=size: size)
                    stack.enter_context(mock.patch.object(data_class, name, stand_in))
            stack.enter_context(torch.device("meta"))
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            try:  # the classes of the config (data, model), not the trainer (a GPU's options)
                instantiate(config, instantiate_groups=False)
            except Exception as error:
                said.append(error_line(error))  # None: not a user error (the meta device's?)
            else:
                return None
    return said[0] if said[0] is not None and said[0] == said[1] else None


def check_args(args: list[str], log_dir: Path) -> str | None:
    """The CLI's ``error:`` line for ``cli.py fit ARGS`` (logs under ``log_dir``), or None:
    the options parsed, the CLI's checks before it builds anything, the data module and the
    model built as far as they can be without the data (:func:`_model_error`)."""
    from app.cli.console import error_line
    from app.cli.errors import OneLineErrorParser, check_config_files, check_linked_options
    from app.cli.lightning_cli import AppCLI

    class ParseOnly(AppCLI):
        def instantiate_classes(self) -> None:
            self.model_error = _model_error(self._parser("fit"), self.config["fit"])

        def _run_subcommand(self, subcommand: str) -> None:
            pass

    loggers = {"class_path": "lightning.pytorch.loggers.CSVLogger",
               "init_args": {"save_dir": str(log_dir)}}  # fmt: skip
    full = ["fit", *args, "--trainer.logger", json.dumps(loggers), "--ckpt_path", "null"]
    full += ["--seed_everything", "false"]  # (the seed's own line said nothing of the cell)
    printed = io.StringIO()
    try:
        quiet = contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed)
        with warnings.catch_warnings(), quiet[0], quiet[1]:
            warnings.filterwarnings("ignore", ".*args parameter is intended to run from within.*")
            check_config_files(full)
            check_linked_options(full)
            cli = ParseOnly(
                subclass_mode_model=True,
                subclass_mode_data=True,
                save_config_kwargs={"overwrite": True},
                args=full,
                run=True,
                parser_class=OneLineErrorParser,
            )
    except SystemExit as stop:  # (a parser that exits: its message is in what it printed)
        said = [line for line in printed.getvalue().splitlines() if line.strip()]
        return (said[-1] if said else f"exit status {stop.code}").removeprefix("error: ")
    except Exception as error:
        line = error_line(error)
        return line if line is not None else f"{type(error).__name__}: {error}"
    return cli.model_error


def check_grid(
    grid: Grid, echo: Callable[[str], None] = print, report: Callable[[str], None] | None = None
) -> list[str]:
    """One line per bad cell of ``grid`` (``<grid name> <cell>: error: <the CLI's line>``),
    each given to ``report`` (default ``echo``) as found, after a progress line to ``echo``;
    nothing is written outside a temporary folder."""
    report = echo if report is None else report
    todo = cells(grid)
    echo(f"{grid.name}: checking the cli.py fit command of {len(todo)} head x variant "
         f"cell{'s' if len(todo) != 1 else ''} (a cell's seeds share it)")  # fmt: skip
    bad = []
    with tempfile.TemporaryDirectory(prefix="study-check-") as log_dir:
        for name, args in todo:
            problem = check_args(args, Path(log_dir))
            if problem is not None:
                bad.append(f"{grid.name} {name}: error: {problem}")
                report(bad[-1])
    return bad
