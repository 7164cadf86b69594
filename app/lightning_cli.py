"""The application's LightningCLI: how configs become a model, a data module and a trainer.

``cli.py`` runs it for users; the benchmark and the experiment runner build models with it
too (:func:`build`), so a config means the same thing everywhere.

Sizes are stated once: the data module's vocabulary size is linked into the backbone and the
head (and a translation data module's ``src_vocab_size`` into the encoder), and the backbone's
output size into ``head.hidden_size``.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI

from lightning_modules.backbones.base import configured_output_size
from lightning_modules.errors import CheckpointPathError

# Lightning's own checkpoint names, not paths
_CKPT_ALIASES = ("last", "best", "hpc")


def backbone_output_size(backbone: Namespace) -> int:
    """``head.hidden_size`` from the backbone's config (``class_path`` + ``init_args``)."""
    module, _, name = backbone.class_path.rpartition(".")
    backbone_class = getattr(importlib.import_module(module), name)
    return configured_output_size(backbone_class, vars(backbone.init_args))


class AppCLI(LightningCLI):
    """LightningCLI over any LightningModule and LightningDataModule of the app."""

    def _check_ckpt_path(self) -> None:
        # Lightning would report a missing checkpoint only after building everything, with
        # a stack trace
        ckpt = self.config_init[self.subcommand].get("ckpt_path")
        if not isinstance(ckpt, str) or ckpt in _CKPT_ALIASES:
            return
        if ckpt.startswith("registry") or "://" in ckpt:  # model registry or remote storage
            return
        if not Path(ckpt).is_file():
            raise CheckpointPathError(f"ckpt_path {ckpt!r} does not exist or is not a file")

    # LightningCLI calls before_<subcommand> right before running it
    before_fit = before_validate = before_test = before_predict = _check_ckpt_path

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


def make_cli(args: Sequence[str], run: bool = True, **kwargs: Any) -> AppCLI:
    """``AppCLI`` on ``args`` (a subcommand first when ``run``), as ``python cli.py`` builds it."""
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
