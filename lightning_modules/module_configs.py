"""The backbone's and head's configs inside a checkpoint, so that a model trained with ``cli.py``
loads in Python with ``LanguageModel.load_from_checkpoint(path)`` alone.

LightningCLI keeps a model's hyper-parameters in its checkpoints, but ours leave the backbone and
the head out on purpose: LightningCLI re-applies a checkpoint's hyper-parameters over the command
line (``test --ckpt_path``), which must stay free to change. So the two modules' configs (class
path and init args, the CLI's links applied: ``vocab_size``, the head's ``hidden_size``) go in a
key of their own, which only :meth:`HeadTask.load_from_checkpoint` reads.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from jsonargparse import ArgumentParser
from lightning.fabric.utilities.cloud_io import _load as pl_load
from lightning.pytorch.core.mixins.hparams_mixin import _given_hyperparameters
from torch import nn

from lightning_modules.checkpoint_file import check_checkpoint_file, check_checkpoint_task
from lightning_modules.errors import ModelConfigError

MODULE_CONFIGS_KEY = "module_configs"
MODULES = ("backbone", "head")


def cli_module_configs(hidden_size: int) -> dict[str, Any] | None:
    """While LightningCLI builds a task (call from its ``__init__``): the backbone's and head's
    configs it was given, or None for a task built in Python. ``hidden_size``: the head's,
    which the CLI links from the backbone while parsing (its config does not hold it)."""
    given = _given_hyperparameters.get()
    if not isinstance(given, dict) or not all(isinstance(given.get(m), dict) for m in MODULES):
        return None
    configs = copy.deepcopy({m: given[m] for m in MODULES})
    configs["head"].setdefault("init_args", {})["hidden_size"] = hidden_size
    return configs


def build_modules(path: Any, kwargs: dict[str, Any], task: type | None = None) -> dict[str, Any]:
    """``kwargs`` with the backbone and the head a ``cli.py`` checkpoint at ``path`` describes
    (fresh modules: the checkpoint's weights are loaded into them after), unless given; a
    checkpoint of another task than ``task`` (the class loading it) refused in one line."""
    if all(m in kwargs for m in MODULES):
        return kwargs
    if isinstance(path, (str, os.PathLike)) and "://" not in str(path):
        check_checkpoint_file(str(path), "checkpoint_path")
        # mmap: only the configs are read here, not the weights
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    else:  # a URL or an open file, as Lightning reads them
        checkpoint = pl_load(path, map_location="cpu", weights_only=False)
        if hasattr(path, "seek"):
            path.seek(0)  # (Lightning reads it again)
    if task is not None:
        check_checkpoint_task(checkpoint, task, repr(path))
    configs = checkpoint.get(MODULE_CONFIGS_KEY)
    if configs is None:
        raise ModelConfigError(
            f"{path!r} holds no backbone and head configs (a model built in Python, or a "
            f"checkpoint from before they were saved): pass them, load_from_checkpoint(path, "
            f"backbone=..., head=...)"
        )
    built = {m: kwargs[m] if m in kwargs else _build(configs[m]) for m in MODULES}
    return {**kwargs, **built}


def _build(config: dict[str, Any]) -> nn.Module:
    # through jsonargparse, as the CLI built it: the init args checked against the signature
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(nn.Module, "module", fail_untyped=False)
    return parser.instantiate_classes(parser.parse_object({"module": config})).module


# -- a run's backbone and head against a checkpoint's (``--ckpt_path`` with an edited config) --
# Options filled by the CLI's links, not by the user: the vocabulary is checked as data, and
# the head's hidden_size follows the backbone's options (named instead).
_LINKED = frozenset({"vocab_size", "src_vocab_size"})
_HEAD_LINKED = frozenset({"hidden_size"})
# an adaptive head's options that cutoffs: auto decides (or the checkpoint's cut-offs give)
_AUTO_DECIDED = frozenset({"cutoffs", "num_clusters", "cost_model", "calibration_batch"})
# Options that act in training only (dropout, noise, regularisers, initialisation), that
# only steer a decision the checkpoint already holds, or that choose an approximation at
# inference (DS-Softmax's SVD-softmax top-k, svd_*: section 4.6): another value keeps the
# weights' meaning. Any other option that differs is refused, even where the shapes agree: a
# Transformer's num_heads or Mixtape's weight_norm_scale change what the same weights compute.
_TRAINING_ONLY = ("dropout", "noise", "init", "lambda_", "ar_alpha", "tar_beta",
                  "calibration_batch", "cost_model", "max_length", "svd_")  # fmt: skip


def _training_only(name: str) -> bool:
    return any(part in name for part in _TRAINING_ONLY)


def _init_args(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config.get("init_args") or {})


def plain_value(value: Any) -> Any:
    """A value as a config holds it, to compare (a checkpoint's tuple, a config's list)."""
    if isinstance(value, (list, tuple)):
        return [plain_value(item) for item in value]
    if isinstance(value, dict):
        return {key: plain_value(item) for key, item in value.items()}
    return value


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    """A module's public attributes of plain types (sizes, counts, flags, scales: what its
    forward reads besides its weights, e.g. ``MultiheadAttention.num_heads``)."""
    plain = (int, float, bool, str, type(None))
    return {
        key: value
        for key, value in vars(module).items()
        if not key.startswith("_")
        and key != "training"
        and (
            isinstance(value, plain)
            or (isinstance(value, tuple) and all(isinstance(v, plain) for v in value))
        )
    }


def _fingerprint(configs: dict[str, dict[str, Any]]) -> tuple[dict, dict] | None:
    """The two modules ``configs`` describes, built on the meta device (no memory, no
    initialisation cost): their parameters' and buffers' shapes by name, and each
    submodule's plain attributes; None where they do not build (a value the run will
    report itself)."""
    shapes: dict[str, Any] = {}
    attributes: dict[str, Any] = {}
    for module in MODULES:
        try:
            with torch.device("meta"):
                built = _build(configs[module])
        except Exception:  # noqa: BLE001 - any refusal of the options: not comparable
            return None
        for key, value in built.state_dict().items():
            shapes[f"{module}.{key}"] = (
                tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            )
        for key, sub in built.named_modules():
            attributes[f"{module}.{key}"] = _plain_attributes(sub)
    return shapes, attributes


def _with_option(
    configs: dict[str, dict[str, Any]], module: str, name: str, value: Any
) -> dict[str, dict[str, Any]]:
    """``configs`` with ``module``'s option ``name`` set to ``value``, the head's hidden_size
    linked from the backbone again (as the CLI links it)."""
    from lightning_modules.backbones.base import configured_output_size

    changed = copy.deepcopy(configs)
    changed[module].setdefault("init_args", {})[name] = value
    if module == "backbone":
        try:
            backbone_class = _class(changed["backbone"]["class_path"])
            output = configured_output_size(backbone_class, changed["backbone"]["init_args"])
        except Exception:  # noqa: BLE001 - left to the build to refuse
            return changed
        changed["head"].setdefault("init_args", {})["hidden_size"] = output
    return changed


def _class(path: str) -> type:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _structure_options(class_path: Any) -> frozenset[str]:
    """A module's options that only size the structure a fresh one starts from, which a
    checkpoint's replaces on load (DS-Softmax's ``num_experts``: pruning and mitosis change
    the experts), declared by its class as ``structure_options``."""
    try:
        declared = getattr(_class(str(class_path)), "structure_options", frozenset())
    except Exception:  # noqa: BLE001 - compared as stated then
        return frozenset()
    return frozenset(declared)


def _defaults(class_path: Any) -> dict[str, Any]:
    """The default values of a class's init arguments (none where it does not import)."""
    import inspect

    try:
        parameters = inspect.signature(_class(str(class_path))).parameters.values()
    except Exception:  # noqa: BLE001 - compared as stated then
        return {}
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def command_line_text(value: Any) -> str:
    """A value as the command line writes it (``true``, not ``True``)."""
    import yaml

    try:
        return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
    except yaml.YAMLError:  # not a plain value
        return str(value)


