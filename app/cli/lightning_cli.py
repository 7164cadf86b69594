"""The application's LightningCLI: how configs become a model, a data module and a trainer.

``cli.py`` runs it for users; the benchmark and the experiment runner build models with it
too (:func:`build`), so a config means the same thing everywhere.

Sizes are stated once: the data module's vocabulary size is linked into the backbone and the
head (and a translation data module's ``src_vocab_size`` into the encoder), and the backbone's
output size into ``head.hidden_size``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import (
    BasePredictionWriter,
    Checkpoint,
    LearningRateMonitor,
    ProgressBar,
)
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from app.callbacks.training.prediction_writer import PredictionWriter
from app.callbacks.training.preemption import PreemptionCheckpoint
from app.callbacks.training.progress import interval_progress_bar
from app.callbacks.training.run_record import RunRecord
from app.cli.errors import (
    CommandLineError,
    OneLineErrorParser,
    check_config_files,
    check_linked_options,
    warn_line,
)
from app.cli.run_folder import (
    RunConfigCallback,
    check_log_folders,
    configure_loggers,
    run_checkpoint,
    run_hparams,
    runs_folder,
)
from lightning_modules.backbones.base import configured_output_size
from lightning_modules.checkpoint_file import check_checkpoint_file
from lightning_modules.errors import ModelConfigError
from lightning_modules.module_configs import (
    MODULE_CONFIGS_KEY,
    MODULES,
    compare_module_configs,
)
from lightning_modules.module_configs import (
    command_line_text as _yaml,
)
from lightning_modules.module_configs import (
    plain_value as _plain,
)
from lightning_modules.optimization import check_scheduler_interval

DESCRIPTION = (
    "Language models and translation with swappable output layers (heads). A run is a setting "
    "from configs/lm, configs/mt or configs/ds, a head from configs/heads in one option, and "
    "presets from configs/presets, e.g. `python cli.py fit --config configs/lm/ptb.yaml "
    "--model.head configs/heads/mixtape.yaml`; README.md lists them all."
)
# the app's INFO lines (app.cli.console.show_app_log prints them)
log = logging.getLogger("lightning_modules.module_configs")
# Lightning's own checkpoint names, not paths
_CKPT_ALIASES = ("last", "best", "hpc")


def backbone_output_size(backbone: Namespace) -> int:
    """``head.hidden_size`` from the backbone's config (``class_path`` + ``init_args``)."""
    module, _, name = backbone.class_path.rpartition(".")
    backbone_class = getattr(importlib.import_module(module), name)
    return configured_output_size(backbone_class, vars(backbone.init_args))


def _remote(ckpt: str) -> bool:
    """A model registry or remote storage address, which Lightning resolves itself."""
    return ckpt.startswith("registry") or "://" in ckpt


def _default_progress_bar(trainer: Namespace, defaults: list) -> bool:
    """Whether the trainer would show Lightning's default progress bar: enabled, and no
    progress bar among its callbacks (given in the config or as defaults)."""
    if trainer.get("enable_progress_bar") is False:
        return False
    return not _has_callback(trainer, defaults, ProgressBar)


def _is_kind(callback: Any, kind: type) -> bool:
    """Whether ``callback`` (an object, or a ``class_path`` entry of a config) is a ``kind``."""
    if isinstance(callback, kind):
        return True
    path = callback.get("class_path", "") if isinstance(callback, (dict, Namespace)) else ""
    module, _, name = str(path).rpartition(".")
    return bool(module) and issubclass(getattr(importlib.import_module(module), name), kind)


def _has_callback(trainer: Namespace, defaults: list, kind: type) -> bool:
    """Whether a callback of ``kind`` is among the trainer's callbacks (given in the config,
    as objects or as ``class_path`` entries, or as defaults)."""
    given = trainer.get("callbacks") or []
    return any(
        _is_kind(callback, kind)
        for callback in [*(given if isinstance(given, list) else [given]), *defaults]
    )


