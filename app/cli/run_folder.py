"""One run, one folder, described in TensorBoard: what the CLI sets in the loggers' config
before they are built, and the hyper-parameters that tell runs apart.

- ``validate``/``test``/``predict`` of a checkpoint written by a run
  (``<save_dir>/<name>/<version>/checkpoints/x.ckpt``) log into that run's folder; a
  checkpoint from elsewhere gets the folder ``eval-<checkpoint name>``. Loggers whose
  ``version`` is set keep it.
- ``fit --ckpt_path`` of a checkpoint written by a run in the loggers' own folder
  (``<save_dir>/<name>``) continues that run (its ``version``): its checkpoints
  (``ModelCheckpoint`` keeps its best-k record only in the folder that wrote it) and its
  curves, from the checkpoint's step on (TensorBoard hides what the stopped run logged after
  it: ``purge_step``; a CSV logger's earlier ``metrics.csv``, which it would delete, is kept
  as ``metrics.before_step_<N>.csv`` with the rows before that step). Loggers set to log
  elsewhere start a new run there, as before.
- ``--ckpt_path last`` / ``best`` name the newest run's ``last.ckpt`` / best checkpoint in the
  logger's folder (Lightning's own meaning, this process's earlier ``fit``, has nothing to
  find from the command line: ``last`` evaluated an untrained model with a warning).
- A resumed fit keeps the run folder's ``config.yaml`` (how the run started: what
  ``--config <run>/config.yaml`` reproduces and what the study runner, ``test`` and
  ``app.rank`` read) and writes its own invocation beside it, as
  ``config.resumed_at_step_<N>.yaml`` (its ``ckpt_path``, a changed ``max_epochs``), like the
  CSV logger's ``metrics.before_step_<N>.csv``; LightningCLI's callback overwrote it.
- TensorBoard writes every ``FLUSH_SECS`` (its own default, 120 s, leaves a fresh run blank
  for two minutes) and logs no placeholder ``hp_metric`` (``app.callbacks.RunRecord`` logs
  the real one).
"""

from __future__ import annotations

import csv
import importlib
import inspect
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from app.cli.errors import CommandLineError
from lightning_modules.checkpoint_file import best_checkpoint_state
from lightning_modules.errors import CheckpointPathError

FLUSH_SECS = 20
_SUMMARY_WRITER_FLUSH_SECS = 120  # torch's SummaryWriter default, which the config then holds
# files a logger writes in a run's folder
_RUN_FILES = ("hparams.yaml", "metrics.csv", "metrics.before_step_*.csv", "events.out.tfevents.*")
_LINKED = ("vocab_size", "src_vocab_size")


def checkpoint_run_dir(ckpt: str) -> Path | None:
    """The log folder of the run that wrote ``ckpt`` (``<run>/checkpoints/x.ckpt`` where a
    logger wrote ``<run>``), or None."""
    path = Path(ckpt).resolve()
    if path.parent.name != "checkpoints":
        return None
    run = path.parent.parent
    return run if any(any(run.glob(pattern)) for pattern in _RUN_FILES) else None


def _logger_configs(trainer: Namespace) -> list[Namespace]:
    loggers = trainer.get("logger")
    items = loggers if isinstance(loggers, list) else [loggers]
    return [item for item in items if isinstance(item, Namespace) and "init_args" in item]


def configure_loggers(trainer: Namespace, subcommand: str | None, ckpt: Any) -> None:
    """Set the TensorBoard options and the run folder (module docstring) in ``trainer``'s
    logger configs, in place."""
    loggers = _logger_configs(trainer)
    for logger in loggers:
        if logger.class_path.endswith("TensorBoardLogger"):
            logger.init_args.default_hp_metric = False
            if logger.init_args.get("flush_secs", _SUMMARY_WRITER_FLUSH_SECS) == (
                _SUMMARY_WRITER_FLUSH_SECS
            ):
                logger.init_args.flush_secs = FLUSH_SECS
    if subcommand is None or not isinstance(ckpt, str) or not Path(ckpt).is_file():
        return
    unset = [logger.init_args for logger in loggers if logger.init_args.get("version") is None]
    run = checkpoint_run_dir(ckpt)
    if subcommand == "fit":
        if run is not None and unset:
            continue_run(loggers, unset, run, ckpt)
        return
    for index, args in enumerate(unset):
        if run is None:
            args.version = f"eval-{Path(ckpt).stem}"
            continue
        args.version = run.name
        if index == 0 and loggers[0].init_args is args:  # the one ModelCheckpoint follows
            args.save_dir, args.name = str(run.parent.parent), run.parent.name