def compare_module_configs(
    saved: dict[str, dict[str, Any]], run: dict[str, dict[str, Any]], name: str
) -> list[str]:
    """A run's backbone and head configs (``run``: class path and init args, as the CLI
    parsed them) against those a checkpoint (``name``, for messages) was trained with
    (``saved``, its :data:`MODULE_CONFIGS_KEY`). Raises :class:`ModelConfigError`, one line
    naming each option with the config's and the checkpoint's value, where the weights would
    not fit (another class, other shapes) or would compute something else; returns the
    options that differ harmlessly (training only: dropout, noise, initialisation), as
    ``model.<module>.<option> <run value> (the checkpoint's <saved value>)``."""
    refused: list[str] = []
    harmless: list[str] = []
    for module in MODULES:
        saved_path, run_path = saved[module].get("class_path"), run[module].get("class_path")
        if (
            saved_path != run_path
            and str(saved_path).rpartition(".")[2] != str(run_path).rpartition(".")[2]
        ):
            refused.append(
                f"model.{module} is {run_path} in the config but {saved_path} in the checkpoint"
            )
    if refused:
        _refuse(refused, name)
    # the run's configs as the CLI will build them: the checkpoint's links (vocabulary sizes)
    ours = {m: copy.deepcopy(run[m]) for m in MODULES}
    for module in MODULES:
        args = ours[module].setdefault("init_args", {})
        for key in _LINKED:
            if key in _init_args(saved[module]):
                args[key] = saved[module]["init_args"][key]
    base = {m: copy.deepcopy(saved[m]) for m in MODULES}
    base_print = _fingerprint(base)
    misfit = False  # an option that changes the weights' shapes (else: their meaning)
    for module in MODULES:
        theirs, mine = _init_args(saved[module]), _init_args(ours[module])
        skip = _LINKED | (_HEAD_LINKED if module == "head" else frozenset())
        if "auto" in (theirs.get("cutoffs"), mine.get("cutoffs")):
            # an adaptive head with cutoffs: auto adopts the checkpoint's cut-offs on load,
            # and a fixed one is checked against them there (AdaptiveSoftmaxHead)
            skip |= _AUTO_DECIDED
        # an option one side does not state has its class's default (a checkpoint from
        # before the option existed)
        defaults = _defaults(ours[module].get("class_path"))
        theirs, mine = {**defaults, **theirs}, {**defaults, **mine}
        structure = _structure_options(ours[module].get("class_path"))
        for option in sorted(set(theirs) | set(mine)):
            if option in skip or plain_value(theirs.get(option)) == plain_value(mine.get(option)):
                continue
            if option in structure:  # the checkpoint's structure is loaded whatever its value
                harmless.append(
                    f"model.{module}.{option} {command_line_text(mine.get(option))} (the "
                    f"checkpoint's {command_line_text(theirs.get(option))}, its structure loaded)"
                )
                continue
            changed = _fingerprint(_with_option(base, module, option, mine.get(option)))
            if changed is None or base_print is None:
                continue  # not built here: the load's own checks speak (as before this check)
            same_shapes = changed[0] == base_print[0]
            same = same_shapes and changed[1] == base_print[1]
            if same or (same_shapes and _training_only(option)):
                given, saved_value = command_line_text(mine.get(option)), theirs.get(option)
                harmless.append(
                    f"model.{module}.{option} {given} (the checkpoint's "
                    f"{command_line_text(saved_value)})"
                )
                continue
            misfit = misfit or not same_shapes
            given = command_line_text(mine.get(option))
            refused.append(
                f"model.{module}.{option} is {given} in the config but "
                f"{command_line_text(theirs.get(option))} in the checkpoint"
            )
    if refused:
        _refuse(refused, name, misfit)
    return harmless


def _refuse(lines: list[str], name: str, misfit: bool = True) -> None:
    why = (
        "its weights do not fit this model"
        if misfit
        else "its weights would fit but compute something else"
    )
    raise ModelConfigError(
        f"{', and '.join(lines)} {name}: {why}; give the options it was trained with (its "
        f"run's config.yaml), or train anew without --ckpt_path"
    )