def _drop_callbacks(trainer: Namespace, kind: type) -> None:
    """The trainer's given callbacks without those of ``kind``, in place."""
    given = trainer.get("callbacks")
    if isinstance(given, list):
        trainer.callbacks = [callback for callback in given if not _is_kind(callback, kind)]
    elif given is not None and _is_kind(given, kind):
        trainer.callbacks = None


def _predict_on_one_device(trainer: Namespace) -> str | None:
    """``predict`` prints each result once, in input order, from one process: more devices
    (``auto`` or ``-1`` on a multi-GPU machine, a DDP run's saved config) split the inputs
    across ranks, and only rank 0's were printed. Runs it on one device; what the setting
    asked for where that was more than one."""
    devices = trainer.get("devices", "auto")
    strategy = trainer.get("strategy", "auto")
    named = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", "")
    one = devices in (1, "1") or (isinstance(devices, (list, tuple)) and len(devices) == 1)
    nodes = trainer.get("num_nodes", 1)
    several = (not one and devices != "auto") or nodes != 1 or "ddp" in str(named).lower()
    asked = f"devices={devices}, num_nodes={nodes}, strategy={named}"
    if not one:
        trainer.devices = 1
    if several:
        trainer.num_nodes, trainer.strategy = 1, "auto"
    return asked if several else None


def _import_class(class_path: Any) -> type | None:
    module, _, name = str(class_path).rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if inspect.isclass(found) else None


def _related(one: type | None, other: type | None, one_path: str, other_path: str) -> bool:
    """Whether two classes (their paths where they do not import) are the same or one derives
    from the other."""
    if one is None or other is None:
        return one_path.rpartition(".")[2] == other_path.rpartition(".")[2]
    return issubclass(one, other) or issubclass(other, one)


def _task_data() -> dict[type, tuple[type, ...]]:
    """The data modules each task reads: another task's data fails deep inside the model (an
    LM reading sentence pairs, a translation without a source vocabulary)."""
    from datamodules import (
        LanguageModelingDataModule,
        MarkovChainDataModule,
        SyntheticHierarchyDataModule,
        TranslationDataModule,
    )
    from lightning_modules import Classifier, LanguageModel, Translation

    return {
        LanguageModel: (LanguageModelingDataModule, MarkovChainDataModule),
        Translation: (TranslationDataModule,),
        Classifier: (SyntheticHierarchyDataModule,),
    }


def check_task_data(model: Any, data: Any) -> None:
    """Refuse, in one line, a model and a data module of different tasks (``model`` and
    ``data``: their config entries, ``class_path`` + ``init_args``). Classes of neither the
    app's tasks nor its data modules pass."""
    model_path = getattr(model, "class_path", None)
    data_path = getattr(data, "class_path", None)
    model_class, data_class = _import_class(model_path), _import_class(data_path)
    if model_class is None or data_class is None:
        return
    table = _task_data()
    known = [cls for kinds in table.values() for cls in kinds]
    if not issubclass(data_class, tuple(known)):
        return
    for task, kinds in table.items():
        if issubclass(model_class, task) and not issubclass(data_class, kinds):
            wanted = " or ".join(kind.__name__ for kind in kinds)
            raise CommandLineError(
                f"data: {data_class.__name__} is not data for {model_class.__name__}, which "
                f"reads {wanted}: give --data a config of the model's task (or --config the "
                f"setting of the data's)"
            )


def _option_names(args: Sequence[str]) -> set[str]:
    """The options given on a command line, without their ``init_args`` segments
    (``model.freeze_backbone``)."""
    names = set()
    for arg in args:
        if isinstance(arg, str) and arg.startswith("--"):
            key = arg[2:].split("=", 1)[0]
            names.add(".".join(part for part in key.split(".") if part != "init_args"))
    return names


def _positive_trainer_options(trainer: Namespace) -> None:
    """Trainer counts that Lightning divides by: 0 stopped the run with a ZeroDivisionError."""
    for option, meaning in (
        ("accumulate_grad_batches", "1: no accumulation"),
        ("check_val_every_n_epoch", "or null to validate by val_check_interval alone"),
        ("val_check_interval", "an int k: every k training batches; a float: a fraction of an "
                               "epoch, in (0, 1]"),
    ):  # fmt: skip
        value = trainer.get(option)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            kind = "positive number" if option == "val_check_interval" else "positive integer"
            raise CommandLineError(f"trainer.{option} must be a {kind} ({meaning}), got {value}")