def continue_run(loggers: list[Namespace], unset: list[Namespace], run: Path, ckpt: str) -> None:
    """A fit resumed from ``ckpt``, written in the run folder ``run``, logs and checkpoints
    there (module docstring): the loggers without a ``version`` (``unset``, their
    ``init_args``) whose folder holds ``run`` take its version; the first one (which
    ``ModelCheckpoint`` follows) names its folder as the run's ``ModelCheckpoint`` recorded
    it (it compares the path's text: ``logs/ptb/...`` is not ``/home/.../logs/ptb/...``)."""
    same = [args for args in unset if _runs_folder(args).resolve() == run.parent.resolve()]
    if not same:
        return
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False, mmap=True)
    step = int(checkpoint.get("global_step", 0))
    recorded = _recorded_checkpoint_dir(checkpoint, run)
    for logger in loggers:
        args = logger.init_args
        if not any(args is continued for continued in same):
            continue
        args.version = run.name
        if args is loggers[0].init_args and recorded is not None:
            names = recorded.parent.parent  # <save_dir>/<name>/<version>/checkpoints
            args.save_dir, args.name = str(names.parent), names.name
        folder = _runs_folder(args) / run.name
        if logger.class_path.endswith("TensorBoardLogger"):
            args.purge_step = step  # what the stopped run logged after ckpt
        elif logger.class_path.endswith("CSVLogger") and rank_zero_only.rank == 0:
            _keep_csv_metrics(folder, step)
        # continuing a folder on purpose: Lightning's warnings that it is not empty (and,
        # for a CSV logger, that its files will be deleted) are not news here
        for message in (f"Checkpoint directory {folder}", f"Experiment logs directory {folder}"):
            warnings.filterwarnings("ignore", message=re.escape(message) + r"\b.* not empty")
    rank_zero_info(f"fit continues the run in {run} from step {step} (--ckpt_path {ckpt})")


CONFIG = "config.yaml"  # LightningCLI's name for a run's config


def resumed_config_name(ckpt: Any) -> str:
    """The name a fit resumed from ``ckpt`` gives its config beside the run's ``config.yaml``:
    ``config.resumed_at_step_<N>.yaml``, N the checkpoint's step (where the stopped run's
    record ends, as in ``metrics.before_step_<N>.csv``); ``config.resumed.yaml`` for a
    checkpoint that cannot be read here (a remote one)."""
    try:
        saved = torch.load(str(ckpt), map_location="cpu", weights_only=True, mmap=True)
        return f"config.resumed_at_step_{int(saved['global_step'])}.yaml"
    except Exception:  # noqa: BLE001 (what Lightning makes of the path is its own business)
        return "config.resumed.yaml"


class RunConfigCallback(SaveConfigCallback):
    """LightningCLI's ``SaveConfigCallback``, which leaves a run folder's ``config.yaml`` to
    the fit that started the run: a fit resumed there (``--ckpt_path``, in the folder it
    continues or one whose logger ``version`` is given) writes its config as
    :func:`resumed_config_name` says (module docstring)."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not self.already_saved and self.save_to_log_dir and stage == "fit":
            # (the fit's --ckpt_path, "last" resolved: trainer.ckpt_path is set after setup)
            # (every rank: trainer.log_dir and broadcast are collective calls under DDP)
            log_dir = trainer.log_dir
            name, ckpt = self.config_filename, self.config.get("ckpt_path")
            if name == CONFIG and ckpt is not None and trainer.is_global_zero:
                if (Path(log_dir or ".") / CONFIG).is_file():
                    name = resumed_config_name(ckpt)
            self.config_filename = trainer.strategy.broadcast(name)
        super().setup(trainer, pl_module, stage)


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a file, a folder or a broken link)."""
    path = path.absolute()
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def _write_problem(folder: Path) -> str | None:
    """Why the folders a run writes under ``folder`` could not be created, or None: the
    nearest existing ancestor is a file, or creating a folder in it fails (read-only file
    system, no permission; probed by creating and removing an empty folder, since
    ``os.access`` says yes to root on a folder it cannot write to)."""
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        return f"{str(existing)!r} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=existing))
    except OSError as exc:
        return f"cannot create a folder in {str(existing)!r} ({exc.strerror})"
    return None


