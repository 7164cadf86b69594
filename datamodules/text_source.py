"""Loads the train/valid/test text splits through HuggingFace ``datasets``.

Either local files (the offline ``text`` builder, one example per line) or a hub dataset
name for users with network access; both give a ``DatasetDict`` with a ``text`` column and
the splits ``train``, ``valid``, ``test``.
"""

from __future__ import annotations

import re
from pathlib import Path

from datasets import DatasetDict, load_dataset

from datamodules.errors import DataPathError

SPLITS = ("train", "valid", "test")
# File-name fragments that identify each split in a local folder.
_SPLIT_PATTERNS = {"train": ("train",), "valid": ("valid", "val", "dev"), "test": ("test",)}


def _name_parts(name: str) -> list[str]:
    return re.split(r"[^a-z0-9]+", name.lower())


def looks_local(path: str) -> bool:
    return Path(path).expanduser().exists() or path.startswith((".", "/", "~"))


def find_split_files(folder: Path, files: dict[str, str] | None) -> dict[str, Path]:
    """Map each split to its file inside ``folder`` (given names, or found by name)."""
    if not folder.is_dir():
        raise DataPathError(f"data path {str(folder)!r} does not exist or is not a folder")
    found: dict[str, Path] = {}
    for split in SPLITS:
        if files and split in files:
            candidate = folder / files[split]
        else:
            matches = sorted(
                p
                for p in folder.iterdir()
                if p.is_file() and set(_name_parts(p.name)) & set(_SPLIT_PATTERNS[split])
            )
            if len(matches) != 1:
                raise DataPathError(
                    f"cannot find exactly one {split} file in {str(folder)!r} (found "
                    f"{[m.name for m in matches]}); name them with data.files, e.g. "
                    f"{{train: ptb.train.txt, valid: ptb.valid.txt, test: ptb.test.txt}}"
                )
            candidate = matches[0]
        if not candidate.is_file():
            raise DataPathError(f"{split} file {str(candidate)!r} does not exist")
        with candidate.open(encoding="utf-8") as handle:
            if not any(line.strip() for line in handle):
                raise DataPathError(f"{split} file {str(candidate)!r} is empty")
        found[split] = candidate
    return found


def load_text_splits(
    path: str,
    files: dict[str, str] | None = None,
    hub_config: str | None = None,
    hub_splits: dict[str, str] | None = None,
    text_column: str = "text",
) -> DatasetDict:
    """Load the three splits from a local folder or a hub dataset name."""
    if looks_local(path):
        split_files = find_split_files(Path(path).expanduser(), files)
        return load_dataset("text", data_files={s: str(p) for s, p in split_files.items()})
    hub_splits = hub_splits or {"train": "train", "valid": "validation", "test": "test"}
    raw = load_dataset(path, hub_config)
    missing = [name for name in hub_splits.values() if name not in raw]
    if missing:
        raise DataPathError(f"hub dataset {path!r} has no split(s) {missing}; set data.hub_splits")
    splits = DatasetDict({ours: raw[theirs] for ours, theirs in hub_splits.items()})
    if text_column != "text":
        splits = splits.rename_column(text_column, "text")
    return splits.select_columns(["text"])
