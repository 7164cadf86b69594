"""AWD-LSTM's learning rate per BPTT window: with variable windows (``data.variable_bptt``),
each optimizer step takes ``lr * T / bptt``, ``T`` the window's length, and the rate is
restored right after the step (salesforce/awd-lstm-lm ``main.py`` ``train()``: ``eff_lr = lr2 *
seq_len / args.bptt`` before the step, ``lr2`` back after it; zihangdai/mos ``main.py`` alike).
A window of T steps carries a mean loss over T steps; the scaled rate makes a long window
count for more, as its tokens do.

The scale multiplies whatever rate the step would have taken (a plateau schedule's, a
warm-up's, NT-ASGD's): it is applied inside ``optimizer.step`` (a step pre-hook) and undone in
its post-hook, so every reader outside the step (``LearningRateMonitor``, the schedulers'
steps, the plateau scheduler's, NT-ASGD's switch, a checkpoint) sees the unscaled rate, and
gradient clipping, which Lightning applies before the step, sees the unscaled gradient, as in
the reference. A step the AMP grad scaler skips (inf gradients) takes neither hook.

``torch.optim.ASGD`` (AWD-LSTM's NT-ASGD) updates with the step size ``eta`` it computed from
the rate at the previous step, not the current rate: the hooks scale the parameters' ``eta``
too, and afterwards set it to what ASGD computes from the unscaled rate, so the step of a
window of T takes ``lr * T / bptt`` there too (exactly so with AWD-LSTM's ``lambd = 0``).
(The reference, which switches from SGD to ASGD, scales only the rate: once on ASGD, its
steps took the previous window's scale.)

Gradient accumulation (``trainer.accumulate_grad_batches = k``): the step's gradient is the
mean of its k windows' gradients (Lightning divides each loss by k); the step's scale is the
mean of their lengths over ``bptt``, i.e. the tokens of the step over ``k * bptt``.

The optimizers are hooked as they appear in ``trainer.optimizers`` (checked before every
batch), so an optimizer built anew mid-run (DS-Softmax's mitosis) is hooked too.
"""

from __future__ import annotations

import weakref
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_modules.errors import ModelConfigError


class WindowLR(Callback):
    """Args:
    bptt: the window length at which the rate is the optimizer's; unset: the data module's
        ``bptt`` (``data.bptt``).
    """

    # the language-modelling data module looks for it: variable windows without a callback
    # that scales the rate get a warning
    scales_lr_by_window = True

    def __init__(self, bptt: int | None = None) -> None:
        if bptt is not None and (not isinstance(bptt, int) or bptt <= 0):
            raise ModelConfigError(f"WindowLR bptt must be a positive integer, got {bptt!r}")
        self.bptt = bptt
        self.windows: list[int] = []  # window lengths of the batches since the last step
        self._step_of_windows: int | None = None  # trainer.global_step when they began
        self._hooked: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = (
            weakref.WeakKeyDictionary()
        )
        self._saved: list[tuple[dict, float]] | None = None  # (group, unscaled lr) mid-step

    def _bptt(self, trainer: L.Trainer) -> int:
        if self.bptt is not None:
            return self.bptt
        hparams = getattr(getattr(trainer, "datamodule", None), "hparams", {})
        bptt = hparams.get("bptt") if hasattr(hparams, "get") else None
        if not isinstance(bptt, int) or bptt <= 0:
            raise ModelConfigError(
                "WindowLR scales the learning rate by T / bptt but the data module has no "
                "bptt: give the callback's init_args.bptt"
            )
        return bptt

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._bptt(trainer)  # fail before training without a bptt

    def on_train_batch_start(self, trainer, pl_module, batch: Any, batch_idx: int) -> None:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else None
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
            raise ModelConfigError(
                "WindowLR scales the learning rate by a BPTT window's length: it needs a "
                "language model's (inputs [B, T], targets) batches"
            )
        if self._step_of_windows != trainer.global_step:  # a step was taken (or skipped)
            self.windows, self._step_of_windows = [], trainer.global_step
        self.windows.append(int(inputs.size(1)))
        for optimizer in trainer.optimizers:
            if optimizer not in self._hooked:
                self._hooked[optimizer] = (
                    optimizer.register_step_pre_hook(self._scale_hook(trainer)),
                    optimizer.register_step_post_hook(self._restore),
                )

    def scale(self, trainer: L.Trainer) -> float:
        """The factor of the coming step: the mean window length since the last step over
        ``bptt`` (1 before any batch)."""
        if not self.windows:
            return 1.0
        return sum(self.windows) / len(self.windows) / self._bptt(trainer)

    def _scale_hook(self, trainer: L.Trainer):
        trainer_ref = weakref.ref(trainer)

        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            trainer = trainer_ref()
            if trainer is None or self._saved is not None:
                return
            factor = self.scale(trainer)
            self._saved = [(group, group["lr"]) for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * factor
            for _, state in _asgd_states(optimizer):
                state["eta"].mul_(factor)  # the step size this step updates with

        return hook

    def _restore(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._saved is None:
            return
        for group, lr in self._saved:
            group["lr"] = lr
        self._saved = None
        self.windows = []
        # what ASGD computes after its step from the rate (torch/optim/asgd.py), from the
        # unscaled one: the next step's scale then applies to the rate it would take.
        # On the device (ASGD keeps ``step`` and ``eta`` there): nothing read back
        for group, state in _asgd_states(optimizer):
            lr, lambd, alpha = group["lr"], group["lambd"], group["alpha"]
            step = state["step"].to(state["eta"].dtype)
            state["eta"].copy_(lr / (1 + lambd * lr * step).pow(alpha))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for pre, post in self._hooked.values():
            pre.remove()
            post.remove()
        self._hooked = weakref.WeakKeyDictionary()


def _asgd_states(optimizer: torch.optim.Optimizer):
    """``(param group, parameter state)`` of each ASGD parameter that has stepped (has an
    ``eta``); nothing for another optimizer."""
    if not isinstance(optimizer, torch.optim.ASGD):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and "eta" in state:
                yield group, state
