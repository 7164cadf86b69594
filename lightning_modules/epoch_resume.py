"""A training epoch resumed where a mid-epoch checkpoint stopped it, for every task.

The data position is the training loader's (``datamodules/resumable.py``: Lightning saves its
``state_dict`` and hands it back). What else the epoch had built up is the task's: the running
sums of its training metrics (the epoch's train perplexity) and, for a recurrent language model,
the state carried from window to window; and the random generators the epoch's dropout and
noise draw from (Lightning saves none). A checkpoint written mid-epoch keeps them under
:data:`TRAIN_STATE_KEY` (every rank's, under DDP: each has its own streams, sums and
generators), and the resumed run gives them back before its first batch, so its epoch ends as
the uninterrupted one would have.

A checkpoint written inside a gradient-accumulation window (``accumulate_grad_batches`` k, a
validation every n batches with n not a multiple of k) also keeps the gradient the window's
batches so far have summed (:data:`GRADIENTS_KEY`; under DDP its mean over the ranks, each of
which summed its own without a sync): the resumed fit gives it back before the window's next
backward, so the window's step is the uninterrupted fit's (before, it was of the batches after
the checkpoint alone).
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.apply_func import apply_to_collection
from torchmetrics import Metric

from datamodules.resumable import ResumableLoader

log = logging.getLogger(__name__)

TRAIN_STATE_KEY = "train_epoch_state"
# the gradient of an accumulation window's batches so far, in a checkpoint written inside one
GRADIENTS_KEY = "accumulated_gradients"
# the same entry as the language model wrote it before translation resumed mid-epoch too
_EARLIER_KEYS = ("language_model_train_state",)


def resumable_loader(trainer: L.Trainer | None) -> ResumableLoader | None:
    """The fit's training loader where it keeps its position, else None."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return None
    loader = trainer.train_dataloader
    return loader if isinstance(loader, ResumableLoader) else None


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's generators that training draws from (dropout, gate noise): the CPU's,
    and the device's on CUDA."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Give the generators of :func:`rng_states` back their saved states."""
    # clone: a rank's row of the gathered states is a view at an offset, which
    # torch.set_rng_state reads from its storage's start (torch 2.13: a segfault)
    torch.set_rng_state(states["cpu"].cpu().clone())
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].cpu().clone(), device)


def save_epoch_state(module: L.LightningModule, checkpoint: dict[str, Any],
                     metrics: dict[str, Metric], state: Any) -> None:  # fmt: skip
    """Write the epoch's ``metrics`` sums, ``state`` and random generators into
    ``checkpoint`` (called on every rank: under DDP they are gathered)."""
    sums = {
        name: {key: value.detach().clone() for key, value in metric.metric_state.items()}
        for name, metric in metrics.items()
    }
    rng = rng_states(module.device)
    world_size = module.trainer.world_size
    if world_size > 1:  # each rank carries its own streams, sums and generators: keep all
        rng = {name: value.to(module.device) for name, value in rng.items()}  # (NCCL: on GPU)
        state, sums, rng = module.all_gather((state, sums, rng))
    checkpoint[TRAIN_STATE_KEY] = {
        "world_size": world_size,
        "state": apply_to_collection(state, torch.Tensor, lambda t: t.detach().cpu()),
        "metrics": {name: {k: v.cpu() for k, v in values.items()} for name, values in sums.items()},
        "rng": {name: value.cpu() for name, value in rng.items()},
    }
    save_accumulated_gradients(module, checkpoint)


