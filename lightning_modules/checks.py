"""Checks the task modules share: they name the option or input to fix."""

from __future__ import annotations

from typing import Any

import torch

from heads import Head
from heads.errors import CheckpointMismatchError
from lightning_modules.errors import ModelConfigError, NonFiniteLossError

HEAD_KEY = "head_class"


class FiniteLossCheck:
    """Stops training on a NaN or infinite loss without a host sync per step.

    :meth:`record` runs in every step and only queues device work: the first non-finite
    loss's step, value and stage are kept in three 0-dim tensors on the loss's device.
    :meth:`raise_if_non_finite` reads them back (one sync) and raises
    :class:`NonFiniteLossError` naming that step, stage and head; the task calls it at the
    logging interval (``trainer.log_every_n_steps``), at the end of a training epoch and of
    every validation or test, and at once where no trainer runs the module (direct calls).
    """

    def __init__(self) -> None:
        self._stages: list[str] = []
        self._step: torch.Tensor | None = None  # -1 until a non-finite loss is seen
        self._value: torch.Tensor | None = None
        self._stage: torch.Tensor | None = None

    def record(self, loss: torch.Tensor, stage: str, step: int) -> None:
        loss = loss.detach()
        device = loss.device
        if self._step is None:  # fills on the device: no copy from the host
            self._step = torch.full((), -1, dtype=torch.long, device=device)
            self._value = torch.zeros((), dtype=torch.float64, device=device)
            self._stage = torch.zeros((), dtype=torch.long, device=device)
        elif self._step.device != device:  # the module moved: keep what was found
            self._step, self._value, self._stage = (
                t.to(device) for t in (self._step, self._value, self._stage)
            )
        if stage not in self._stages:
            self._stages.append(stage)
        # no branch on the data: a where per kept value, with Python numbers as kernel scalars
        new = (self._step < 0) & ~torch.isfinite(loss)
        self._step = torch.where(new, step, self._step)
        self._value = torch.where(new, loss.to(torch.float64), self._value)
        self._stage = torch.where(new, self._stages.index(stage), self._stage)

    def raise_if_non_finite(self, head: torch.nn.Module) -> None:
        """One read-back; raises if a recorded loss was not finite."""
        if self._step is None:
            return
        step = int(self._step)
        if step < 0:
            return
        value, stage = float(self._value), self._stages[int(self._stage)]
        self._step = None  # reported once
        raise NonFiniteLossError(
            f"non-finite {stage} loss ({value}) at step {step} with "
            f"{type(head).__name__}: lower the learning rate or check the precision"
        )


def check_hidden_sizes(head: Head, backbone_output_size: int | None) -> None:
    if head.hidden_size != backbone_output_size:
        raise ModelConfigError(
            f"head.hidden_size ({head.hidden_size}) must equal the backbone's output size "
            f"({backbone_output_size}): build the head with hidden_size={backbone_output_size} "
            f"(the CLI links it from the backbone)"
        )


def tie_head(head: Head, embedding_weight: torch.nn.Parameter) -> None:
    """Tie the head's output embeddings to the backbone's input embedding (``tie_weights``);
    a head that has none to tie is named with the option that unties it."""
    if type(head).tie_output_embedding is Head.tie_output_embedding:
        raise ModelConfigError(
            f"{type(head).__name__} does not support weight tying: set model.tie_weights false"
        )
    head.tie_output_embedding(embedding_weight)


def restore_data_state(datamodule: Any, checkpoint: dict[str, Any]) -> None:
    """The data module's state (its vocabulary, which it checks against the data's) from a
    checkpoint that holds one for its class; taken out of the checkpoint, so that Lightning,
    which restores data modules after the weights, does not restore it a second time."""
    key = type(datamodule).__qualname__
    if datamodule is not None and key in checkpoint:
        datamodule.load_state_dict(checkpoint[key])
        del checkpoint[key]


def head_class_name(head: Head) -> str:
    return f"{type(head).__module__}.{type(head).__qualname__}"


def check_checkpoint_head(checkpoint: dict[str, Any], head: Head) -> None:
    """Refuse a checkpoint of another head, or one this head cannot load, before Lightning
    loads the weights (which would fail with a list of missing and unexpected keys)."""
    saved = checkpoint.get(HEAD_KEY)
    # by class name: a head's module may move (DS-Softmax moved into heads/ds/), its checkpoints
    # stay valid
    if saved is not None and saved.rsplit(".", 1)[-1] != type(head).__qualname__:
        raise CheckpointMismatchError(
            f"the checkpoint was trained with {saved.rsplit('.', 1)[-1]}, not "
            f"{type(head).__name__}: set --model.head.class_path {saved} (and its options)"
        )
    state = checkpoint.get("state_dict", {})
    head_state = {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}
    if head_state:
        head.check_state_dict(head_state)
