"""One run, one folder, described in TensorBoard: what the CLI sets in the loggers' config
before they are built, and the hyper-parameters that tell runs apart.

- ``validate``/``test``/``predict`` of a checkpoint written by a run
  (``<save_dir>/<name>/<version>/checkpoints/x.ckpt``) log into that run's folder; a
  checkpoint from elsewhere gets the folder ``eval-<checkpoint name>``. Loggers whose
  ``version`` is set keep it.
- TensorBoard writes every ``FLUSH_SECS`` (its own default, 120 s, leaves a fresh run blank
  for two minutes) and logs no placeholder ``hp_metric`` (``app.callbacks.RunRecord`` logs
  the real one).
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from jsonargparse import Namespace

FLUSH_SECS = 20
_SUMMARY_WRITER_FLUSH_SECS = 120  # torch's SummaryWriter default, which the config then holds
# files a logger writes in a run's folder
_RUN_FILES = ("hparams.yaml", "metrics.csv", "events.out.tfevents.*")
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
    if subcommand in (None, "fit") or not isinstance(ckpt, str) or not Path(ckpt).is_file():
        return
    unset = [logger.init_args for logger in loggers if logger.init_args.get("version") is None]
    run = checkpoint_run_dir(ckpt)
    for index, args in enumerate(unset):
        if run is None:
            args.version = f"eval-{Path(ckpt).stem}"
            continue
        args.version = run.name
        if index == 0 and loggers[0].init_args is args:  # the one ModelCheckpoint follows
            args.save_dir, args.name = str(run.parent.parent), run.parent.name


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
