import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from app.callbacks import Mitosis
from datamodules import SyntheticHierarchyDataModule
from heads import DSSoftmaxHead
from lightning_modules import Classifier
from lightning_modules.backbones import MLPBackbone

pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(dm, num_experts=2) -> Classifier:
    return Classifier(
        MLPBackbone(dm.input_size, 16),
        DSSoftmaxHead(16, dm.vocab_size, num_experts=num_experts),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
    )


def trainer(epochs, callbacks, **options) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    return L.Trainer(max_epochs=epochs, callbacks=callbacks, **{**defaults, **options})


class RecordSplits(Callback):
    """Loss of one fixed batch just before and just after each epoch's mitosis."""

    def __init__(self, batch) -> None:
        self.batch, self.before, self.after, self.experts = batch, [], [], []

    def loss(self, pl_module) -> float:
        with torch.no_grad():
            x, y = self.batch
            return float(pl_module.head(pl_module.backbone(x), y).loss)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # runs after Mitosis (callbacks run in list order): record the post-split state
        self.after.append(self.loss(pl_module))
        self.experts.append(pl_module.head.num_experts)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.before.append(self.loss(pl_module))


def test_mitosis_doubles_experts_continuously_and_optimizer_follows():
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=4, train_per_sub=16, batch_size=32)
    model = make_model(dm)
    mitosis = Mitosis(max_experts=8, every_n_epochs=1, noise_std=0.01)
    record = RecordSplits(next(iter(dm.val_dataloader())))
    t = trainer(4, [mitosis, record])
    t.fit(model, dm)
    assert record.experts == [2, 4, 8, 8]
    assert mitosis.splits == 2
    # the loss right after a split equals the loss right before it (up to the clone noise)
    for before, after in zip(record.before[:2], record.after[1:3], strict=True):
        assert after == pytest.approx(before, abs=0.05)
    (optimizer,) = t.optimizers
    assert optimizer.state[model.head.weight]["exp_avg"].shape == model.head.weight.shape
    assert optimizer.state[model.head.gate]["exp_avg"].shape == (8, 16)
    # without pruning the peak is the last split: 4 experts' rows plus their 8 children
    assert mitosis.peak_rows == (4 + 8) * dm.vocab_size


def test_resume_continues_the_schedule(tmp_path):
    torch.manual_seed(0)
    # 8 classes: room for the 8 experts (Mitosis stops at the number of classes)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=4, train_per_sub=4, batch_size=32)
    model = make_model(dm)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    t = trainer(2, [Mitosis(8, every_n_epochs=1), checkpoint], enable_checkpointing=True)
    t.fit(model, dm)
    assert model.head.num_experts == 4
    fresh, mitosis = make_model(dm), Mitosis(8, every_n_epochs=1)
    resumed = trainer(3, [mitosis])
    resumed.fit(fresh, dm, ckpt_path=str(tmp_path / "last.ckpt"))
    assert mitosis.splits == 2  # one more split at epoch 2, the first one not repeated
    assert fresh.head.num_experts == 8


def test_bad_options():
    with pytest.raises(ValueError, match="positive"):
        Mitosis(every_n_epochs=0)


def test_memory_budget_postpones_a_split_until_pruning_made_room():
    """With ``max_peak_softmaxes`` a due split waits while it would hold more rows than the
    budget (before + after, counted honestly), and happens once pruning has shrunk the experts;
    the recorded peak then stays within the budget."""
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=4, train_per_sub=16, batch_size=32)
    model = make_model(dm)
    vocab = dm.vocab_size
    mitosis = Mitosis(max_experts=4, every_n_epochs=1, max_peak_softmaxes=4.0,
                      check_every_n_steps=1)  # fmt: skip

    class PruneAtEpoch2(Callback):
        """Stand-in for DSPruning: keep one expert's full rows and a quarter of the other's."""

        def on_train_epoch_start(self, trainer, pl_module) -> None:
            head = pl_module.head
            if trainer.current_epoch == 2 and head.weight.size(0) == 2 * vocab:
                with torch.no_grad():
                    head.weight[vocab:][torch.arange(vocab) % 4 != 0] = 0.0
                from app.callbacks.ds.optim import rebuild_optimizers

                old = dict(pl_module.named_parameters())
                rows, gate_rows = head.prune(gamma=1e-6)
                rebuild_optimizers(trainer, pl_module, old,
                                   {"head.weight": rows, "head.gate": gate_rows})  # fmt: skip

    experts = []

    class Record(Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            experts.append(pl_module.head.num_experts)

    t = trainer(4, [PruneAtEpoch2(), mitosis, Record()])
    t.fit(model, dm)
    # epochs 0-1: 2V rows, a split would hold 2V + 4V > 4V; after pruning at epoch 2 it fits
    assert experts == [2, 2, 4, 4]
    rows = vocab + vocab // 4
    assert mitosis.peak_rows == 3 * rows <= 4 * vocab


def test_max_experts_beyond_the_classes_stops_at_the_classes(capsys):
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=2, train_per_sub=8, batch_size=32)
    model, mitosis = make_model(dm), Mitosis(max_experts=8, every_n_epochs=1)
    trainer(3, [mitosis]).fit(model, dm)
    assert model.head.num_experts == 4 == dm.vocab_size
    assert (
        "warning: Mitosis max_experts (8) exceeds the 4 classes: splitting stops at 4 experts"
        in capsys.readouterr().err.splitlines()
    )


