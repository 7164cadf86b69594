"""Re-learns the Hybrid-LightRNN table between epochs (the paper's optimal-transport step)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_info

from app.callbacks.training.progress import side_progress
from app.callbacks.training.resume import resumed_mid_epoch
from datamodules.bptt import BPTTBatches
from datamodules.errors import DataConfigError
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from datamodules.vocab.table_assignment import reassign
from heads import IGNORE_INDEX
from lightning_modules.backbones import LMBackbone


def word_of_each_code(vocab: HybridLightRNNVocab, codes: torch.Tensor) -> torch.Tensor:
    """For a valid code stream, the word id each code belongs to (both codes of a rare word
    carry its id)."""
    K, d1, d2 = vocab.num_frequent, vocab.rows, vocab.cols
    slots = vocab.layout_of_code[codes.long()]
    words = slots.to(codes.dtype)  # a frequent word's slot is its word id
    rows = ((slots >= K) & (slots < K + d1)).nonzero().squeeze(1)
    if len(rows) and rows[-1] + 1 >= len(codes):
        raise ValueError("the code stream ends inside a rare word")
    cells = (slots[rows] - K) * d2 + slots[rows + 1] - K - d1
    rare = vocab.word_at[cells].to(codes.dtype)
    words[rows] = rare
    words[rows + 1] = rare
    return words


@contextlib.contextmanager
def _as_it_is(model: L.LightningModule) -> Iterator[None]:
    """Eval mode (no dropout) and no gradients: the costs of the model as it is."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


class _Eq6Costs:
    """The sums of the separable Eq. 6 cost, ``R [num_rare, d1]`` and ``Cc [num_rare, d2]``
    (float64, on the model's device), added to batch by batch."""

    def __init__(self, model: L.LightningModule, vocab: HybridLightRNNVocab) -> None:
        self.vocab, self.device = vocab, model.device
        self.row = torch.zeros(vocab.num_rare, vocab.rows, dtype=torch.float64, device=self.device)
        self.col = torch.zeros(vocab.num_rare, vocab.cols, dtype=torch.float64, device=self.device)
        self.layout_of_code = vocab.layout_of_code.to(self.device)
        K, d1 = vocab.num_frequent, vocab.rows
        self.kinds = [  # (sums, the slots of the code kind, their code ids)
            (self.row, K, K + d1, vocab.row_codes.to(self.device)),
            (self.col, K + d1, len(vocab), vocab.col_codes.to(self.device)),
        ]
        # The distribution the loss trains (``Head.training_log_prob``): for DS-Softmax, finite
        # where its sparse inference ``log_prob`` is -inf outside the selected expert.
        self.log_prob = model.head.training_log_prob

    def add(self, hidden: torch.Tensor, targets: torch.Tensor, words: torch.Tensor) -> None:
        """``hidden [n, d]`` predicts the codes ``targets [n]``; ``words [n]``: the word each
        target code belongs to. Adds ``-log P(row r | context)`` for every row r at each rare
        word's first code, and the columns' at its second."""
        slots = self.layout_of_code[targets.to(self.device).long()]
        words = words.to(self.device)
        for sums, first, stop, codes in self.kinds:
            where = (slots >= first) & (slots < stop)
            if where.any():
                log_probs = self.log_prob(hidden[where])[:, codes]
                sums.index_add_(0, words[where] - self.vocab.num_frequent, -log_probs.double())


