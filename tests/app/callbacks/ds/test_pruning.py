from functools import partial
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from app.callbacks import DSPruning
from app.callbacks.ds.optim import rebuild_optimizers
from datamodules import SyntheticHierarchyDataModule
from heads import DSSoftmaxHead
from lightning_modules import Classifier
from lightning_modules.backbones import MLPBackbone

pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(dm, num_experts=4, lr=1e-2, **head_options) -> Classifier:
    return Classifier(
        MLPBackbone(dm.input_size, 32),
        DSSoftmaxHead(32, dm.vocab_size, num_experts=num_experts, **head_options),
        optimizer=lambda p: torch.optim.Adam(p, lr=lr),
    )


def trainer(epochs, callbacks, **options) -> L.Trainer:
    defaults = dict(
        accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    return L.Trainer(max_epochs=epochs, callbacks=callbacks, **{**defaults, **options})


class ShrinkRows(Callback):
    """Pushes half of every expert's rows below gamma after step 3 (before the pruning
    callback that follows it looks), so the pruning has work to do."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 3:
            head = pl_module.head
            with torch.no_grad():
                head.weight[(head.row_class + head.row_expert()) % 2 == 0] *= 1e-4


def test_pruning_rebuilds_the_optimizer_and_keeps_every_class():
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=20, batch_size=32)
    model = make_model(dm)
    pruning = DSPruning(gamma=0.01, every_n_steps=3)
    t = trainer(2, [ShrinkRows(), pruning])
    t.fit(model, dm)
    head = model.head
    assert head.weight.size(0) == 4 * 16 // 2 == pruning.pruned_rows
    assert pruning.peak_rows == 4 * 16 + 4 * 16 // 2  # old and new rows during the prune
    assert head.classes_without_expert().numel() == 0
    # the optimizer works on the new parameters, with state of the surviving rows' shape
    (optimizer,) = t.optimizers
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(head.weight) in params and id(head.gate) in params
    assert optimizer.state[head.weight]["exp_avg"].shape == head.weight.shape
    assert torch.isfinite(t.callback_metrics["val/loss"])


def test_no_pruning_above_the_loss_threshold():
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=2, train_per_sub=20, batch_size=20)
    model = make_model(dm)
    t = trainer(1, [ShrinkRows(), DSPruning(loss_threshold=1e-6, every_n_steps=1)])
    t.fit(model, dm)
    assert model.head.weight.size(0) == 4 * 4


def test_the_threshold_is_held_against_the_task_loss_alone():
    # translation logs train/loss with the head's regularisers and label smoothing, and its
    # task NLL as train/nll; the language model and classifier log their task loss as train/loss
    translation = {"train/loss": torch.tensor(5.0), "train/nll": torch.tensor(0.1)}
    assert DSPruning().task_loss_key(translation) == "train/nll"
    assert DSPruning().task_loss_key({"train/loss": torch.tensor(0.1)}) == "train/loss"
    assert DSPruning(loss_key="train/loss").task_loss_key(translation) == "train/loss"


def test_the_loss_is_read_back_only_when_a_check_is_due(monkeypatch):
    """The loss is summed on the device each batch and read back (a GPU sync) once per
    ``every_n_steps``: the check's mean, not every batch's loss."""
    reads = []
    for name in ("item", "__float__"):
        original = getattr(torch.Tensor, name)

        def read(tensor, original=original):
            import traceback

            reads.append(traceback.extract_stack(limit=2)[0].filename.endswith("pruning.py"))
            return original(tensor)

        monkeypatch.setattr(torch.Tensor, name, read)
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=2, train_per_sub=40, batch_size=8)
    t = trainer(1, [DSPruning(loss_threshold=1e-6, every_n_steps=5)], limit_val_batches=0)
    t.fit(make_model(dm), dm)
    assert t.global_step == 20 and sum(reads) == 20 // 5  # not one a batch


def test_no_pruning_and_no_lasso_from_stop_epoch():
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=2, train_per_sub=20, batch_size=20)
    model = make_model(dm, lambda_lasso=0.1, lambda_expert=0.1)
    t = trainer(1, [ShrinkRows(), DSPruning(every_n_steps=1, stop_epoch=0)])
    t.fit(model, dm)
    assert model.head.weight.size(0) == 4 * 4  # the shrunk rows were not pruned
    assert model.head.lambda_lasso == model.head.lambda_expert == 0.0


def test_memory_budget_makes_pruning_wait():
    """4 experts x 16 rows; the prune would keep 32 rows: 64 + 32 = 6 softmax layers of 16."""
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=20, batch_size=32)
    model = make_model(dm)
    pruning = DSPruning(gamma=0.01, every_n_steps=3, max_peak_softmaxes=5.9)
    trainer(1, [ShrinkRows(), pruning]).fit(model, dm)
    assert model.head.weight.size(0) == 4 * 16 and pruning.pruned_rows == 0
    pruning = DSPruning(gamma=0.01, every_n_steps=3, max_peak_softmaxes=6.0)
    trainer(1, [ShrinkRows(), pruning]).fit(model, dm)
    assert model.head.weight.size(0) == 4 * 16 // 2 and pruning.peak_rows == 6 * 16


def two_steps_of_two_experts() -> tuple[Classifier, L.Trainer]:
    """A 2-expert model and its trainer after two optimizer steps (Adam state to carry)."""
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=2, train_per_sub=10, batch_size=10)
    model = make_model(dm, num_experts=2)
    t = trainer(1, [], max_steps=2)
    t.fit(model, dm)
    return model, t


def test_rebuild_optimizers_carries_state_by_row():
    model, t = two_steps_of_two_experts()
    old = dict(model.named_parameters())
    old_state = {k: v.clone() for k, v in t.optimizers[0].state[model.head.weight].items()}
    old_backbone_state = t.optimizers[0].state[model.backbone.layers[0].weight]["exp_avg"]
    rows = torch.tensor([0, 2, 5])
    head = model.head
    head.set_structure(head.weight[rows], head.row_class[rows], [2, 1], head.gate)
    rebuild_optimizers(t, model, old, {"head.weight": rows, "head.gate": torch.arange(2)})
    state = t.optimizers[0].state
    torch.testing.assert_close(state[head.weight]["exp_avg"], old_state["exp_avg"][rows])
    torch.testing.assert_close(state[head.weight]["exp_avg_sq"], old_state["exp_avg_sq"][rows])
    assert state[model.backbone.layers[0].weight]["exp_avg"] is old_backbone_state


def test_new_rows_start_with_fresh_optimizer_state():
    model, t = two_steps_of_two_experts()
    head = model.head
    with torch.no_grad():  # experts of 4 and 2 classes, with Adam moments of their own
        head.set_structure(head.weight[:6], head.row_class[:6], [4, 2], head.gate)
    moments = torch.randn(6, head.row_size)
    t.optimizers[0].state[head.weight] = {"exp_avg": moments.clone(), "step": torch.tensor(2.0)}
    old = dict(model.named_parameters())
    # expert 0 keeps classes 0-3 and gets nothing new; expert 1 keeps 0, 1 and gains 2, 3
    rows, _ = head.set_expert_classes(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.arange(8) % 4)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
    rebuild_optimizers(t, model, old, {"head.weight": rows, "head.gate": torch.arange(2)})
    state = t.optimizers[0].state[head.weight]["exp_avg"]
    torch.testing.assert_close(state[:6], moments)
    assert not state[6:].any()


def test_resume_restores_pruned_structure(tmp_path):
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=20, batch_size=32)
    model = make_model(dm)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    t = trainer(
        1, [ShrinkRows(), DSPruning(every_n_steps=3), checkpoint], enable_checkpointing=True
    )
    t.fit(model, dm)
    sizes = model.head.expert_sizes()
    assert sum(sizes) < 4 * 16
    # a fresh, full model resumes with the pruned experts, masks and callback state
    fresh, pruning = make_model(dm), DSPruning(every_n_steps=3)
    resumed = trainer(2, [pruning], enable_checkpointing=False, limit_train_batches=1)
    resumed.fit(fresh, dm, ckpt_path=str(tmp_path / "last.ckpt"))
    assert fresh.head.expert_sizes() == sizes
    assert torch.equal(fresh.head.row_class, model.head.row_class)
    assert pruning.pruned_rows == 4 * 16 - sum(sizes)


def test_a_fit_resumed_inside_a_stopped_epoch_trains_without_the_lasso(tmp_path):
    """``stop_epoch`` turns the group-lasso and expert terms off at each epoch's start; the
    epoch a fit resumes inside gets no ``on_train_epoch_start`` from Lightning, and trained
    with them on again."""
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=20, batch_size=16)
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    options = dict(limit_val_batches=0, enable_checkpointing=True)
    make = partial(make_model, dm, lambda_lasso=0.1, lambda_expert=0.1)
    trainer(1, [DSPruning(stop_epoch=0), every], **options).fit(make(), dm)
    seen = []

    class Lambdas(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.append((pl_module.head.lambda_lasso, pl_module.head.lambda_expert))

    resumed = make()
    trainer(1, [DSPruning(stop_epoch=0), Lambdas()], limit_val_batches=0).fit(
        resumed, dm, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt")
    )
    assert seen and set(seen) == {(0.0, 0.0)}


def checks(pruning: DSPruning, losses: dict[int, float], world_size: int = 1) -> list[int]:
    """Feed ``pruning`` each step's logged task loss (``step -> loss``); the steps where it
    pruned."""
    pruned = []
    pruning.prune = lambda trainer, module: pruned.append(trainer.global_step)
    module = SimpleNamespace(device=torch.device("cpu"))
    for step, loss in losses.items():
        trainer = SimpleNamespace(
            callback_metrics={"train/loss": torch.tensor(loss)}, global_step=step,
            current_epoch=0, world_size=world_size,
            strategy=SimpleNamespace(reduce=lambda value, reduce_op: value),
        )  # fmt: skip
        pruning.on_train_batch_end(trainer, module, None, None, step - 1)
    return pruned


def test_a_checkpoint_inside_a_loss_window_keeps_the_window(tmp_path):
    """A fit stopped inside an ``every_n_steps`` window resumes with the losses the window
    had summed: the next decision is the uninterrupted run's (the batches since the resume
    alone read a mean of 9, above the threshold, where the window's is 6)."""
    losses = {1: 5.0, 2: 5.0, 3: 5.0, 4: 9.0}
    make = partial(DSPruning, loss_threshold=6.5, every_n_steps=4)
    assert checks(make(), losses) == [4]
    stopped = make()
    assert checks(stopped, {step: losses[step] for step in (1, 2, 3)}) == []
    torch.save({"DSPruning": stopped.state_dict()}, tmp_path / "state.pt")
    resumed = make()
    resumed.load_state_dict(torch.load(tmp_path / "state.pt")["DSPruning"])
    assert checks(resumed, {4: losses[4]}) == [4]
    # under DDP each rank's window goes on from the ranks' mean sum (every rank saves)
    checkpoint = {"callbacks": {stopped.state_key: stopped.state_dict()}}
    trainer = SimpleNamespace(
        world_size=2, strategy=SimpleNamespace(reduce=lambda value, reduce_op: value * 0 + 14)
    )
    stopped.on_save_checkpoint(trainer, SimpleNamespace(device=torch.device("cpu")), checkpoint)
    assert checkpoint["callbacks"][stopped.state_key]["loss_sum"] == 14.0


def hierarchy_purity(head: DSSoftmaxHead, dm: SyntheticHierarchyDataModule) -> float:
    """Mean share of each expert's classes that belong to its most common super class."""
    shares = []
    for k in range(head.num_experts):
        supers = dm.super_class(head.expert_classes(k).cpu())
        shares.append(torch.bincount(supers).max().item() / supers.numel())
    return sum(shares) / len(shares)


def test_ds_recovers_the_synthetic_hierarchy():
    """Appendix A / Figure 3(b): on 10x10 data each expert ends up with the sub classes of one
    (or a few) super classes. Random subsets of ~10 classes would score about 0.3."""
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=10, num_sub=10, train_per_sub=100)
    model = Classifier(
        MLPBackbone(dm.input_size, 64),
        DSSoftmaxHead(64, 100, num_experts=10, lambda_lasso=1e-3, lambda_expert=1e-3),
        optimizer=lambda p: torch.optim.Adam(p, lr=3e-3),
    )
    t = trainer(12, [DSPruning(loss_threshold=0.3, gamma=0.01, every_n_steps=40)])
    t.fit(model, dm)
    head = model.head
    assert head.classes_without_expert().numel() == 0
    assert sum(head.expert_sizes()) < 200  # from 1000 rows: nearly exclusive experts
    assert hierarchy_purity(head, dm) > 0.7
    assert t.callback_metrics["val/acc_top1"] > 0.9


