"""A checkpoint path checked before anything reads it: PyTorch's own errors for a file that is
not a checkpoint (``EOFError``, ``PytorchStreamReader failed reading zip archive``, advice on
``weights_only``) name neither the file nor the option."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

from lightning_modules.errors import CheckpointPathError, ModelConfigError


def check_checkpoint_file(path: str, option: str) -> None:
    """Raise :class:`CheckpointPathError` naming ``option`` unless ``path`` is a whole file in
    the format ``torch.save`` writes (a zip archive: a truncated one has no central directory)."""
    file = Path(path)
    if not file.is_file():
        raise CheckpointPathError(f"{option} {path!r} does not exist or is not a file")
    if file.stat().st_size == 0:
        raise CheckpointPathError(f"{option} {path!r} is empty (0 bytes), not a checkpoint")
    if not zipfile.is_zipfile(file):
        raise CheckpointPathError(
            f"{option} {path!r} is not a checkpoint written by fit (not a PyTorch archive, or "
            f"a truncated one)"
        )


def best_checkpoint_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The state a ``ModelCheckpoint`` saved in ``checkpoint`` (the first one that recorded a
    best checkpoint: ``best_model_path``, ``best_model_score``, ``monitor``), or None."""
    for key, value in (checkpoint.get("callbacks") or {}).items():
        if key.startswith("ModelCheckpoint") and value.get("best_model_path"):
            return value
    return None


def check_checkpoint_task(checkpoint: dict[str, Any], task: type, name: str) -> None:
    """Refuse, in one line naming both, a checkpoint (``name``, for the message) of another
    task than ``task`` (the class whose ``load_from_checkpoint`` reads it): Lightning's own
    refusal of a language model's checkpoint given to ``Translation`` spoke of code
    execution and imports. Accepted: the task's own class, a class it derives from, or one
    deriving from it (as Lightning loads a subclass's checkpoint through its base); silent
    where the checkpoint names no class (one not written through LightningCLI)."""
    saved = (checkpoint.get("hyper_parameters") or {}).get("_class_path")
    if not isinstance(saved, str):
        return
    saved_name = saved.rpartition(".")[2]
    related, stack = {cls.__name__ for cls in task.__mro__}, [task]
    while stack:  # the classes deriving from the task
        for sub in stack.pop().__subclasses__():
            related.add(sub.__name__)
            stack.append(sub)
    if saved_name not in related:
        raise ModelConfigError(
            f"{name} is a {saved_name} checkpoint ({saved}), not a {task.__name__} one: load "
            f"it with {saved_name}.load_from_checkpoint, or give a {task.__name__} checkpoint"
        )
