"""Checks the task modules share: they name the option or input to fix."""

from __future__ import annotations

from typing import Any

import torch

from heads import Head
from heads.errors import CheckpointMismatchError
from lightning_modules.errors import ModelConfigError, NonFiniteLossError

HEAD_KEY = "head_class"


def check_finite_loss(loss: torch.Tensor, stage: str, step: int, head: torch.nn.Module) -> None:
    if not torch.isfinite(loss):
        raise NonFiniteLossError(
            f"non-finite {stage} loss ({float(loss.detach())}) at step {step} with "
            f"{type(head).__name__}: lower the learning rate or check the precision"
        )


def check_hidden_sizes(head: Head, backbone_output_size: int | None) -> None:
    if head.hidden_size != backbone_output_size:
        raise ModelConfigError(
            f"head.hidden_size ({head.hidden_size}) must equal the backbone's output size "
            f"({backbone_output_size}): build the head with hidden_size={backbone_output_size} "
            f"(the CLI links it from the backbone)"
        )


def head_class_name(head: Head) -> str:
    return f"{type(head).__module__}.{type(head).__qualname__}"


def check_checkpoint_head(checkpoint: dict[str, Any], head: Head) -> None:
    """Refuse a checkpoint of another head, or one this head cannot load, before Lightning
    loads the weights (which would fail with a list of missing and unexpected keys)."""
    saved = checkpoint.get(HEAD_KEY)
    if saved is not None and saved != head_class_name(head):
        raise CheckpointMismatchError(
            f"the checkpoint was trained with {saved.rsplit('.', 1)[-1]}, not "
            f"{type(head).__name__}: set --model.head.class_path {saved} (and its options)"
        )
    state = checkpoint.get("state_dict", {})
    head_state = {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")}
    if head_state:
        head.check_state_dict(head_state)
