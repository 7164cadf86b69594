"""Shared by the DS-Softmax callbacks: find the head, change its structure and rebuild the
optimizers (and the DDP wrapper) around it."""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from heads.ds.softmax import DSSoftmaxHead
from heads.errors import HeadConfigError


def find_ds_head(pl_module: L.LightningModule) -> tuple[str, DSSoftmaxHead]:
    """``(name, head)`` of the module's one :class:`DSSoftmaxHead`."""
    found = [(n, m) for n, m in pl_module.named_modules() if isinstance(m, DSSoftmaxHead)]
    if len(found) != 1:
        raise HeadConfigError(
            f"DS-Softmax callbacks need exactly one DSSoftmaxHead in the model, found "
            f"{len(found)}: give --model.head heads.DSSoftmaxHead (configs/ds/ holds DS "
            f"settings) or leave out the DS callbacks"
        )
    return found[0]


class DSCallback(L.Callback):
    """A callback that works on the model's DS-Softmax head: the head checked once the model is
    set up, before any data is read or step run (found missing at the first pruning, a run
    had trained for hours)."""

    # the global step at the previous train batch's end (optimizer_stepped)
    _last_step = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        find_ds_head(pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step

    def optimizer_stepped(self, trainer: L.Trainer) -> bool:
        """Whether the batch that just ended ran an optimizer step; call it at every train
        batch's end. Under ``accumulate_grad_batches`` the other batches end inside a window
        whose gradients are not applied yet: a structure changed there replaces the
        parameters that hold them, and the window's step loses those batches' gradient for
        the head (Algorithm 1 changes the experts after the update, lines 4-11). Its global
        step also repeats the previous batch's, so a check due at that step ran twice."""
        stepped = trainer.global_step != self._last_step
        self._last_step = trainer.global_step
        return stepped


def head_inputs(pl_module: L.LightningModule) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden, target)`` of the step the task just ran through its head (``HeadTask``'s
    ``head_inputs``): what callbacks read in their batch hooks instead of hooking the head's
    forward, which runs inside its compiled graph under ``model.compile``."""
    inputs = getattr(pl_module, "head_inputs", None)
    if inputs is None:
        raise HeadConfigError(
            f"{type(pl_module).__name__} ran no step through HeadTask.head_loss: DS-Softmax "
            f"and top-k callbacks read the head's inputs from it"
        )
    return inputs


StructureChange = Callable[[DSSoftmaxHead], "tuple[torch.Tensor, torch.Tensor] | None"]


def change_structure(
    trainer: L.Trainer, pl_module: L.LightningModule, change: StructureChange
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Apply ``change`` to the module's DS head and rebuild the optimizers around it.

    ``change(head)`` replaces the head's experts (prune, split, new classes) and returns the
    old indices of the new ``(rows, gate rows)`` (``-1``: a new row), or ``None`` when it left
    the head as it was. Returns what ``change`` returned.
    """
    name, head = find_ds_head(pl_module)
    old = dict(pl_module.named_parameters())
    sources = change(head)
    if sources is not None:
        prefix = f"{name}." if name else ""
        rows, gate_rows = sources
        rebuild_optimizers(
            trainer, pl_module, old, {f"{prefix}weight": rows, f"{prefix}gate": gate_rows}
        )
    return sources


def rebuild_optimizers(
    trainer: L.Trainer,
    pl_module: L.LightningModule,
    old_parameters: dict[str, nn.Parameter],
    sources: dict[str, torch.Tensor],
) -> None:
    """Rebuild the optimizers through Lightning after parameters were replaced.

    ``old_parameters``: ``named_parameters()`` taken before the change. ``sources[name]``: for a
    replaced parameter, the old row index of each new row (``-1``: a new row, fresh state);
    its per-row optimizer state (e.g. Adam moments) is carried over by those indices.
    Unchanged parameters keep their state, and the param groups' hyper-parameters (a learning
    rate a scheduler lowered) and the schedulers' states carry over too.
    """
    if not trainer.optimizers:
        return
    old_states = [
        {name: opt.state.get(param) for name, param in old_parameters.items()}
        for opt in trainer.optimizers
    ]
    old_groups = [
        [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        for opt in trainer.optimizers
    ]
    old_schedulers = [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]
    rewrap_distributed_model(trainer)
    trainer.strategy.setup_optimizers(trainer)
    new_parameters = dict(pl_module.named_parameters())
    for opt, states, groups in zip(trainer.optimizers, old_states, old_groups, strict=False):
        if len(groups) == len(opt.param_groups):
            for group, old in zip(opt.param_groups, groups, strict=True):
                group.update(old)
        for name, param in new_parameters.items():
            state = states.get(name)
            if not state:
                continue
            if name in sources:
                rows, old_shape = sources[name], old_parameters[name].shape
                state = {
                    key: _take_rows(value, rows)
                    if isinstance(value, torch.Tensor) and value.shape == old_shape
                    else value
                    for key, value in state.items()
                }
            opt.state[param] = state
    for config, old in zip(trainer.lr_scheduler_configs, old_schedulers, strict=False):
        config.scheduler.load_state_dict(old)


def _take_rows(value: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``value[rows]``, zero where ``rows`` is ``-1`` (a row that did not exist)."""
    rows = rows.to(value.device)
    taken = value[rows.clamp_min(0)]
    return taken.masked_fill_((rows < 0).view(-1, *([1] * (taken.dim() - 1))), 0)


def rewrap_distributed_model(trainer: L.Trainer) -> None:
    """Re-wrap the module in a fresh ``DistributedDataParallel`` after its parameters changed.

    DDP's reducer is built for the parameters it wrapped: a replaced parameter (new rows,
    new experts) would not be all-reduced, and its gradient hooks would point at the old
    tensor. Lightning's own ``DDPStrategy.configure_ddp`` wraps the bare LightningModule again
    (with the strategy's DDP options and communication hooks); the new wrapper broadcasts
    rank 0's parameters and buffers, so every rank continues from identical weights. Every
    rank must call this at the same point (the DS callbacks decide identically on all ranks).
    A no-op without DDP.
    """
    strategy = trainer.strategy
    if not isinstance(strategy, DDPStrategy) or not isinstance(
        strategy.model, DistributedDataParallel
    ):
        return
    strategy.model = strategy.lightning_module
    strategy.configure_ddp()