def test_bad_options():
    with pytest.raises(ValueError, match="every_n_steps"):
        DSPruning(every_n_steps=0)


@pytest.mark.parametrize(
    ("name", "options"),
    [("DSPruning", {}), ("Mitosis", {}), ("DSMonitor", {}), ("DSTargetClasses", {"epoch": 0})],
)
def test_a_ds_callback_on_a_model_without_a_ds_head_stops_before_any_step(tmp_path, name, options):
    """Found at the first pruning, a run had trained until then: refused at setup, naming the
    head option."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import BoringModel

    import app.callbacks as callbacks
    from heads.errors import HeadConfigError

    class Counting(BoringModel):
        steps = 0

        def training_step(self, batch, batch_idx):
            Counting.steps += 1
            return super().training_step(batch, batch_idx)

    trainer = L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[getattr(callbacks, name)(**options)],
    )  # fmt: skip
    with pytest.raises(HeadConfigError, match="--model.head heads.DSSoftmaxHead"):
        trainer.fit(Counting())
    assert Counting.steps == 0


def test_under_gradient_accumulation_pruning_checks_only_after_an_optimizer_step():
    """With ``accumulate_grad_batches`` a batch inside a window has its gradient accumulated
    but not applied: a prune there replaces the head's parameters and the window's step
    loses that batch's gradient (Algorithm 1 prunes after the update). Its global step also
    repeats the previous batch's, which ran the same check. Checks come only at windows'
    last batches, once per due step."""
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=20, batch_size=8)
    model = make_model(dm)
    checks = []

    class Record(DSPruning):
        def prune(self, trainer, pl_module) -> int:
            checks.append((trainer.fit_loop.epoch_loop.batch_idx, trainer.global_step))
            return super().prune(trainer, pl_module)

    t = trainer(1, [Record(gamma=0.01, every_n_steps=2)], accumulate_grad_batches=2)
    t.fit(model, dm)  # 40 batches: 20 optimizer steps
    assert checks == [(4 * i + 3, 2 * i + 2) for i in range(10)]