def test_an_epoch_resumed_inside_logs_its_experts_without_splitting_again(tmp_path):
    """Lightning gives the epoch a fit resumes inside no ``on_train_epoch_start``: the split
    was made before the checkpoint and is not repeated; the epoch's figures are still logged."""
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=4, train_per_sub=16, batch_size=8)
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    options = dict(limit_val_batches=0, enable_checkpointing=True)
    trainer(2, [Mitosis(8, every_n_epochs=1), every], **options).fit(make_model(dm), dm)
    # epoch 1 (16 batches an epoch) split 2 -> 4 experts at its start, then step 20 was saved
    fresh, mitosis = make_model(dm), Mitosis(8, every_n_epochs=1)
    resumed = trainer(2, [mitosis], limit_val_batches=0)
    resumed.fit(fresh, dm, ckpt_path=str(tmp_path / "epoch=1-step=20.ckpt"))
    assert mitosis.splits == 1 and fresh.head.num_experts == 4
    assert float(resumed.callback_metrics["ds/num_experts"]) == 4.0
    assert "ds/peak_memory_softmaxes" in resumed.callback_metrics


def test_a_split_postponed_into_an_epoch_counts_in_the_epochs_logged_figures():
    """A split the memory budget postponed happens inside an epoch (here at step 21, once a
    prune at step 20 made room): that epoch's ``ds/num_experts`` and
    ``ds/peak_memory_softmaxes`` include it. (Logged at the epoch's start, they showed the
    experts before it, over DSMonitor's count after the validation, and the split's peak
    only an epoch later.)"""
    from app.callbacks import DSMonitor
    from app.callbacks.ds.optim import change_structure

    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=4, train_per_sub=16, batch_size=8)
    vocab = dm.vocab_size  # 8 classes, 16 batches an epoch

    def keep_a_quarter_of_the_second_expert(head):
        with torch.no_grad():
            head.weight[vocab:][torch.arange(vocab) % 4 != 0] = 0.0
        return head.prune(gamma=1e-6)

    class PruneAtStep20(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if trainer.global_step == 20:
                change_structure(trainer, pl_module, keep_a_quarter_of_the_second_expert)

    logged = []

    class Logged(Callback):  # after Mitosis: what the epoch logged, against the head
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            metrics = trainer.callback_metrics
            logged.append((pl_module.head.num_experts, float(metrics["ds/num_experts"]),
                           float(metrics["ds/peak_memory_softmaxes"])))  # fmt: skip

    mitosis = Mitosis(max_experts=4, every_n_epochs=1, max_peak_softmaxes=4.0,
                      check_every_n_steps=1)  # fmt: skip
    t = trainer(3, [mitosis, PruneAtStep20(), DSMonitor(), Logged()])
    t.fit(make_model(dm), dm)
    # rows before the split: 8 + 2; after it 20: the peak 30 rows, 3.75 softmax layers
    assert mitosis.peak_rows == 30
    assert logged == [(2, 2.0, 2.0), (4, 4.0, 3.75), (4, 4.0, 3.75)]


def test_under_gradient_accumulation_a_postponed_split_waits_for_an_optimizer_step():
    """A split due inside an epoch (postponed for memory) happens at the end of an
    accumulation window, not on a batch whose gradient is accumulated but not yet applied
    (the split replaces the head's parameters, and the window's step would lose it)."""
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=4, train_per_sub=16, batch_size=8)
    model = make_model(dm)  # 128 points: 16 batches an epoch, 8 optimizer steps
    splits = []

    class Postponed(Mitosis):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            pass  # as if the budget postponed it: the split comes from the batch checks

        def split(self, trainer, pl_module) -> None:
            splits.append((trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx))
            super().split(trainer, pl_module)

    mitosis = Postponed(max_experts=4, every_n_epochs=1, check_every_n_steps=1)
    t = trainer(2, [mitosis], accumulate_grad_batches=2)
    t.fit(model, dm)
    assert splits == [(1, 1)]  # epoch 1's first window ends at its batch 1
    assert model.head.num_experts == 4
