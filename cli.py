"""Command-line entry point: ``python cli.py fit|validate|test|predict --config ...``.

A LightningCLI over any LightningModule and LightningDataModule of the app. The data
module's vocabulary size (the target side's, for translation) is linked into the backbone and
the head, and a translation data module's ``src_vocab_size`` into the encoder, so no config
repeats them.

Config files may start with ``__base__: other.yaml`` (a path relative to the file): the
base is applied first and the file overrides only what differs.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningCLI

from app.allocator import tune_glibc_malloc
from app.vocab import VocabularyMismatchError
from datamodules.text_source import DataConfigError, DataPathError
from datamodules.translation import ParallelDataError
from heads import HeadConfigError
from lightning_modules.checks import CheckpointMismatchError, ModelConfigError, NonFiniteLossError


class CheckpointPathError(FileNotFoundError):
    """``--ckpt_path`` names no file."""


# Errors that mean "fix your config or data": shown as one line, not a stack trace.
USER_ERRORS = (
    HeadConfigError,
    DataPathError,
    DataConfigError,
    VocabularyMismatchError,
    ParallelDataError,
    ModelConfigError,
    CheckpointMismatchError,
    NonFiniteLossError,
    CheckpointPathError,
)

_CONFIG_FLAGS = ("--config", "-c")


def expand_config_bases(argv: list[str]) -> list[str]:
    """Replace each ``--config FILE`` whose YAML names a ``__base__`` by the chain
    ``--config BASE ... --config <FILE without __base__>`` (bases first)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in _CONFIG_FLAGS and i + 1 < len(argv):
            out += _config_chain(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--config="):
            out += _config_chain(arg.split("=", 1)[1])
        else:
            out.append(arg)
        i += 1
    return out


def _config_chain(config: str, seen: tuple[Path, ...] = ()) -> list[str]:
    path = Path(config)
    if not path.is_file():
        return ["--config", config]  # an inline YAML string, or let jsonargparse report it
    content = yaml.safe_load(path.read_text()) or {}
    if not isinstance(content, dict) or "__base__" not in content:
        return ["--config", config]
    base = (path.parent / content.pop("__base__")).resolve()
    if base in seen:
        raise SystemExit(f"error: config {config} has a __base__ cycle through {base}")
    if not base.is_file():
        raise SystemExit(f"error: __base__ {base} named in {config} does not exist")
    return _config_chain(str(base), (*seen, base)) + ["--config", yaml.safe_dump(content)]


class AppCLI(LightningCLI):
    def _check_ckpt_path(self) -> None:
        # Lightning would report a missing checkpoint only after building everything, with
        # a stack trace; "last"/"best"/"hpc" are Lightning's own names, not paths.
        ckpt = self.config_init[self.subcommand].get("ckpt_path")
        if not isinstance(ckpt, str) or ckpt in ("last", "best", "hpc"):
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
        # Translation only: the encoder's vocabulary. jsonargparse skips an instantiation link
        # whose source object lacks the attribute, so LM data modules (no src_vocab_size)
        # leave LM backbones (no such argument) untouched.
        parser.link_arguments(
            "data.src_vocab_size",
            "model.init_args.backbone.init_args.src_vocab_size",
            apply_on="instantiate",
        )


def main(argv: list[str] | None = None) -> AppCLI:
    # Our BPTT loaders are deliberately single-process: the whole stream is in memory.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*IterableDataset.*has `__len__` defined.*")
    warnings.filterwarnings("ignore", ".*infer the batch indices.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")
    # we pass the expanded argv ourselves (config bases), so sys.argv is not forgotten
    warnings.filterwarnings("ignore", ".*args parameter is intended to run from within Python.*")
    args = expand_config_bases(sys.argv[1:] if argv is None else argv)
    tune_glibc_malloc()  # steadier, faster CPU steps (app/allocator.py)
    return AppCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


def user_error(exc: BaseException) -> BaseException | None:
    """The user-facing error at the root of ``exc`` (jsonargparse wraps them), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, USER_ERRORS):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def console_main(argv: list[str] | None = None) -> int:
    try:
        main(argv)
    except Exception as exc:
        cause = user_error(exc)
        if cause is None:
            raise
        print(f"error: {cause}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(console_main())