def _count(value: Any) -> int | None:
    """An int option's value (a batch count), else None (a fraction, a bool, unset)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _check_val_interval(trainer: Namespace) -> None:
    """An int ``val_check_interval`` over the batches an int ``limit_train_batches`` (or
    ``overfit_batches``) leaves an epoch: Lightning refuses it when the fit's loop starts,
    after the data is prepared (``fit_loop.py``: ``val_check_batch > max_batches`` while
    ``check_val_every_n_epoch`` is set and validation is on). With ``check_val_every_n_epoch``
    null the interval counts batches across epochs: legal."""
    interval = _count(trainer.get("val_check_interval"))
    across_epochs = trainer.get("check_val_every_n_epoch", 1) is None
    if interval is None or trainer.get("fast_dev_run") or across_epochs:
        return
    overfit = trainer.get("overfit_batches") or 0
    option, batches = ("overfit_batches", overfit) if overfit > 0 else (
        "limit_train_batches", trainer.get("limit_train_batches"))  # fmt: skip
    validates = trainer.get("limit_val_batches") if overfit <= 0 else overfit  # (None: all)
    if _count(batches) is not None and interval > batches and validates != 0:
        raise CommandLineError(
            f"trainer.val_check_interval {interval} is more training batches than an epoch has "
            f"(trainer.{option} {batches}): give a fraction of an epoch, e.g. "
            f"--trainer.val_check_interval 1.0 (or --trainer.check_val_every_n_epoch null to "
            f"count the batches across epochs)"
        )


def _check_scheduler_interval(model: Any) -> None:
    """A plateau schedule per step refused before anything is built (``configure_optimizers``
    refuses it only after the data is prepared), by the check the optimizers' own
    (:func:`lightning_modules.optimization.check_scheduler_interval`)."""
    init_args = getattr(model, "init_args", None)
    if init_args is None:
        return
    interval = init_args.get("scheduler_interval")
    scheduler = init_args.get("scheduler")
    path = scheduler.get("class_path") if isinstance(scheduler, (dict, Namespace)) else None
    check_scheduler_interval(_import_class(path) if path else None, interval)


# A checkpoint's saved model options (its hyper-parameters) on --ckpt_path. Lightning puts them
# over the run's: the model is built as it was trained. Where the run gives one of them another
# value: options that only steer training or reporting (RESUME_CHANGEABLE: fine-tuning a
# checkpoint with its backbone frozen) take the run's value when it is given on the command
# line or set in a config (not the class default), with a warning line; the others shape the
# parameters (tie_weights) and are refused in one line when the command line gives another
# value (set only in a config, the checkpoint's wins, as Lightning has it, said in an info
# line: a test of an untied checkpoint with a setting that ties).
RESUME_CHANGEABLE = frozenset({"freeze_backbone", "label_smoothing", "top_k", "scheduler_interval"})


def _check_module_configs(checkpoint: dict[str, Any], model: Any, ckpt: str) -> None:
    """The run's backbone and head options against the checkpoint's (``ckpt``): one line
    naming each option that makes its weights not fit, with both values; an info line for
    those that differ harmlessly (dropout at evaluation: the config's value is used)."""
    saved = checkpoint.get(MODULE_CONFIGS_KEY)
    init_args = getattr(model, "init_args", None)
    if not isinstance(saved, dict) or init_args is None:
        return  # (a checkpoint of a model built in Python, or a model without these modules)
    run = {}
    for module in MODULES:
        config = init_args.get(module)
        if not isinstance(config, Namespace) or module not in saved:
            return
        run[module] = config.as_dict()
    try:
        harmless = compare_module_configs(saved, run, ckpt)
    except ModelConfigError as error:
        raise CommandLineError(str(error)) from None
    if harmless:
        _info(
            f"{', '.join(harmless)}: the config's, which do not change the checkpoint's "
            f"weights (--ckpt_path {ckpt})"
        )


def _check_vocabulary_kind(checkpoint: dict[str, Any], data: Any, ckpt: str) -> None:
    """Another ``data.vocab`` (word, bpe, hybrid_lightrnn) than the checkpoint's, refused
    before the data is prepared (a BPE trained for minutes, then refused at the weights). Its
    other vocabulary options are checked on the vocabulary itself once it is built: another
    ``max_vocab_size`` may well give the same words."""
    saved = checkpoint.get("datamodule_hyper_parameters") or {}
    init_args = getattr(data, "init_args", None)
    saved_class, run_class = saved.get("_class_path"), getattr(data, "class_path", None)
    if init_args is None or not isinstance(saved_class, str) or not isinstance(run_class, str):
        return
    if saved_class.rpartition(".")[2] != run_class.rpartition(".")[2]:
        return
    if "vocab" in saved and "vocab" in init_args and saved["vocab"] != init_args["vocab"]:
        raise CommandLineError(
            f"data.vocab is {_yaml(init_args['vocab'])} in the config but "
            f"{_yaml(saved['vocab'])} in the checkpoint {ckpt}: it was trained on another "
            f"vocabulary; give --data.vocab {_yaml(saved['vocab'])} (and its options as the "
            f"run had them, in its config.yaml), or train anew without --ckpt_path"
        )


# The dtype a run's --trainer.precision gives the weights (Lightning's HalfPrecision and
# DoublePrecision convert the module; 32-true and the mixed precisions keep float32)
_WEIGHT_DTYPES = {
    "bf16-true": torch.bfloat16,
    "bf16": torch.bfloat16,
    "16-true": torch.float16,
    "64-true": torch.float64,
    "64": torch.float64,
}


def _check_precision(checkpoint: dict[str, Any], trainer: Any, subcommand: str, ckpt: str) -> None:
    """Weights saved in another dtype than the run's ``trainer.precision`` gives them: a
    resumed fit goes on from them converted (the optimizer's moments too, as PyTorch loads
    them), not exactly where it stopped; an evaluation in a narrower dtype rounds them. One
    warning line saying so; nothing where the dtypes agree."""
    state = checkpoint.get("state_dict") or {}
    saved = next((v.dtype for v in state.values()
                  if isinstance(v, torch.Tensor) and v.is_floating_point()), None)  # fmt: skip
    precision = trainer.get("precision") if trainer is not None else None
    ours = _WEIGHT_DTYPES.get(str(precision), torch.float32)
    if saved is None or saved == ours:
        return
    name = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
            torch.float16: "float16"}  # fmt: skip
    given = f"trainer.precision {precision or '32-true'}"
    if subcommand == "fit":
        warn_line(
            f"{given}: the checkpoint's weights are {name.get(saved, saved)}, and this fit "
            f"goes on in {name.get(ours, ours)} (its optimizer's state too): it does not resume "
            f"exactly where the run stopped (--ckpt_path {ckpt})"
        )
    elif torch.finfo(ours).eps > torch.finfo(saved).eps:
        warn_line(
            f"{given}: the checkpoint's {name.get(saved, saved)} weights are rounded to "
            f"{name.get(ours, ours)} for this {subcommand} (--ckpt_path {ckpt})"
        )


