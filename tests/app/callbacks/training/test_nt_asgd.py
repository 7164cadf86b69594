"""NT-ASGD: averaging starts when the validation loss is worse than the best of all but the
last ``nonmono`` validations; validation and checkpoints see the average of the iterates."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from app.callbacks import NTASGD
from lightning_modules.errors import ModelConfigError

pytestmark = pytest.mark.usefixtures("one_thread")
BATCHES = 3


class Scripted(L.LightningModule):
    """A linear model trained by ASGD whose validation loss follows a script, so that the
    trigger is known; it records every iterate and what validation saw."""

    def __init__(self, val_losses, optimizer="asgd"):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.val_losses, self.optimizer_name = val_losses, optimizer
        self.iterates, self.seen_in_validation, self.seen_in_training = [], [], []

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.seen_in_training.append(self.layer.weight.detach().clone())
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.iterates.append(self.layer.weight.detach().clone().double())

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.seen_in_validation.append(self.layer.weight.detach().clone().double())

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.log("val/loss", self.val_losses[self.current_epoch])

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters())
        return torch.optim.ASGD(self.parameters(), lr=0.05, lambd=0.0, t0=1e12)


def loader():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * 4, 3, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def fit(model, callback, tmp_path, epochs, checkpoint=None):
    callbacks = [callback] + ([checkpoint] if checkpoint else [])
    trainer = L.Trainer(max_epochs=epochs, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path,
                        enable_checkpointing=checkpoint is not None, callbacks=callbacks,
                        num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(model, loader(), loader())
    return trainer


def test_averaging_starts_at_the_non_monotone_trigger_and_validation_sees_the_mean(tmp_path):
    torch.manual_seed(0)
    # nonmono 1: the fourth validation (2.5) is worse than the best of all validations but
    # the last one before it (2.0 of 3.0, 2.0); the third (2.6) is not worse than 3.0
    losses = [3.0, 2.0, 2.6, 2.5, 2.4, 2.3]
    model, callback = Scripted(losses), NTASGD(nonmono=1)
    fit(model, callback, tmp_path, len(losses))
    assert callback.triggered_at == 4 * BATCHES  # after the fourth epoch's steps
    assert callback.history == pytest.approx(losses)
    # before the trigger validation sees the training weights, after it the running mean of
    # the iterates from the second step after t0 on (torch's ASGD: the first one is copied)
    for epoch, seen in enumerate(model.seen_in_validation):
        last = (epoch + 1) * BATCHES
        if last <= callback.triggered_at + 1:
            expected = model.iterates[last - 1]
        else:
            expected = torch.stack(model.iterates[callback.triggered_at + 1 : last]).mean(0)
        torch.testing.assert_close(seen, expected, rtol=1e-6, atol=1e-7)
    # training goes on from its own weights, not from the average
    for epoch in range(1, len(losses)):
        torch.testing.assert_close(
            model.seen_in_training[epoch].double(), model.iterates[epoch * BATCHES - 1]
        )


def test_checkpoint_holds_the_average_and_the_training_weights_to_resume_from(tmp_path):
    torch.manual_seed(0)
    losses = [3.0, 2.0, 2.6, 2.5, 2.4]
    model, callback = Scripted(losses), NTASGD(nonmono=1)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    fit(model, callback, tmp_path, len(losses), checkpoint)
    saved = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=False)
    torch.testing.assert_close(saved["state_dict"]["layer.weight"].double(),
                               model.seen_in_validation[-1])  # fmt: skip
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("NTASGD"))
    torch.testing.assert_close(state["training_weights"]["layer.weight"].double(),
                               model.iterates[-1])  # fmt: skip
    assert state["triggered_at"] == 4 * BATCHES
    # resumed: the training weights come back before the next training step
    resumed_model, resumed = Scripted(losses + [2.3]), NTASGD(nonmono=1)
    trainer = L.Trainer(max_epochs=6, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, callbacks=[resumed], num_sanity_val_steps=0,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(resumed_model, loader(), loader(), ckpt_path=tmp_path / "last.ckpt")
    torch.testing.assert_close(resumed_model.seen_in_training[0].double(), model.iterates[-1])
    assert resumed.triggered_at == 4 * BATCHES and resumed.history == pytest.approx(losses + [2.3])


def test_finetune_averages_from_the_start_and_stops_when_the_criterion_fires(tmp_path):
    torch.manual_seed(0)
    model, callback = Scripted([3.0, 2.0, 2.6, 2.5, 1.0]), NTASGD(nonmono=1, finetune=True)
    fit(model, callback, tmp_path, 5)
    assert callback.triggered_at == 0
    assert len(model.seen_in_validation) == 4  # stopped after the fourth validation
    expected = torch.stack(model.iterates[1:BATCHES]).mean(0)
    torch.testing.assert_close(model.seen_in_validation[0], expected, rtol=1e-6, atol=1e-7)


def test_another_optimizer_is_one_clear_error(tmp_path):
    with pytest.raises(ModelConfigError, match="torch.optim.ASGD"):
        fit(Scripted([1.0], optimizer="adam"), NTASGD(), tmp_path, 1)


def test_nonmono_must_be_positive():
    with pytest.raises(ModelConfigError, match="nonmono"):
        NTASGD(nonmono=0)
