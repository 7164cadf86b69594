import lightning as L
import pytest
import torch

from datamodules import SyntheticHierarchyDataModule
from heads import DSSoftmaxHead, SoftmaxHead
from lightning_modules import Classifier
from lightning_modules.backbones import MLPBackbone

pytestmark = pytest.mark.usefixtures("one_thread")


def fit(model, dm, epochs=2, **trainer_options) -> L.Trainer:
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **{"enable_model_summary": False, **trainer_options},
    )
    trainer.fit(model, dm)
    return trainer


@pytest.mark.parametrize("head_class", [SoftmaxHead, DSSoftmaxHead])
def test_fits_synthetic_data_with_any_head(head_class):
    torch.manual_seed(0)
    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=100)
    model = Classifier(
        MLPBackbone(dm.input_size, 32, vocab_size=dm.vocab_size),
        head_class(32, dm.vocab_size),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
    )
    trainer = fit(model, dm, epochs=5)
    metrics = trainer.callback_metrics
    assert metrics["val/acc_top1"] > 0.8
    assert metrics["val/acc_top5"] >= metrics["val/acc_top1"]
    assert metrics["val/acc_top10"] >= metrics["val/acc_top5"]
    (result,) = trainer.test(model, dm, verbose=False)
    assert result["test/acc_top1"] > 0.8


def test_top_k_accuracy_counts_hits_from_head_topk():
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=3)
    head = SoftmaxHead(4, 6)
    model = Classifier(MLPBackbone(dm.input_size, 4), head, top_k=(1, 2, 10))
    assert model.top_k == (1, 2)  # k above the class count is dropped
    with torch.no_grad():
        head.weight.zero_()
        head.bias.copy_(torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0]))
    model._evaluate((torch.randn(4, dm.input_size), torch.tensor([0, 1, 2, 1])), "val")
    assert model.metrics["val_acc_top1"].compute() == pytest.approx(0.25)
    assert model.metrics["val_acc_top2"].compute() == pytest.approx(0.75)


def test_hidden_size_mismatch():
    with pytest.raises(ValueError, match="hidden_size"):
        Classifier(MLPBackbone(10, 32), SoftmaxHead(16, 10))


def test_synthetic_ds_config_runs_through_the_cli(tmp_path, monkeypatch):
    from pathlib import Path

    from cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    cli = main(["fit", "--config", "configs/ds/synthetic_hierarchy.yaml",
                "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
                "--trainer.enable_progress_bar", "false",
                "--trainer.logger.init_args.save_dir", str(tmp_path)])  # fmt: skip
    assert isinstance(cli.model.head, DSSoftmaxHead)
    assert cli.model.head.vocab_size == 100  # linked from the data module's vocab_size
    assert "ds/speedup" in cli.trainer.callback_metrics
    assert list(tmp_path.rglob("events.out.tfevents*"))


def _classifier(dm, head_class=DSSoftmaxHead, d=8):
    return Classifier(MLPBackbone(dm.input_size, d, dropout=0.3), head_class(d, dm.vocab_size),
                      optimizer=lambda p: torch.optim.Adam(p, lr=1e-2))  # fmt: skip


def test_model_summary_counts_the_flops_of_a_training_batch():
    """The summary's FLOPs column comes from the first training batch (``setup("fit")``),
    not zeros; drawing it leaves the random generators as they were, so a run trains the
    same weights with the summary as without (dropout on, a DS head)."""
    from lightning.pytorch.utilities.model_summary import ModelSummary

    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=3, dim=5, batch_size=7)
    trained = []
    for summary in (True, False):
        torch.manual_seed(0)
        model = _classifier(dm)
        fit(model, dm, epochs=1, enable_model_summary=summary, limit_train_batches=3,
            limit_val_batches=1)  # fmt: skip
        trained.append(model.state_dict())
    assert trained[0].keys() == trained[1].keys()
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    torch.manual_seed(0)
    model = _classifier(dm, SoftmaxHead)
    fit(model, dm, epochs=1, limit_train_batches=1, limit_val_batches=0)
    inputs, targets = model.example_input_array
    assert inputs.shape == (7, 5) and targets.shape == (7,)
    flops = ModelSummary(model, max_depth=1).flop_counts
    mlp = 2 * 7 * (5 * 8 + 8 * 8)  # two layers' products
    assert sum(flops["backbone"].values()) == mlp
    assert sum(flops["head"].values()) == 2 * 7 * 8 * dm.vocab_size  # the logits


@pytest.mark.parametrize("stage", ["validate", "test"])
def test_a_non_finite_evaluation_loss_stops_the_run(stage):
    # the classifier's epoch ends call HeadTask's, which reads the finite-loss check back once
    from lightning_modules.checks import NonFiniteLossError

    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=3)
    head = SoftmaxHead(4, dm.vocab_size)
    model = Classifier(MLPBackbone(dm.input_size, 4), head)
    with torch.no_grad():
        head.bias.fill_(float("nan"))
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    with pytest.raises(NonFiniteLossError, match=f"non-finite {stage[:3]}"):
        getattr(trainer, stage)(model, dm, verbose=False)


def test_a_non_finite_training_loss_stops_the_run():
    from lightning_modules.checks import NonFiniteLossError

    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=3)
    head = SoftmaxHead(4, dm.vocab_size)
    model = Classifier(MLPBackbone(dm.input_size, 4), head)
    with torch.no_grad():
        head.bias.fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match="non-finite train loss"):
        fit(model, dm, epochs=1, num_sanity_val_steps=0)


@pytest.mark.parametrize("checkpoint", ["epoch=0-step=20.ckpt", "epoch=1-step=28.ckpt"])
def test_a_resumed_fit_trains_the_weights_of_the_uninterrupted_one(tmp_path, checkpoint):
    """``fit --ckpt_path`` from an epoch's end or from inside an epoch: the resumed epochs see
    the batches, in the order, and the dropout masks of the uninterrupted run. (The shuffle's
    generator was carried from epoch to epoch: a resumed fit started over at epoch 0's order,
    and one resumed mid-epoch replayed the epoch's first batches.)"""
    from app.callbacks import ModelCheckpoint  # the app's: a save on an epoch's last batch

    dm = SyntheticHierarchyDataModule(num_super=4, num_sub=4, train_per_sub=20, batch_size=16)

    def trainer(*callbacks: ModelCheckpoint) -> L.Trainer:
        return L.Trainer(max_epochs=2, accelerator="cpu", logger=False, limit_val_batches=0,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks),
                         enable_checkpointing=bool(callbacks))  # fmt: skip

    torch.manual_seed(0)
    whole = _classifier(dm)
    trainer(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)).fit(whole, dm)
    torch.manual_seed(1)  # the checkpoint gives the weights and the generators back
    resumed = _classifier(dm)
    (resumed_fit := trainer()).fit(resumed, dm, ckpt_path=str(tmp_path / checkpoint))
    assert resumed_fit.global_step == 40  # 20 batches an epoch
    for name, value in whole.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=0, atol=0)