@rank_zero_only
def _info(message: str) -> None:
    log.info(message)


class AppCLI(LightningCLI):
    """LightningCLI over any LightningModule and LightningDataModule of the app."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # a resumed fit keeps the run's config.yaml and writes its own beside it
        kwargs.setdefault("save_config_callback", RunConfigCallback)
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any):
        # no prefix matching: a misspelt --trainer.max_epoch must not silently mean max_epochs
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("description", DESCRIPTION)
        return super().init_parser(**kwargs)

    def _parse_ckpt_path(self) -> None:
        # Lightning reads the checkpoint's hyper-parameters here, before anything is built: a
        # missing or broken file is named first, in one line, instead of PyTorch's traceback
        subcommand = self.config.get("subcommand")
        ckpt = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt in ("last", "best"):  # the newest run's (app/cli/run_folder.py)
            # (Lightning's "Restoring states from the checkpoint path at ..." names the file)
            # fit --ckpt_path last before any run: Lightning's meaning, a fresh start (a job
            # script that passes it on every start, requeued or not)
            fresh = subcommand == "fit" and ckpt == "last"
            found = run_checkpoint(ckpt, self.config[subcommand].trainer, missing_ok=fresh)
            if found is None:
                folder = runs_folder(self.config[subcommand].trainer)
                warn_line(
                    f"fit --ckpt_path last: no run in {folder} has a last.ckpt yet; training "
                    f"starts from scratch"
                )
            ckpt = None if found is None else str(found)
            self.config[subcommand].ckpt_path = ckpt
        if isinstance(ckpt, str) and ckpt not in _CKPT_ALIASES and not _remote(ckpt):
            check_checkpoint_file(ckpt, "ckpt_path")
        if not (isinstance(ckpt, str) and Path(ckpt).is_file()):
            return  # (Lightning reads the hyper-parameters of a local file only)
        # Lightning's _parse_ckpt_path, with the checkpoint's task checked and the options the
        # run may change kept (RESUME_CHANGEABLE)
        saved = torch.load(ckpt, weights_only=True, map_location="cpu", mmap=True)
        hparams = dict(saved.get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if not hparams:
            return
        model = self.config[subcommand].get("model")
        if "_class_path" in hparams:
            self._check_checkpoint_task(ckpt, hparams["_class_path"], model)
            # the backbone and head the config builds against the checkpoint's, before any
            # data is prepared: another size was a tie_weights error or a state_dict dump
            _check_module_configs(saved, model, ckpt)
            _check_vocabulary_kind(saved, self.config[subcommand].get("data"), ckpt)
            _check_precision(saved, self.config[subcommand].get("trainer"), subcommand, ckpt)
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
            self._keep_run_options(hparams["dict_kwargs"], model, ckpt)
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        # the command line as given, to tell its options from a config's (_keep_run_options)
        given = sys.argv[1:] if args is None else args
        self._given_options = _option_names(given) if isinstance(given, (list, tuple)) else set()
        super().parse_arguments(parser, args)

    @staticmethod
    def _check_checkpoint_task(ckpt: str, saved_path: str, model: Any) -> None:
        """Refuse a checkpoint of another task than the run's model, naming both (jsonargparse
        reported the whole model config as an unknown file)."""
        ours_path = getattr(model, "class_path", None)
        if ours_path is None:
            return
        saved, ours = _import_class(saved_path), _import_class(ours_path)
        if not _related(saved, ours, saved_path, ours_path):
            saved_name, ours_name = saved_path.rpartition(".")[2], ours_path.rpartition(".")[2]
            raise CommandLineError(
                f"ckpt_path {ckpt!r} is a {saved_name} checkpoint ({saved_path}), and this run's "
                f"model is a {ours_name} ({ours_path}): give a {ours_name} checkpoint, or the "
                f"config the checkpoint was trained with"
            )

    def _keep_run_options(self, hparams: dict[str, Any], model: Any, ckpt: str = "") -> None:
        """The checkpoint's ``hparams`` less the options the run gives another value that it
        may change (RESUME_CHANGEABLE, said in a warning line); a command line's other value
        of another option refused. See RESUME_CHANGEABLE."""
        init_args = getattr(model, "init_args", None)
        if init_args is None:
            return
        model_class = _import_class(getattr(model, "class_path", None))
        defaults = inspect.signature(model_class).parameters if model_class else {}
        for name, saved in list(hparams.items()):
            if name not in init_args or _plain(init_args[name]) == _plain(saved):
                continue
            ours = init_args[name]
            on_command_line = f"model.{name}" in getattr(self, "_given_options", set())
            default = defaults[name].default if name in defaults else inspect.Parameter.empty
            if name in RESUME_CHANGEABLE and (on_command_line or _plain(ours) != _plain(default)):
                del hparams[name]
                warn_line(
                    f"model.{name}: {_yaml(ours)}, the run's, not the checkpoint's {_yaml(saved)} "
                    f"(an option a run from a checkpoint may change)"
                )
            elif on_command_line and name not in RESUME_CHANGEABLE:
                raise CommandLineError(
                    f"model.{name}: the checkpoint was trained with {name} {_yaml(saved)}, and "
                    f"it shapes the model's parameters: leave --model.{name} {_yaml(ours)} out, "
                    f"or train anew without --ckpt_path"
                )
            elif name not in RESUME_CHANGEABLE:
                # set in a config file: the checkpoint's value builds the model, said (an
                # edited config's tie_weights was dropped without a word)
                _info(
                    f"model.{name} {_yaml(saved)}: the checkpoint's, not the config's "
                    f"{_yaml(ours)} (it shapes the model's parameters; --ckpt_path {ckpt})"
                )

    def _warn_if_untrained(self, subcommand: str) -> None:
        """A model evaluated without --ckpt_path or a pretrained_checkpoint is untrained: its
        perplexity, BLEU or predictions are those of random weights (Lightning says nothing)."""
        init_args = getattr(self.config[subcommand].get("model"), "init_args", None)
        pretrained = init_args.get("pretrained_checkpoint") if init_args is not None else None
        if self.config_init[subcommand].get("ckpt_path") is None and pretrained is None:
            warn_line(f"{subcommand} without --ckpt_path: the model is untrained")

    def before_validate(self) -> None:
        self._warn_if_untrained("validate")

    def before_test(self) -> None:
        self._warn_if_untrained("test")

    def before_predict(self) -> None:
        self._warn_if_untrained("predict")

    def add_arguments_to_parser(self, parser) -> None:
        for target in (
            "model.init_args.backbone.init_args.vocab_size",
            "model.init_args.head.init_args.vocab_size",
        ):
            parser.link_arguments("data.vocab_size", target, apply_on="instantiate")
        parser.link_arguments(
            "model.init_args.backbone",
            "model.init_args.head.init_args.hidden_size",
            compute_fn=backbone_output_size,
            apply_on="parse",
        )
        # Translation only: the encoder's vocabulary. jsonargparse skips an instantiation link
        # whose source object lacks the attribute, so LM data modules (no src_vocab_size)
        # leave LM backbones (no such argument) untouched.
        parser.link_arguments(
            "data.src_vocab_size",
            "model.init_args.backbone.init_args.src_vocab_size",
            apply_on="instantiate",
        )

    # -- the run's folder and its TensorBoard record (app/cli/run_folder.py) ----------------------
    def _subcommand_config(self) -> Namespace:
        return self.config[self.subcommand] if self.subcommand else self.config

    def before_instantiate_classes(self) -> None:
        config = self._subcommand_config()
        for given, ours, example in (
            ("optimizer", "optimizer", "torch.optim.SGD --model.optimizer.lr 1"),
            (
                "lr_scheduler",
                "scheduler",
                "torch.optim.lr_scheduler.StepLR --model.scheduler.step_size 1",
            ),
        ):
            if config.get(given) is not None:
                # Lightning's own option would replace the model's configure_optimizers: the
                # model's schedule (or optimizer) dropped without a word, its hparams wrong
                raise CommandLineError(
                    f"--{given}: the model takes its optimizer and schedule as options: use "
                    f"--model.{ours} (e.g. --model.{ours} {example})"
                )
        check_task_data(config.get("model"), config.get("data"))
        _positive_trainer_options(config.trainer)
        if self.subcommand == "fit":  # (test of a checkpoint trained per step: its own options)
            _check_val_interval(config.trainer)
            _check_scheduler_interval(config.get("model"))
        if self.subcommand == "predict" and (asked := _predict_on_one_device(config.trainer)):
            warn_line(
                f"predict runs on one device, not the setting's {asked}: its output "
                f"comes once, in input order"
            )
        configure_loggers(config.trainer, self.subcommand, config.get("ckpt_path"))
        if self.subcommand is not None:  # (build() writes nothing)
            check_log_folders(config.trainer)
        no_logger = config.trainer.get("logger") in (False, [])
        # what the user turned off, the shipped callbacks go without: Lightning refuses a
        # learning-rate monitor with no logger and a ModelCheckpoint with no checkpointing
        if no_logger:
            _drop_callbacks(config.trainer, LearningRateMonitor)
        if config.trainer.get("enable_checkpointing") is False:
            _drop_callbacks(config.trainer, Checkpoint)
        # every run records its hyper-parameters and best validation figure (HPARAMS); every
        # fit saves a resumable checkpoint when it is preempted or interrupted
        extra = self.trainer_defaults.get("callbacks") or []
        extra = extra if isinstance(extra, list) else [extra]
        ours = [RunRecord(run_hparams(config))]
        if self.subcommand == "fit":
            ours.append(PreemptionCheckpoint())
        if _default_progress_bar(config.trainer, extra):  # no device sync per batch for it
            ours.append(interval_progress_bar())
        if self.subcommand == "predict" and not _has_callback(
            config.trainer, extra, BasePredictionWriter
        ):  # a config without the writer (the DS recipes') still prints its predictions
            ours.append(PredictionWriter())
        self.trainer_defaults = {**self.trainer_defaults, "callbacks": [*extra, *ours]}
        if self.subcommand is not None and no_logger:
            # no logger, no run folder: the config would land in the working folder (the
            # trainer's default_root_dir), over a config.yaml there, the user's own --config too
            self.save_config_callback = None
        elif self.subcommand not in (None, "fit"):  # the run folder's config.yaml is the fit's
            self.save_config_kwargs = {
                **self.save_config_kwargs,
                "config_filename": f"{self.subcommand}_config.yaml",
            }

    def _evaluate(self, subcommand: str, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            # ModelCheckpoint saves nothing outside fit: that it does not take over the state
            # of a checkpoint written in another folder (eval-<name>) is no news
            warnings.filterwarnings("ignore", "The dirpath has changed", UserWarning)
            return getattr(self.trainer, subcommand)(**kwargs)

    # LightningCLI runs a method of the subcommand's name, when the CLI has one
    def validate(self, **kwargs: Any) -> Any:
        return self._evaluate("validate", **kwargs)

    def test(self, **kwargs: Any) -> Any:
        return self._evaluate("test", **kwargs)

    def predict(self, **kwargs: Any) -> Any:
        # the PredictionWriter prints each batch as it comes; Lightning would also keep every
        # result until the end (return_predictions defaults to true on one device), so
        # memory grew with the input file (50,000 prompts: 50,000 dicts held for nothing)
        if kwargs.get("return_predictions") is None:
            kwargs["return_predictions"] = False
        return self._evaluate("predict", **kwargs)


def make_cli(args: Sequence[str], run: bool = True, **kwargs: Any) -> AppCLI:
    """``AppCLI`` on ``args`` (a subcommand first when ``run``), as ``python cli.py`` builds it;
    a mistake in ``args`` raises :class:`app.cli.errors.CommandLineError` (one line)."""
    check_config_files(args)
    check_linked_options(args)
    kwargs.setdefault("parser_class", OneLineErrorParser)
    with warnings.catch_warnings():  # args are passed on purpose, not read from sys.argv
        warnings.filterwarnings("ignore", ".*args parameter is intended to run from within.*")
        return AppCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            args=list(args),
            run=run,
            **kwargs,
        )


# what a config saved by a run (``<log dir>/config.yaml``) holds beyond the objects themselves
_RUN_OPTIONS = ("ckpt_path", "weights_only")


def _config_arg(config: str) -> str:
    """A config file as ``--config`` takes it: shipped configs as paths (their fragments are
    relative to them), configs saved by a run without the subcommand's own options."""
    content = yaml.safe_load(Path(config).read_text()) or {}
    if not any(key in content for key in _RUN_OPTIONS):
        return config
    return yaml.safe_dump({k: v for k, v in content.items() if k not in _RUN_OPTIONS})


def build(configs: Sequence[str], overrides: Sequence[str] = ()) -> AppCLI:
    """Model, data module and trainer of config files (later ones override earlier ones; shipped
    configs or ones saved by a run) and ``--key value`` overrides, built but not run:
    ``cli.model``, ``cli.datamodule``, ``cli.trainer``."""
    args = [arg for config in configs for arg in ("--config", _config_arg(config))]
    return make_cli([*args, *overrides], run=False)
