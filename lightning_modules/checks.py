"""Errors and checks the task modules share: they name the option or input to fix."""

from __future__ import annotations

from typing import Any

import torch

from lightning_modules.errors import CheckpointMismatchError, ModelConfigError, NonFiniteLossError

HEAD_KEY = "head_class"


def check_finite_loss(loss: torch.Tensor, stage: str, step: int, head: torch.nn.Module) -> None:
    if not torch.isfinite(loss):
        raise NonFiniteLossError(
            f"non-finite {stage} loss ({float(loss)}) at step {step} with "
            f"{type(head).__name__}: lower the learning rate or check the precision"
        )


def check_hidden_sizes(head: Any, backbone_output_size: int | None) -> None:
    if head.hidden_size != backbone_output_size:
        raise ModelConfigError(
            f"head.hidden_size ({head.hidden_size}) must equal the backbone's output size "
            f"({backbone_output_size}): build the head with hidden_size={backbone_output_size} "
            f"(the CLI links it from the backbone)"
        )


def save_head_class(checkpoint: dict[str, Any], head: torch.nn.Module) -> None:
    checkpoint[HEAD_KEY] = f"{type(head).__module__}.{type(head).__qualname__}"


def check_checkpoint_head(checkpoint: dict[str, Any], head: torch.nn.Module) -> None:
    """Refuse a checkpoint of another head before Lightning loads the weights (which would
    fail with a list of missing and unexpected state-dict keys)."""
    saved = checkpoint.get(HEAD_KEY)
    current = f"{type(head).__module__}.{type(head).__qualname__}"
    if saved is not None and saved != current:
        raise CheckpointMismatchError(
            f"the checkpoint was trained with {saved.rsplit('.', 1)[-1]}, not "
            f"{type(head).__name__}: set --model.head.class_path {saved} (and its options)"
        )
    state = checkpoint.get("state_dict", {})
    saved_keys = {k.removeprefix("head.") for k in state if k.startswith("head.")}
    expected = set(head.state_dict())
    if saved_keys and saved_keys != expected:
        raise CheckpointMismatchError(
            f"the checkpoint's head has other parameters than this {type(head).__name__} "
            f"(missing {sorted(expected - saved_keys)[:3]}, unexpected "
            f"{sorted(saved_keys - expected)[:3]}): configure the head it was trained with"
        )
    # A head with its own loading resizes itself to the saved structure (DS-Softmax experts);
    # one with extra state checks its saved options itself (adaptive: names the cut-offs).
    if (
        type(head)._load_from_state_dict is not torch.nn.Module._load_from_state_dict
        or type(head).get_extra_state is not torch.nn.Module.get_extra_state
    ):
        return
    for name, value in head.state_dict().items():
        saved_value = state.get(f"head.{name}")
        if isinstance(saved_value, torch.Tensor) and saved_value.shape != value.shape:
            raise CheckpointMismatchError(
                f"the checkpoint's {type(head).__name__} has {name} of shape "
                f"{tuple(saved_value.shape)}, this one {tuple(value.shape)}: set the head "
                f"options (sizes, components, cut-offs) the checkpoint was trained with"
            )


def head_structure(head: torch.nn.Module) -> dict[str, Any]:
    """What must be equal on every DDP rank: the head's class, parameter and buffer shapes,
    and options chosen at build time (adaptive cut-offs)."""
    return {
        "class": type(head).__name__,
        "shapes": {
            name: tuple(value.shape)
            for name, value in head.state_dict().items()
            if isinstance(value, torch.Tensor)
        },
        "cutoffs": list(getattr(head, "cutoffs", None) or []),
    }


def check_head_agrees_across_ranks(trainer: Any, head: torch.nn.Module) -> None:
    """Refuse to train when DDP ranks built different heads (rather than DDP failing on a
    parameter shape it cannot explain). An option computed per process, such as adaptive
    ``cutoffs: auto`` (timed on each process), can differ between ranks. Every rank sees all
    ranks' structures and raises the same error, so none waits for the others."""
    if trainer is None or trainer.world_size <= 1 or not torch.distributed.is_initialized():
        return
    structures: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(structures, head_structure(head))
    message = describe_rank_difference(structures)
    if message:
        raise ModelConfigError(message)


def describe_rank_difference(structures: list[dict[str, Any]]) -> str | None:
    """None if every rank's head structure equals rank 0's, else the error to show."""
    rank0 = structures[0]
    for rank, other in enumerate(structures):
        if other == rank0:
            continue
        if other["cutoffs"] != rank0["cutoffs"]:
            return (
                f"the DDP ranks chose different {rank0['class']} cut-offs "
                f"({rank0['cutoffs'][:-1]} on rank 0, {other['cutoffs'][:-1]} on rank {rank}): "
                f"'auto' times each process; pass --model.head.init_args.cutoffs "
                f"'{rank0['cutoffs'][:-1]}' (or a cost_model)"
            )
        return (
            f"the DDP ranks built different heads (rank 0: {rank0['class']} {rank0['shapes']}; "
            f"rank {rank}: {other['class']} {other['shapes']}): give every rank the same options"
        )
    return None