def eq6_costs(
    model: L.LightningModule,
    vocab: HybridLightRNNVocab,
    codes: torch.Tensor,
    batch_size: int,
    bptt: int,
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    advance: Callable[[], None] = lambda: None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The separable Eq. 6 cost of every rare word over the code stream ``codes``.

    ``R[i, r] = sum_k -log P(row r | Z_{k,1})`` over the occurrences k of rare word
    ``K + i`` and ``Cc[i, c] = sum_k -log P(column c | Z_{k,2})``: the model reads the
    current encoding as context, and each code is scored independently of the other (the
    paper's two independence approximations), so ``C[i, (r, c)] = R[i, r] + Cc[i, c]``.
    ``model`` must have ``backbone`` and ``head`` (``LanguageModel``); ``advance`` is called
    after each batch (a progress bar).
    """
    words = word_of_each_code(vocab, codes)
    code_batches = BPTTBatches(codes, batch_size, bptt, rank, world_size)
    word_batches = BPTTBatches(words, batch_size, bptt, rank, world_size)
    state, costs = None, _Eq6Costs(model, vocab)
    with _as_it_is(model):
        for step, ((inputs, targets), (_, target_words)) in enumerate(
            zip(code_batches, word_batches, strict=True)
        ):
            if max_batches is not None and step >= max_batches:
                break
            hidden, state = model.backbone(inputs.to(costs.device), state)
            state = LMBackbone.detach_state(state)
            hidden = hidden.reshape(-1, hidden.size(-1))
            costs.add(hidden, targets.reshape(-1), target_words.reshape(-1))
            advance()
    return costs.row, costs.col


def eq6_costs_translation(
    model: L.LightningModule,
    vocab: HybridLightRNNVocab,
    batches: Iterable[dict[str, torch.Tensor]],
    max_batches: int | None = None,
    advance: Callable[[], None] = lambda: None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`eq6_costs` for a translation model over a Hybrid-LightRNN target: the context of
    a reference's code is the source sentence and the reference before it (teacher forcing,
    as in training), ``batches`` the data module's translation batches."""
    costs = _Eq6Costs(model, vocab)
    with _as_it_is(model):
        for step, batch in enumerate(batches):
            if max_batches is not None and step >= max_batches:
                break
            targets = batch["target_output"]
            kept = targets != IGNORE_INDEX
            codes = targets[kept]  # each reference's codes, whole lines one after the other
            keys = ("source", "source_padding", "target_input")
            hidden = model.backbone(*(batch[key].to(costs.device) for key in keys))
            costs.add(hidden[kept.to(costs.device)], codes, word_of_each_code(vocab, codes))
            advance()
    return costs.row, costs.col


class LightRNNTableReassignment(L.Callback):
    """Every ``every_n_epochs`` training epochs, re-assigns the rare words to the cells of the
    Hybrid-LightRNN table by the optimal-transport objective (Eq. 3) with the Eq. 6 cost of
    the current model, keeping a bijection. A language model's table, or a translation's
    target table: there a code's context is the source sentence and the reference before it.

    Runs at the end of a training epoch (after its validation) and schedules the new table:
    the data module installs it when the next training epoch starts, so that epoch trains
    and validates with it; until then the vocabulary keeps the table the weights were trained
    with, so a checkpoint saved at this epoch's end tests with that table and resumes with
    the new one (both are in the data module's state, hence in every checkpoint). The code
    embeddings stay with their codes (a word that moves reads its new row's and column's
    embeddings, as in LightRNN). Not after the last epoch; a fit resumed from that epoch's
    checkpoint with more epochs re-learns it when it starts (the callback's state records
    the epoch of the last re-learning), as the uninterrupted run did after that epoch.

    Logs ``lightrnn/objective_before`` and ``lightrnn/objective_after`` (Eq. 3 with the Eq. 6
    cost), ``lightrnn/lower_bound`` (certified), ``lightrnn/moved`` (share of rare words that
    changed cell), ``lightrnn/seen`` (share of rare words in the scored sample: only these
    move), ``lightrnn/seconds``, and a text view of some table rows (TensorBoard, as the
    paper's Table 6).

    Args:
        every_n_epochs: re-assign after epochs n, 2n, ...
        max_batches: score only the first windows of the training stream (a sample), None
            for all of it; in translation, the first batches of the epoch's shuffled order.
            Words absent from the sample keep their cells.
        batch_size: parallel streams while scoring (larger is faster; the costs differ only
            where a stream starts without context), rounded up to a multiple of the DDP ranks
            (:func:`scoring_streams`); translation scores in its training batches
            (``data.max_tokens``).
        solver: ``auto`` (exact for small tables), ``exact`` or ``separable``.
        log_rows: table rows shown in TensorBoard.
    """

    def __init__(
        self,
        every_n_epochs: int = 1,
        max_batches: int | None = None,
        batch_size: int = 64,
        solver: str = "auto",
        log_rows: int = 10,
    ) -> None:
        if every_n_epochs < 1 or batch_size < 1:
            raise DataConfigError(
                f"LightRNNTableReassignment every_n_epochs and batch_size must be positive, got "
                f"{every_n_epochs} and {batch_size}"
            )
        if max_batches is not None and max_batches < 1:
            # 0 or less scored nothing, so every word was 'unseen' and the table never moved
            raise DataConfigError(
                f"LightRNNTableReassignment max_batches must be positive (or null: all the "
                f"training data), got {max_batches}"
            )
        if solver not in ("auto", "exact", "separable"):
            raise DataConfigError(
                f"LightRNNTableReassignment solver must be 'auto', 'exact' or 'separable', got "
                f"{solver!r}"
            )
        self.every_n_epochs = every_n_epochs
        self.max_batches = max_batches
        self.batch_size = batch_size
        self.solver = solver
        self.log_rows = log_rows
        self.last: dict[str, float] = {}
        self.last_cells: torch.Tensor | None = None
        # the epoch (0-based) after which the table was last re-learnt; None: not yet, or a
        # checkpoint written before this was saved
        self.relearnt_after: int | None = None
        self._restored = False  # a checkpoint's state was loaded (fit --ckpt_path)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        vocab = _coded_vocab(trainer.datamodule)
        if not isinstance(vocab, HybridLightRNNVocab):
            side = "target " if _translates(trainer.datamodule) else ""
            raise DataConfigError(
                "LightRNNTableReassignment needs data.vocab=hybrid_lightrnn "
                f"(the data module's {side}vocabulary is {type(vocab).__name__})"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"relearnt_after": self.relearnt_after}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.relearnt_after = state_dict.get("relearnt_after")
        self._restored = "relearnt_after" in state_dict

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Resumed at the end of an epoch whose re-learning was due but skipped (it was then
        # the last epoch: the run is resumed with more): the uninterrupted run re-learnt
        # after it, so this run does now, before the next epoch's first pass installs the
        # table it schedules. (Mid-epoch, the checkpoint was written after the epoch before
        # had scheduled its table.)
        restored, self._restored = self._restored, False
        finished = trainer.current_epoch - 1  # the checkpoint's last finished epoch
        if not restored or resumed_mid_epoch(trainer) or finished < 0:
            return
        if (finished + 1) % self.every_n_epochs == 0 and self.relearnt_after != finished:
            self.reassign_now(trainer, pl_module, after_epoch=finished)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch + 1
        # a table learnt after the last epoch would never be trained on; -1 (or None): the run
        # ends by steps or time, so no epoch is known to be the last
        last = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= epoch
        # nor after the epoch that trainer.max_steps ends (Lightning ends the epoch there): the
        # fit stops, and one resumed with more steps continues that epoch, re-learning at its
        # end as the longer fit does (its last.ckpt was written before this hook)
        max_steps = getattr(trainer, "max_steps", -1)
        steps_done = max_steps is not None and 0 <= max_steps <= trainer.global_step
        if epoch % self.every_n_epochs or last or steps_done or trainer.should_stop:
            return
        self.reassign_now(trainer, pl_module)

    def reassign_now(
        self, trainer: L.Trainer, pl_module: L.LightningModule, after_epoch: int | None = None
    ) -> dict[str, Any]:
        """Re-learn the table now, schedule it for the next training pass and log its figures
        (``lightrnn/*``, returned). ``after_epoch``: the epoch it follows, by default the
        current one (a resumed fit's first: the epoch its checkpoint ended)."""
        start = time.perf_counter()
        after_epoch = trainer.current_epoch if after_epoch is None else after_epoch
        data = trainer.datamodule
        vocab: HybridLightRNNVocab = _coded_vocab(data)
        if _translates(data):
            batches: Sized = data.table_scoring_dataloader()
        else:
            codes = data.split_tokens("train")
            bptt, rank, world = data.hparams.bptt, trainer.global_rank, trainer.world_size
            streams = scoring_streams(self.batch_size, len(codes), world)
            batches = BPTTBatches(codes, streams, bptt, rank, world)
        total = len(batches) if self.max_batches is None else min(len(batches), self.max_batches)
        description = f"Hybrid-LightRNN table: scoring (Eq. 6) {total} training batches"
        with side_progress(trainer, description, total) as advance:
            with trainer.precision_plugin.forward_context():
                if _translates(data):
                    row_cost, col_cost = eq6_costs_translation(
                        pl_module, vocab, batches, self.max_batches, advance
                    )
                else:
                    row_cost, col_cost = eq6_costs(
                        pl_module, vocab, codes, streams, bptt, self.max_batches,
                        rank, world, advance,
                    )  # fmt: skip
        # every rank scored its own streams; the costs are summed over them
        row_cost = trainer.strategy.reduce(row_cost, reduce_op="sum")
        col_cost = trainer.strategy.reduce(col_cost, reduce_op="sum")
        # words absent from the scored sample have no cost: they keep their cells
        seen = (row_cost.sum(1) + col_cost.sum(1) > 0).cpu().numpy()
        result = None
        if trainer.is_global_zero:  # rank 0 solves, every rank installs its table: the
            # separable solver's matching rounds stop on a time budget, so ranks solving
            # for themselves could end with different tables
            cells = vocab.cells.numpy()
            result = reassign(row_cost, col_cost, cells, solver=self.solver, movable=seen)
        result = trainer.strategy.broadcast(result, src=0)
        new_cells = torch.from_numpy(result.cells)
        vocab.schedule_cells(new_cells)
        self.last_cells = new_cells
        self.relearnt_after = after_epoch
        self.last = {
            "lightrnn/objective_before": result.before,
            "lightrnn/objective_after": result.after,
            "lightrnn/lower_bound": result.lower_bound,
            "lightrnn/moved": result.moved,
            "lightrnn/seen": float(seen.mean()) if len(seen) else 0.0,
            "lightrnn/seconds": time.perf_counter() - start,
        }
        if after_epoch == trainer.current_epoch:
            for name, value in self.last.items():
                pl_module.log(name, value, on_epoch=True, sync_dist=False)
        else:  # made up as a resumed fit starts: at the step the uninterrupted run logged them,
            # as the float32 values self.log gives the loggers
            logged = {name: torch.tensor(value).item() for name, value in self.last.items()}
            for logger in trainer.loggers:
                logger.log_metrics(logged, step=max(trainer.global_step - 1, 0))
        rank_zero_info(
            f"Hybrid-LightRNN table re-learnt after epoch {after_epoch} in "
            f"{self.last['lightrnn/seconds']:.1f} s: {result.moved:.1%} of the rare words moved; "
            f"Eq. 3 objective {result.before:.6g} -> {result.after:.6g} "
            f"(lower bound {result.lower_bound:.6g})"
        )
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                # two trailing spaces: line breaks in TensorBoard's markdown
                text = vocab.with_cells(new_cells).table_text(self.log_rows).replace("\n", "  \n")
                logger.experiment.add_text("lightrnn/table", text, trainer.global_step)
        return self.last


def scoring_streams(batch_size: int, num_tokens: int, world_size: int) -> int:
    """The number of BPTT streams the scoring pass cuts the training codes into:
    ``batch_size`` rounded up to a multiple of the ranks (each scores its own block of streams,
    and ``BPTTBatches`` splits them evenly: the default 64 on 3 or 6 ranks raised after the
    first epoch's training), and no more than the codes fill with 2 tokens each (a small
    corpus), whatever ``batch_size``."""
    streams = -(-batch_size // world_size) * world_size
    most = num_tokens // 2 // world_size * world_size
    return max(world_size, min(streams, most))


def _translates(data: object) -> bool:
    """Whether the data module is a translation's (its target side is the coded one)."""
    return hasattr(data, "target_vocab")


def _coded_vocab(data: object) -> object:
    """The vocabulary whose table is re-learnt: a language model's, a translation's target."""
    return getattr(data, "target_vocab" if _translates(data) else "vocab", None)