def check_log_folders(trainer: Namespace) -> None:
    """Refuse, in one line, a logger ``save_dir`` (or, without a logger, a
    ``default_root_dir``) that the run could not write its logs, config and checkpoints under:
    Lightning found out at setup, after the data was prepared, with an ``OSError``
    traceback."""
    loggers = _logger_configs(trainer)
    folders = [
        (f"trainer.logger{'' if len(loggers) == 1 else f'[{i}]'}.init_args.save_dir", args)
        for i, logger in enumerate(loggers)
        if (args := logger.init_args.get("save_dir")) is not None
    ]
    if not loggers and trainer.get("default_root_dir") is not None:
        folders = [("trainer.default_root_dir", trainer.default_root_dir)]
    for key, folder in folders:
        if "://" in str(folder):  # remote storage (s3://...): its own client reports
            continue
        problem = _write_problem(Path(str(folder)))
        if problem is not None:
            raise CommandLineError(
                f"{key} {str(folder)!r}: {problem}; give a folder the run can write its logs "
                f"and checkpoints in"
            )


def _runs_folder(args: Namespace) -> Path:
    """``<save_dir>/<name>`` of a logger's ``init_args``: where its ``version_N`` runs are."""
    return Path(args.get("save_dir") or ".") / str(args.get("name") or "lightning_logs")


def _recorded_checkpoint_dir(checkpoint: dict[str, Any], run: Path) -> Path | None:
    """The ``dirpath`` a ``ModelCheckpoint`` of the checkpoint's run recorded, as written,
    where it is ``run``'s ``checkpoints`` folder, else None."""
    for key, state in (checkpoint.get("callbacks") or {}).items():
        dirpath = state.get("dirpath") if key.startswith("ModelCheckpoint") else None
        if isinstance(dirpath, str) and Path(dirpath).resolve() == (run / "checkpoints").resolve():
            return Path(dirpath)
    return None


def _keep_csv_metrics(folder: Path, step: int) -> None:
    """Lightning's CSV logger deletes the ``metrics.csv`` of a folder it starts in: the rows
    logged before ``step`` are kept beside it, in ``metrics.before_step_<step>.csv``."""
    metrics = folder / "metrics.csv"
    if not metrics.is_file():
        return
    with metrics.open(newline="") as file:
        reader = csv.DictReader(file)
        rows = [row for row in reader if not row.get("step") or int(row["step"]) < step]
        fields = list(reader.fieldnames or [])
    kept = folder / f"metrics.before_step_{step}.csv"
    if kept.is_file():  # resumed from this step before: the rows kept then come first
        with kept.open(newline="") as file:
            reader = csv.DictReader(file)
            rows = [*reader, *rows]
            fields += [name for name in reader.fieldnames or [] if name not in fields]
    if rows:
        with kept.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    metrics.unlink()


def _version_number(run: Path) -> int:
    match = re.fullmatch(r"version_(\d+)", run.name)
    return int(match.group(1)) if match else -1


def runs_folder(trainer: Namespace) -> Path:
    """``<save_dir>/<name>`` of the first logger: where its ``version_N`` runs are."""
    return _runs_folder(_logger_configs(trainer)[0].init_args)


def newest_checkpoint(runs: list[Path]) -> Path | None:
    """The most recently written ``checkpoints/*.ckpt`` of ``runs``, else None."""
    files = [
        path for run in runs for path in (run / "checkpoints").glob("*.ckpt") if path.is_file()
    ]
    return max(files, key=lambda path: path.stat().st_mtime, default=None)


