"""DS-Softmax experts re-given the classes their tokens need (our step, not the paper's)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from app.callbacks.ds.optim import DSCallback, change_structure, find_ds_head, head_inputs
from app.callbacks.training.resume import resumed_mid_epoch
from heads.cross_entropy import IGNORE_INDEX
from heads.errors import HeadConfigError


class DSTargetClasses(DSCallback):
    """Re-select each expert's classes from the targets of the training tokens routed to it.

    The group lasso decides which rows survive by their norms; on PTB that left the target
    of 28% of test tokens outside the expert their context selected, and cost about 0.5
    top-10 points of the 0.65 the DS model lost to the softmax. Counting instead, during
    training epoch ``epoch``, how often each class is the target of a token the gate (Eq. 1)
    sends to each expert, and at the end of that epoch giving expert ``k`` exactly

        the classes with ``count_k(c) >= min_count``, plus the rows it already had for
        classes with ``count_k(c) >= drop_below``,

    covers more of what each expert is asked with fewer rows. Rows that already existed keep
    their weights (and Adam moments); added rows start at zero, the logit 0 Algorithm 1 gives
    a pruned class in the training loss, so adding them leaves that loss unchanged and the
    following epochs train them.

    ``keep_every_class``: a class that would be left in no expert keeps one row, in the expert
    whose tokens have it as target most often (one it had a row in, on a tie). Without it,
    classes too rare to be counted leave every expert: on PTB about 5k of 10k classes, a
    quarter of the rows, for no measurable top-k accuracy.

    Counts are summed over DDP ranks, so every rank builds the same structure; a run resumed
    inside epoch ``epoch`` counts from where it resumed. Logs ``ds/target_classes_added`` and
    ``ds/target_classes_dropped``. Place it after the other DS callbacks, once their
    structure is final (``DSPruning``'s ``stop_epoch``, the last ``Mitosis`` split).

    Args:
        epoch: the training epoch whose tokens are counted; the classes change at its end.
        min_count: an expert gets every class that is the target of at least this many of
            its tokens in that epoch.
        drop_below: an expert loses the rows of classes that are the target of fewer of its
            tokens (0: it keeps every row it had).
        keep_every_class: no class that had a row is left without an expert.
    """

    def __init__(
        self,
        epoch: int,
        min_count: int = 4,
        drop_below: int = 0,
        keep_every_class: bool = True,
    ) -> None:
        if epoch < 0:
            raise HeadConfigError(f"epoch must be non-negative, got {epoch}")
        if min_count < 1 or drop_below < 0:
            raise HeadConfigError(
                f"min_count must be positive and drop_below non-negative, got {min_count} "
                f"and {drop_below}"
            )
        self.epoch = epoch
        self.min_count = min_count
        self.drop_below = drop_below
        self.keep_every_class = keep_every_class
        self.done = False
        self.added_rows = 0
        self.dropped_rows = 0
        self._counts: torch.Tensor | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if resumed_mid_epoch(trainer):  # this epoch gets no on_train_epoch_start
            self.on_train_epoch_start(trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.done or trainer.current_epoch != self.epoch:
            return
        _, head = find_ds_head(pl_module)
        self._counts = torch.zeros(head.num_experts, head.vocab_size, device=pl_module.device)

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        """Count the step's tokens, routed by the gate the step used (before the optimizer
        moves it): every row, ignored ones weighted 0, so no data-dependent shape."""
        counts = self._counts
        if counts is None:
            return
        _, head = find_ds_head(pl_module)
        hidden, target = head_inputs(pl_module)
        with torch.no_grad():
            expert, _ = head.select(hidden)
        cell = expert * counts.size(1) + target.clamp_min(0)
        counts.view(-1).index_add_(0, cell, (target != IGNORE_INDEX).to(counts.dtype))

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._counts is not None:  # set in epoch ``epoch`` only, cleared once done
            self.reselect(trainer, pl_module)

    def reselect(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Rebuild the experts' classes from the counted targets (all ranks, same result)."""
        _, head = find_ds_head(pl_module)
        counts = trainer.strategy.reduce(self._counts, reduce_op="sum").cpu()
        had = head.membership()
        keep = (counts >= self.min_count) | (had & (counts >= self.drop_below))
        if self.keep_every_class:  # one row, where the class is most often a target
            orphans = (had.any(dim=0) & ~keep.any(dim=0)).nonzero().squeeze(1)
            where = (counts + 0.5 * had)[:, orphans].argmax(dim=0)  # ties: where it was
            keep[where, orphans] = True
        if not bool(keep.any()):
            raise HeadConfigError(
                f"DSTargetClasses left no class in any expert: no class was the target of "
                f"{self.min_count} tokens of one expert in epoch {self.epoch} (lower min_count)"
            )
        before = head.weight.size(0)
        expert, classes = keep.nonzero(as_tuple=True)
        rows, _ = change_structure(
            trainer, pl_module, lambda head: head.set_expert_classes(expert, classes)
        )
        self.added_rows = int((rows < 0).sum())
        self.dropped_rows = before - (rows.numel() - self.added_rows)
        self.done, self._counts = True, None
        for key, value in (("added", self.added_rows), ("dropped", self.dropped_rows)):
            pl_module.log(f"ds/target_classes_{key}", float(value), on_epoch=True, on_step=False)

    def state_dict(self) -> dict[str, Any]:
        return {
            "done": self.done,
            "added_rows": self.added_rows,
            "dropped_rows": self.dropped_rows,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.done = state_dict["done"]
        self.added_rows = state_dict["added_rows"]
        self.dropped_rows = state_dict["dropped_rows"]