def save_accumulated_gradients(module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
    """Inside an accumulation window (the last batch trained did not step): the gradient its
    batches have summed, under :data:`GRADIENTS_KEY` (module docstring). Called on every rank.

    Under DDP each rank summed its own batches' gradients (no sync until the window's step),
    and the step averages the ranks' sums: given the ranks' mean of the partial sums back,
    every rank's sum at the step averages to the same gradient. Only where the parameters are
    whole on each rank (one device, DDP), and only there: sharded strategies keep no whole
    gradient to save."""
    trainer = module.trainer
    strategy = trainer.strategy
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
        return
    if not trainer.fit_loop.epoch_loop._should_accumulate():  # (Lightning's own test)
        return
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    # a parameter no batch of the window reached has no gradient: it stays without one (an
    # optimizer skips it), unless another rank's batches reached it
    present = [p.grad is not None for _, p in params]
    if trainer.world_size > 1:
        counts = torch.tensor(present, dtype=torch.float32, device=module.device)
        present = [n > 0 for n in strategy.reduce(counts, reduce_op="sum").tolist()]
    gradients = {}
    for (name, p), has in zip(params, present, strict=True):
        if not has:
            continue
        grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        if trainer.world_size > 1:
            grad = strategy.reduce(grad, reduce_op="mean")
        gradients[name] = grad.cpu()
    checkpoint[GRADIENTS_KEY] = {
        "accumulate_grad_batches": trainer.accumulate_grad_batches,
        "gradients": gradients,
    }


def read_epoch_state(checkpoint: dict[str, Any], trainer: L.Trainer | None) -> dict | None:
    """This rank's ``{"state", "metrics", "rng"}`` from a checkpoint written by as many
    processes as this run has, else None (another world size starts the epoch's sums afresh;
    a fit resumed mid-epoch says so in a warning line).
    ``rng`` is None in a checkpoint written before the generators were saved."""
    saved = next((checkpoint[k] for k in (TRAIN_STATE_KEY, *_EARLIER_KEYS) if k in checkpoint),
                 None)  # fmt: skip
    if saved is None or trainer is None:
        return None
    if saved["world_size"] != trainer.world_size:
        fitting = getattr(getattr(trainer, "state", None), "fn", None) == TrainerFn.FITTING
        if fitting and (batch := _saved_position(checkpoint)):
            _warn_other_world_size(saved["world_size"], trainer.world_size, batch)
        return None
    # (an entry only where the checkpoint was written inside an accumulation window)
    gradients = _saved_gradients(checkpoint, trainer)
    window = {} if gradients is None else {"gradients": gradients}
    if saved["world_size"] == 1:
        return {"rng": None, **saved, **window}
    rank = trainer.global_rank
    rng = saved.get("rng")
    return {
        **window,
        "rng": None if rng is None else {name: value[rank] for name, value in rng.items()},
        "state": apply_to_collection(saved["state"], torch.Tensor, lambda t: t[rank]),
        "metrics": {
            name: {key: value[rank] for key, value in values.items()}
            for name, values in saved["metrics"].items()
        },
    }


def restore_accumulated_gradients(module: L.LightningModule, saved: dict | None) -> None:
    """Give the parameters back the gradient of the accumulation window a checkpoint was
    written inside (``saved``: :func:`read_epoch_state`'s ``"gradients"``; None: nothing to
    give). Call at the resumed fit's first batch, before its backward: Lightning clears the
    gradients when the fit starts (``Trainer._run_stage``) and then only at a window's first
    batch, so that batch and the window's others add to it."""
    if not saved:
        return
    params = dict(module.named_parameters())
    for name, grad in saved.items():
        p = params.get(name)
        if p is not None and p.shape == grad.shape:
            p.grad = grad.to(p.device, p.dtype)


def _saved_gradients(checkpoint: dict[str, Any], trainer: L.Trainer) -> dict | None:
    """The gradient of the accumulation window a checkpoint was written inside, for a fit
    that accumulates as many batches (another ``accumulate_grad_batches`` puts the windows
    elsewhere: None, said in a warning line), else None."""
    saved = checkpoint.get(GRADIENTS_KEY)
    if saved is None:
        return None
    if saved["accumulate_grad_batches"] != trainer.accumulate_grad_batches:
        fitting = getattr(getattr(trainer, "state", None), "fn", None) == TrainerFn.FITTING
        if fitting:
            _warn_other_accumulation(saved["accumulate_grad_batches"],
                                     trainer.accumulate_grad_batches)  # fmt: skip
        return None
    return saved["gradients"]


@rank_zero_only
def _warn_other_accumulation(saved: int, ours: int) -> None:
    log.warning(
        f"warning: the checkpoint was written inside a window of accumulate_grad_batches "
        f"{saved}, and this fit accumulates {ours}: the gradient of that window's batches so "
        f"far is dropped, and its next step is of the batches after the checkpoint alone"
    )


def _saved_position(checkpoint: dict[str, Any]) -> int:
    """The batch of its epoch a checkpoint stopped at (the training loader's saved position:
    0 at an epoch's end or without one)."""
    fit_loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    loaders = (fit_loop.get("state_dict") or {}).get("combined_loader") or []
    return max((int(s.get("batches_served", 0)) for s in loaders if isinstance(s, dict)),
               default=0)  # fmt: skip


@rank_zero_only
def _warn_other_world_size(saved: int, ours: int, batch: int) -> None:
    """A mid-epoch resume on another number of processes: what it does not carry over."""
    processes = {n: f"{n} process{'es' if n > 1 else ''}" for n in (saved, ours)}
    log.warning(
        f"warning: resumed at batch {batch} of an epoch from a checkpoint of "
        f"{processes[saved]}, on {processes[ours]}: the epoch's train/ppl sums, the recurrent "
        f"state carried between windows and dropout's generators start afresh (each process "
        f"saved its own, for its share of the data): this epoch's train/ppl counts its batches "
        f"from here, and the run is not the one an uninterrupted fit makes"
    )


def restore_metrics(metrics: dict[str, Metric], saved: dict[str, dict],
                    device: torch.device) -> None:  # fmt: skip
    """Give ``metrics`` back the sums a checkpoint saved."""
    for name, metric in metrics.items():
        for key, value in saved.get(name, {}).items():
            setattr(metric, key, value.to(device))
        metric._update_count = max(metric._update_count, 1)  # holds values: no warning


def mark_position(trainer: L.Trainer, loader: ResumableLoader, batch_idx: int) -> None:
    """The data position a checkpoint saves: batch ``batch_idx`` is being trained on; after the
    epoch's last batch the next pass starts from the beginning."""
    done = batch_idx + 1
    loader.mark_consumed(0 if done >= trainer.num_training_batches else done)
