"""A pretrained checkpoint (``model.pretrained_checkpoint``) read once: its weights by part, and
the data it was trained on, checked against this run twice, each mismatch named in one line:
the model's shapes when the weights load (``__init__``: another vocabulary size or other
sizes), and the data module's vocabulary itself at ``setup``, once it is built (two corpora
capped at the same size have equal shapes and other words). The data module then takes the
checkpoint's vocabulary state too (a Hybrid-LightRNN table re-learnt in the pretraining run),
as ``fit --ckpt_path`` does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from datamodules.errors import VocabularyMismatchError
from lightning_modules.checkpoint_file import check_checkpoint_file
from lightning_modules.checks import restore_data_state
from lightning_modules.epoch_resume import TRAIN_STATE_KEY
from lightning_modules.errors import ModelConfigError

OPTION = "model.pretrained_checkpoint"
# a checkpoint's entries that are not what it was trained on (the last two: a training
# epoch's sums and recurrent state, epoch_resume.TRAIN_STATE_KEY, and its earlier name)
_NOT_DATA = ("state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks",
             TRAIN_STATE_KEY, "language_model_train_state")  # fmt: skip
# the longest mismatch quoted (torch lists every missing key on one line)
_LONGEST = 300


@dataclass
class Pretrained:
    """What a pretrained checkpoint was trained on, kept past its weights: ``entries``, the
    checkpoint's entries but its weights and training state (the data module's state under
    its class name, its hyperparameters under ``datamodule_hyper_parameters``)."""

    path: str
    entries: dict[str, Any]

    def data(self) -> str:
        """What the checkpoint was trained on, for messages."""
        hp = self.entries.get("datamodule_hyper_parameters") or {}
        if hp.get("hub"):
            where = f"data.hub {hp['hub']!r}"
        elif hp.get("path"):
            where = f"data.path {hp['path']!r}"
        else:
            where = "the shipped corpus (no data.path)"
        return f"{where} (data.vocab {hp.get('vocab')!r})" if hp else "data it does not record"

    def check_task(self, model: Any) -> None:
        """Refuse, naming both, a checkpoint of another task than ``model``'s (a translation
        model's given to a language model: its weights' shapes were reported as a data
        mismatch). Silent where the checkpoint names no task."""
        saved = (self.entries.get("hyper_parameters") or {}).get("_class_path")
        if not isinstance(saved, str):
            return
        saved_name, ours = saved.rpartition(".")[2], type(model)
        if any(saved_name == cls.__name__ for cls in ours.__mro__):
            return
        raise ModelConfigError(
            f"{OPTION} {self.path!r} is a {saved_name} checkpoint ({saved}), and this run's "
            f"model is a {ours.__name__}: give a {ours.__name__} checkpoint"
        )

    def load_into(self, module: torch.nn.Module, part: str, state: dict[str, torch.Tensor]) -> None:
        """Load ``part``'s weights ``state`` into ``module``; a mismatch in one line."""
        try:
            module.load_state_dict(state)
        except RuntimeError as error:  # torch lists every mismatch, a line each: one says enough
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            sizes = [line for line in lines[1:] if line.startswith("size mismatch")]
            first = (sizes or lines[1:] or lines)[0]
            first = first if len(first) <= _LONGEST else first[: _LONGEST - 3] + "..."
            raise ModelConfigError(
                f"{OPTION} {self.path!r} does not fit this model's {part}: {first} It was "
                f"trained on {self.data()}: give this run the same data options and sizes"
            ) from None

    def check_data(self, datamodule: Any) -> None:
        """The data module's vocabulary against the checkpoint's (and its state loaded into
        the data module), where the checkpoint holds a state for this data module's class."""
        try:
            restore_data_state(datamodule, self.entries)  # once: the data module keeps it
        except VocabularyMismatchError as error:
            raise VocabularyMismatchError(f"{OPTION} {self.path!r}: {error}") from None


def read_pretrained(path: str) -> tuple[dict[str, dict[str, torch.Tensor]], Pretrained]:
    """The checkpoint at ``path`` (checked as a file first): its weights under each top-level
    module name (``backbone``, ``head``), to load and let go, and what it was trained on."""
    check_checkpoint_file(path, OPTION)
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in checkpoint["state_dict"].items():
        part, _, name = key.partition(".")
        parts.setdefault(part, {})[name] = value
    entries = {k: v for k, v in checkpoint.items() if k not in _NOT_DATA}
    return parts, Pretrained(path, entries)
