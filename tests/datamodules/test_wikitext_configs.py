"""The WikiText-103 settings' validation schedule, run through Lightning's own loop (a toy
model: what is checked is when the trainer validates, not the model)."""

from pathlib import Path

import lightning as L
import pytest
import yaml
from lightning.pytorch.demos.boring_classes import BoringModel

SETTINGS = sorted((Path(__file__).parents[2] / "configs" / "lm").glob("wikitext103*.yaml"))


class _Validations(L.Callback):
    def __init__(self) -> None:
        self.at: list[int] = []  # training batches done at each validation

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.at.append(trainer.global_step)


def _validations(interval, limit_train_batches: int, epochs: int = 1) -> list[int]:
    seen = _Validations()
    trainer = L.Trainer(
        max_epochs=epochs, val_check_interval=interval, limit_train_batches=limit_train_batches,
        limit_val_batches=1, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[seen],
    )  # fmt: skip
    trainer.fit(BoringModel())
    return seen.at


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda p: p.stem)
def test_a_short_try_validates_and_every_epoch_ends_validated(setting):
    interval = yaml.safe_load(setting.read_text())["trainer"]["val_check_interval"]
    # the README's first try: 5 batches (a count of 5000 batches was refused by Lightning)
    assert _validations(interval, limit_train_batches=5)[-1] == 5
    # an epoch that the interval does not divide (WikiText-103's 24,578 batches by 5,000 left
    # 4,578 unvalidated, the fit's last among them): validated up to its last few batches
    at = _validations(interval, limit_train_batches=23, epochs=2)
    assert len(at) >= 4 and 23 - 4 <= at[len(at) // 2 - 1] <= 23 and 46 - 4 <= at[-1] <= 46