def run_checkpoint(alias: str, trainer: Namespace, missing_ok: bool = False) -> Path | None:
    """The checkpoint ``--ckpt_path last|best`` means: in the first logger's folder
    (``<save_dir>/<name>``), the run of its ``version`` if set, else the newest
    ``version_N`` that has a ``checkpoints/last.ckpt``; ``best`` is the best checkpoint that
    run's ``ModelCheckpoint`` kept (as recorded in its ``last.ckpt``). With ``missing_ok``,
    None where no run has one yet (a job script's first ``fit --ckpt_path last``). Runs whose
    checkpoints hold no ``last.ckpt`` (no ``save_last``) are refused, naming their newest file:
    a job requeued with ``last`` would otherwise start afresh every time."""
    loggers = _logger_configs(trainer)
    if not loggers:
        raise CheckpointPathError(
            f"ckpt_path {alias!r} is looked up in the logger's run folders, and this run has no "
            f"logger: give the checkpoint file, e.g. --ckpt_path logs/ptb/version_0/checkpoints/"
            f"last.ckpt"
        )
    args = loggers[0].init_args
    folder = runs_folder(trainer)
    version = args.get("version")
    if version is not None:
        runs = [folder / (version if isinstance(version, str) else f"version_{version}")]
    else:
        runs = sorted(folder.glob("version_*"), key=_version_number, reverse=True)
    with_last = [run for run in runs if (run / "checkpoints" / "last.ckpt").is_file()]
    if not with_last:
        other = newest_checkpoint(runs)
        if other is not None:  # a ModelCheckpoint without save_last: `last` can never be there
            raise CheckpointPathError(
                f"ckpt_path {alias!r}: no run in {folder} has checkpoints/last.ckpt, but "
                f"{other} is there (the run's ModelCheckpoint keeps no last.ckpt: save_last: "
                f"true does); give that file as --ckpt_path"
            )
        if missing_ok:
            return None
        raise CheckpointPathError(
            f"ckpt_path {alias!r}: no run in {folder} has checkpoints/last.ckpt; fit first, or "
            f"give the checkpoint file"
        )
    runs = with_last
    last = runs[0] / "checkpoints" / "last.ckpt"
    if alias == "last":
        return last
    # mmap: only the callbacks' state is read, not the weights
    state = best_checkpoint_state(
        torch.load(last, map_location="cpu", weights_only=False, mmap=True)
    )
    if state is None:
        raise CheckpointPathError(
            f"ckpt_path 'best': the run {runs[0]} recorded no best checkpoint (no validation "
            f"yet?); use --ckpt_path last or give the checkpoint file"
        )
    recorded = Path(state["best_model_path"])
    # the file beside last.ckpt first: in a run folder copied or moved (from a cluster to a
    # laptop) the recorded path is the original's, gone or another run's
    for best in (last.parent / recorded.name, recorded):
        if best.is_file():
            return best
    raise CheckpointPathError(
        f"ckpt_path 'best': the run {runs[0]} recorded {str(recorded)!r} as its best checkpoint, "
        f"and neither it nor {recorded.name} beside last.ckpt is there; give the checkpoint file"
    )


# -- hyper-parameters -------------------------------------------------------------------------
def _short(class_path: str) -> str:
    return class_path.rpartition(".")[2]


def _defaults(class_path: str) -> dict[str, Any]:
    module, _, name = class_path.rpartition(".")
    try:
        parameters = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}
    return {k: p.default for k, p in parameters.items() if p.default is not inspect.Parameter.empty}


def _plain(value: Any) -> Any:
    return value.as_dict() if isinstance(value, Namespace) else value


def _part(config: Any, changed_only: bool) -> dict[str, Any] | None:
    """``{"class": name, **options}`` of a ``class_path``/``init_args`` config; with
    ``changed_only``, the options set away from the class's defaults (and ``lr``)."""
    if not isinstance(config, Namespace) or "class_path" not in config:
        return None
    options = {
        k: _plain(v)
        for k, v in vars(config.get("init_args") or Namespace()).items()
        if k not in _LINKED  # linked from the data module when built: RunRecord logs them
    }
    if changed_only:
        defaults = _defaults(config.class_path)
        options = {
            k: v for k, v in options.items() if k == "lr" or k not in defaults or defaults[k] != v
        }
    return {"class": _short(config.class_path), **options}


def run_hparams(config: Namespace) -> dict[str, Any]:
    """What tells runs apart, from a run's parsed config: the model's class, its head and
    backbone (class and every option), optimizer and scheduler (class, learning rate and the
    options set), seed and trainer settings. Nested: the loggers flatten it (``head/class``,
    ``optimizer/lr``); the data's options are logged by Lightning beside it."""
    model = config.get("model")
    params: dict[str, Any] = {}
    if isinstance(model, Namespace) and "class_path" in model:
        params["model"] = _short(model.class_path)
        init_args = model.get("init_args") or Namespace()
        for name, changed_only in (
            ("head", False),
            ("backbone", False),
            ("optimizer", True),
            ("scheduler", True),
        ):
            part = _part(init_args.get(name), changed_only)
            if part is not None:
                params[name] = part
    trainer = config.get("trainer") or Namespace()
    params["trainer"] = {
        key: _plain(trainer.get(key))
        for key in ("precision", "gradient_clip_val", "accumulate_grad_batches", "max_epochs")
    }
    params["seed"] = config.get("seed_everything")
    return params
