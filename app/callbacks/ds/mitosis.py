"""Mitosis training of DS-Softmax (Algorithm 2): start with few experts, double on a schedule."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from app.callbacks.ds.optim import DSCallback, change_structure, find_ds_head
from app.callbacks.training.resume import resumed_mid_epoch
from app.cli.errors import warn_line
from heads.errors import HeadConfigError


class Mitosis(DSCallback):
    """Double the experts every ``every_n_epochs`` epochs until ``max_experts``.

    Algorithm 2 splits once Algorithm 1 (training with pruning) has made the experts sparse:
    that is what keeps mitosis cheap in memory. With ``max_peak_softmaxes`` a due split waits
    (checked every ``check_every_n_steps`` optimizer steps) until pruning has shrunk the
    experts enough that the split stays within that many softmax layers, parent and children
    counted together; the next split is then due ``every_n_epochs`` after this one.

    Each split clones every expert's surviving rows (plus Gaussian noise) and its gate row
    (see :meth:`heads.ds.softmax.DSSoftmaxHead.split_experts`), then rebuilds the optimizer
    through Lightning, carrying the Adam moments of the parent rows to both twins. The noise
    comes from a generator seeded by ``seed`` and the split count, identical on every rank.

    The split count is this callback's checkpoint state, the expert structure the head's: a
    resumed run neither repeats nor skips a split. ``peak_rows`` records the most expert rows
    held at once, in units of one softmax layer (``V`` rows), logged as
    ``ds/peak_memory_softmaxes``.

    Args:
        max_experts: K to reach.
        every_n_epochs: epochs between splits (split at epochs N, 2N, ...).
        noise_std: Gaussian noise added to the clones: ``noise_std`` times each row's RMS
            per element, and ``noise_std`` times the gate rows' mean norm per gate element
            (``sqrt(d)`` times larger relative to a gate row; ``split_experts`` says why).
        rescale_rows: double the cloned rows so the loss is continuous through a split (see
            ``DSSoftmaxHead.split_experts``).
        max_peak_softmaxes: memory budget of a split in units of one softmax layer (``V``
            rows): the rows before the split plus the rows after it, both held while the new
            packed tensor is built. ``None``: split on schedule whatever the size.
        check_every_n_steps: how often a postponed split re-checks the budget.
    """

    def __init__(
        self,
        max_experts: int = 64,
        every_n_epochs: int = 15,
        noise_std: float = 0.01,
        seed: int = 0,
        rescale_rows: bool = True,
        max_peak_softmaxes: float | None = None,
        check_every_n_steps: int = 25,
    ) -> None:
        if max_experts < 1 or every_n_epochs < 1 or check_every_n_steps < 1:
            raise HeadConfigError(
                "max_experts, every_n_epochs and check_every_n_steps must be positive"
            )
        if max_peak_softmaxes is not None and max_peak_softmaxes <= 0:
            raise HeadConfigError(f"max_peak_softmaxes must be positive, got {max_peak_softmaxes}")
        if noise_std < 0:
            raise HeadConfigError(f"noise_std must be non-negative, got {noise_std}")
        self.max_experts = max_experts
        self.every_n_epochs = every_n_epochs
        self.noise_std = noise_std
        self.seed = seed
        self.rescale_rows = rescale_rows
        self.max_peak_softmaxes = max_peak_softmaxes
        self.check_every_n_steps = check_every_n_steps
        self.splits = 0
        self.peak_rows = 0
        self.last_split_epoch = 0  # splits are due every_n_epochs after the previous one

    def _due(self, trainer: L.Trainer, head) -> bool:
        return (
            head.num_experts < self.max_experts
            and trainer.current_epoch >= self.last_split_epoch + self.every_n_epochs
        )

    def split_peak_rows(self, head) -> int:
        """Rows held while the next split builds its new packed tensor: before + after."""
        k_new = min(2 * head.num_experts, self.max_experts)
        twins = sum(head.expert_sizes()[: k_new - head.num_experts])
        return 2 * head.weight.size(0) + twins

    def _fits(self, head) -> bool:
        if self.max_peak_softmaxes is None:
            return True
        return self.split_peak_rows(head) <= self.max_peak_softmaxes * head.vocab_size

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _, head = find_ds_head(pl_module)
        if self.max_experts > head.vocab_size:  # more experts than classes only duplicate
            warn_line(
                f"Mitosis max_experts ({self.max_experts}) exceeds the {head.vocab_size} "
                f"classes: splitting stops at {head.vocab_size} experts"
            )
            self.max_experts = head.vocab_size

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if resumed_mid_epoch(trainer):  # this epoch gets no on_train_epoch_start (its split,
            self.on_train_epoch_start(trainer, pl_module)  # if any, is done)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _, head = find_ds_head(pl_module)
        if self._due(trainer, head) and self._fits(head):
            self.split(trainer, pl_module)
        self._record_peak(head)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # logged at the epoch's end, not its start: a split that the memory budget postponed
        # into the epoch counts in the epoch's figures (logged at its start, they showed the
        # experts before it, over DSMonitor's count of the validation just run)
        _, head = find_ds_head(pl_module)
        self._record_peak(head)
        pl_module.log("ds/num_experts", float(head.num_experts), on_epoch=True, on_step=False)
        pl_module.log(
            "ds/peak_memory_softmaxes",
            self.peak_rows / head.vocab_size,
            on_epoch=True,
            on_step=False,
        )

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        _, head = find_ds_head(pl_module)
        # a split postponed for memory happens as soon as pruning has made room (after an
        # optimizer step: not inside an accumulation window)
        stepped = self.optimizer_stepped(trainer)
        due = stepped and trainer.global_step % self.check_every_n_steps == 0
        if due and self._due(trainer, head):
            if self._fits(head):
                self.split(trainer, pl_module)
        self._record_peak(head)

    def split(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        _, head = find_ds_head(pl_module)
        before = head.weight.size(0)
        generator = torch.Generator().manual_seed(self.seed + self.splits)
        change_structure(
            trainer,
            pl_module,
            lambda head: head.split_experts(
                self.noise_std, self.max_experts, generator, self.rescale_rows
            ),
        )
        self.splits += 1
        self.last_split_epoch = trainer.current_epoch
        # parent and children coexist during the split: count both for the peak
        self.peak_rows = max(self.peak_rows, before + head.weight.size(0))

    def _record_peak(self, head) -> None:
        self.peak_rows = max(self.peak_rows, head.weight.size(0))

    def state_dict(self) -> dict[str, Any]:
        return {
            "splits": self.splits,
            "peak_rows": self.peak_rows,
            "last_split_epoch": self.last_split_epoch,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.splits = state_dict["splits"]
        self.peak_rows = state_dict["peak_rows"]
        # checkpoints from before the memory budget: splits happened at epochs N, 2N, ...
        self.last_split_epoch = state_dict.get(
            "last_split_epoch", self.splits * self.every_n_epochs
        )
