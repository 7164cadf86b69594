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
