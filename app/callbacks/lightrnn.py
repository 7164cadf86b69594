"""Re-learns the Hybrid-LightRNN table between epochs (the paper's optimal-transport step)."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from datamodules.bptt import BPTTBatches
from datamodules.errors import DataConfigError
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from datamodules.vocab.table_assignment import reassign
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


@torch.no_grad()
def eq6_costs(
    model: L.LightningModule,
    vocab: HybridLightRNNVocab,
    codes: torch.Tensor,
    batch_size: int,
    bptt: int,
    max_batches: int | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The separable Eq. 6 cost of every rare word over the code stream ``codes``.

    ``R[i, r] = sum_k -log P(row r | Z_{k,1})`` over the occurrences k of rare word
    ``K + i`` and ``Cc[i, c] = sum_k -log P(column c | Z_{k,2})``: the model reads the
    current encoding as context, and each code is scored independently of the other (the
    paper's two independence approximations), so ``C[i, (r, c)] = R[i, r] + Cc[i, c]``.
    ``model`` must have ``backbone`` and ``head`` (``LanguageModel``).
    """
    K, d1, d2 = vocab.num_frequent, vocab.rows, vocab.cols
    device = model.device
    layout_of_code = vocab.layout_of_code.to(device)
    row_cost = torch.zeros(vocab.num_rare, d1, dtype=torch.float64, device=device)
    col_cost = torch.zeros(vocab.num_rare, d2, dtype=torch.float64, device=device)
    words = word_of_each_code(vocab, codes)
    code_batches = BPTTBatches(codes, batch_size, bptt, rank, world_size)
    word_batches = BPTTBatches(words, batch_size, bptt, rank, world_size)
    # The distribution the loss trains (``Head.training_log_prob``): for DS-Softmax, finite where
    # its sparse inference ``log_prob`` is -inf outside the selected expert (no feasible cost).
    log_prob = model.head.training_log_prob
    was_training = model.training
    model.eval()  # no dropout: the costs of the model as it is
    state = None
    try:
        for step, ((inputs, targets), (_, target_words)) in enumerate(
            zip(code_batches, word_batches, strict=True)
        ):
            if max_batches is not None and step >= max_batches:
                break
            hidden, state = model.backbone(inputs.to(device), state)
            state = LMBackbone.detach_state(state)
            hidden = hidden.reshape(-1, hidden.size(-1))
            target_words = target_words.reshape(-1)
            slots = layout_of_code[targets.reshape(-1).to(device).long()]
            for cost, first, size in ((row_cost, K, d1), (col_cost, K + d1, d2)):
                where = (slots >= first) & (slots < first + size)
                if where.any():
                    codes_of_kind = vocab.layout_codes[first : first + size].to(device)
                    log_probs = log_prob(hidden[where])[:, codes_of_kind]
                    rare = target_words[where.cpu()].to(device) - K
                    cost.index_add_(0, rare, -log_probs.double())
    finally:
        model.train(was_training)
    return row_cost, col_cost


class LightRNNTableReassignment(L.Callback):
    """Every ``every_n_epochs`` training epochs, re-assigns the rare words to the cells of the
    Hybrid-LightRNN table by the optimal-transport objective (Eq. 3) with the Eq. 6 cost of
    the current model, keeping a bijection.

    Runs at the end of a training epoch (after its validation) and schedules the new table:
    the data module installs it when the next training epoch starts, so that epoch trains
    and validates with it; until then the vocabulary keeps the table the weights were trained
    with, so a checkpoint saved at this epoch's end tests with that table and resumes with
    the new one (both are in the data module's state, hence in every checkpoint). The code
    embeddings stay with their codes (a word that moves reads its new row's and column's
    embeddings, as in LightRNN). Not after the last epoch.

    Logs ``lightrnn/objective_before`` and ``lightrnn/objective_after`` (Eq. 3 with the Eq. 6
    cost), ``lightrnn/lower_bound`` (certified), ``lightrnn/moved`` (share of rare words that
    changed cell), ``lightrnn/seen`` (share of rare words in the scored sample: only these
    move), ``lightrnn/seconds``, and a text view of some table rows (TensorBoard, as the
    paper's Table 6).

    Args:
        every_n_epochs: re-assign after epochs n, 2n, ...
        max_batches: score only the first windows of the training stream (a sample), None
            for all of it. Words absent from the sample keep their cells.
        batch_size: parallel streams while scoring (larger is faster, same costs).
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

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if hasattr(trainer.datamodule, "target_vocab"):  # (Eq. 6's cost is the LM's)
            raise DataConfigError(
                "LightRNNTableReassignment re-learns the table of a language model only; a "
                "translation's Hybrid-LightRNN target keeps its initial table: drop the callback"
            )
        vocab = getattr(trainer.datamodule, "vocab", None)
        if not isinstance(vocab, HybridLightRNNVocab):
            raise DataConfigError(
                "LightRNNTableReassignment needs data.vocab=hybrid_lightrnn "
                f"(the data module's vocabulary is {type(vocab).__name__})"
            )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch + 1
        last = trainer.max_epochs is not None and epoch >= trainer.max_epochs
        if epoch % self.every_n_epochs or last or trainer.should_stop:
            return
        self.reassign_now(trainer, pl_module)

    def reassign_now(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        start = time.perf_counter()
        data = trainer.datamodule
        vocab: HybridLightRNNVocab = data.vocab
        with trainer.precision_plugin.forward_context():
            row_cost, col_cost = eq6_costs(
                pl_module,
                vocab,
                data.split_tokens("train"),
                self.batch_size,
                data.hparams.bptt,
                self.max_batches,
                trainer.global_rank,
                trainer.world_size,
            )
        # every rank scored its own streams; all solve the same summed problem identically
        row_cost = trainer.strategy.reduce(row_cost, reduce_op="sum")
        col_cost = trainer.strategy.reduce(col_cost, reduce_op="sum")
        # words absent from the scored sample have no cost: they keep their cells
        seen = (row_cost.sum(1) + col_cost.sum(1) > 0).cpu().numpy()
        result = reassign(row_cost, col_cost, vocab.cells.numpy(), solver=self.solver, movable=seen)
        new_cells = torch.from_numpy(result.cells)
        vocab.schedule_cells(new_cells)
        self.last_cells = new_cells
        self.last = {
            "lightrnn/objective_before": result.before,
            "lightrnn/objective_after": result.after,
            "lightrnn/lower_bound": result.lower_bound,
            "lightrnn/moved": result.moved,
            "lightrnn/seen": float(seen.mean()) if len(seen) else 0.0,
            "lightrnn/seconds": time.perf_counter() - start,
        }
        for name, value in self.last.items():
            pl_module.log(name, value, on_epoch=True, sync_dist=False)
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                # two trailing spaces: line breaks in TensorBoard's markdown
                text = vocab.with_cells(new_cells).table_text(self.log_rows).replace("\n", "  \n")
                logger.experiment.add_text("lightrnn/table", text, trainer.global_step)
        return self.last
