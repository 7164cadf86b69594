import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from app.callbacks import DSTargetClasses
from datamodules import SyntheticHierarchyDataModule
from heads import DSSoftmaxHead, HeadConfigError
from lightning_modules import Classifier
from lightning_modules.backbones import MLPBackbone
from tests.app.callbacks.ds.test_pruning import make_model, trainer

pytestmark = pytest.mark.usefixtures("one_thread")


class CountTargets(Callback):
    """Counts, independently of the callback under test, which expert each training token of
    epoch 0 was sent to, with its target; and the membership before the change. Not the
    validation's tokens, although its batches run before the training epoch ends."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch != 0:
            return
        head = pl_module.head
        self.pairs = []

        def record(module, args, output) -> None:
            if not module.training:  # validation
                return
            expert, _ = module.select(args[0].detach())
            self.pairs.append((expert, args[1].clone()))

        self.hook = head.register_forward_hook(record)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            self.hook.remove()
            self.had = pl_module.head.membership()


def expected_membership(
    spy: CountTargets, min_count: int, drop_below: int, keep_every_class: bool
) -> torch.Tensor:
    counts = torch.zeros_like(spy.had, dtype=torch.long)
    for expert, target in spy.pairs:
        for k, c in zip(expert.tolist(), target.tolist(), strict=True):
            counts[k, c] += 1
    keep = (counts >= min_count) | (spy.had & (counts >= drop_below))
    if keep_every_class:  # a class left nowhere goes where it is most often a target
        for c in range(keep.size(1)):
            if spy.had[:, c].any() and not keep[:, c].any():
                best = max(counts[:, c].tolist())
                tied = [k for k in range(keep.size(0)) if counts[k, c] == best]
                keep[next((k for k in tied if spy.had[k, c]), tied[0]), c] = True
    return keep


@pytest.mark.parametrize(
    "min_count, drop_below, keep_every_class",
    [(3, 0, True), (3, 1, True), (3, 1, False), (15, 15, True), (15, 15, False)],
)
def test_experts_get_the_classes_of_their_tokens_targets(min_count, drop_below, keep_every_class):
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=20, batch_size=32)
    model = make_model(dm)
    with torch.no_grad():  # start from sparse experts: expert k holds classes c = k mod 4
        head = model.head
        keep = (head.row_class % 4) == head.row_expert()
        head.set_structure(head.weight[keep], head.row_class[keep], [4] * 4, head.gate)
    spy = CountTargets()
    callback = DSTargetClasses(
        epoch=0, min_count=min_count, drop_below=drop_below, keep_every_class=keep_every_class
    )
    t = trainer(2, [spy, callback])
    t.fit(model, dm)
    wanted = expected_membership(spy, min_count, drop_below, keep_every_class)
    assert torch.equal(model.head.membership(), wanted[wanted.any(1)])
    assert callback.done
    assert callback.added_rows == int((wanted & ~spy.had).sum())
    assert callback.dropped_rows == int((spy.had & ~wanted).sum())
    if keep_every_class:
        assert model.head.classes_without_expert().numel() == 0
    # the optimizer trains the new rows (epoch 1 ran on them)
    (optimizer,) = t.optimizers
    assert optimizer.state[model.head.weight]["exp_avg"].shape == model.head.weight.shape
    assert torch.isfinite(t.callback_metrics["val/loss"])


@pytest.mark.slow  # torch.compile of a training step: ~25 s on 2 cores
def test_counts_the_same_under_torch_compile():
    """Counted after each step from what the compiled head saw (no data-dependent shapes)."""
    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=20, batch_size=32)
    structures = []
    for compile in (False, True):
        torch.manual_seed(0)
        model = Classifier(
            MLPBackbone(dm.input_size, 32),
            DSSoftmaxHead(32, dm.vocab_size, num_experts=4),
            optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
            compile=compile,
        )
        trainer(1, [DSTargetClasses(epoch=0, min_count=3, drop_below=1)]).fit(model, dm)
        structures.append((model.head.expert_sizes(), model.head.row_class.clone()))
    assert structures[0][0] == structures[1][0]
    assert torch.equal(structures[0][1], structures[1][1])


def test_resumed_run_does_not_change_the_classes_again(tmp_path):
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=20, batch_size=32)
    model = make_model(dm)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    callback = DSTargetClasses(epoch=0, min_count=3, drop_below=1)
    trainer(1, [callback, checkpoint], enable_checkpointing=True).fit(model, dm)
    assert callback.done and callback.dropped_rows > 0
    sizes = model.head.expert_sizes()
    fresh, again = make_model(dm), DSTargetClasses(epoch=0, min_count=1)
    resumed = trainer(2, [again], limit_train_batches=1)
    resumed.fit(fresh, dm, ckpt_path=str(tmp_path / "last.ckpt"))
    assert again.done and again.dropped_rows == callback.dropped_rows
    assert fresh.head.expert_sizes() == sizes


def test_a_fit_resumed_inside_the_counted_epoch_changes_the_classes_at_its_end(tmp_path):
    """The epoch a fit resumes inside gets no ``on_train_epoch_start`` from Lightning: the
    counting then never started and the classes were never re-selected."""
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=20, batch_size=16)
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer(1, [every], limit_val_batches=0, enable_checkpointing=True).fit(make_model(dm), dm)
    callback = DSTargetClasses(epoch=0, min_count=1, drop_below=1)
    resumed = make_model(dm)
    trainer(1, [callback], limit_val_batches=0).fit(
        resumed, dm, ckpt_path=str(tmp_path / "epoch=0-step=2.ckpt")
    )
    assert callback.done and callback.dropped_rows > 0


def test_a_threshold_no_class_reaches_is_a_clear_error():
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=2, train_per_sub=10, batch_size=10)
    callback = DSTargetClasses(epoch=0, min_count=10**6, drop_below=10**6, keep_every_class=False)
    with pytest.raises(HeadConfigError, match="lower min_count"):
        trainer(1, [callback]).fit(make_model(dm), dm)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"epoch": -1}, "epoch"),
        ({"epoch": 0, "min_count": 0}, "min_count"),
        ({"epoch": 0, "drop_below": -1}, "drop_below"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(HeadConfigError, match=message):
        DSTargetClasses(**options)
