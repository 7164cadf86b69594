"""Checkpoints carried to another run: what a fit resumed from a checkpoint written inside a
gradient-accumulation window continues with (``lightning_modules/epoch_resume.py``)."""

import logging
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from app.callbacks import ModelCheckpoint
from lightning_modules import LanguageModel, Translation
from lightning_modules.checkpoint_file import check_checkpoint_task
from lightning_modules.epoch_resume import (
    GRADIENTS_KEY,
    TRAIN_STATE_KEY,
    read_epoch_state,
    restore_accumulated_gradients,
)
from lightning_modules.errors import ModelConfigError
from lightning_modules.head_task import HeadTask
from tests.lightning_modules import test_epoch_resume

markov = test_epoch_resume.markov  # the fixture: a small corpus (a Markov chain over 30 words)

pytestmark = pytest.mark.usefixtures("one_thread")
EPOCH = 6  # training batches per epoch


def fit(data_path: str, folder: Path, ckpt_path: str | None = None, **options) -> L.Trainer:
    """The resume tests' LSTM LM (dropout, Adam, a plateau schedule), ``EPOCH`` batches an
    epoch, a checkpoint ``step=N.ckpt`` at every validation's end."""
    data, model = test_epoch_resume.plateau_language_model(data_path)
    every = ModelCheckpoint(dirpath=folder, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_train_batches=EPOCH, limit_val_batches=1, logger=False,
        callbacks=[every], **options,
    )  # fmt: skip
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def test_a_checkpoint_inside_an_accumulation_window_resumes_with_the_windows_gradient(
    markov, tmp_path
):
    """Windows of 2 batches, a validation every 3: the one after batch 3 falls inside the
    window (batches 3 and 4) and its checkpoint holds the gradient of batch 3, which the
    window's step needs: resumed from it, the fit ends with the uninterrupted fit's weights
    (before, batch 3's gradient was lost and the step was of batch 4 alone)."""
    options = dict(max_epochs=2, accumulate_grad_batches=2, val_check_interval=3)
    whole = fit(markov, tmp_path / "whole", **options)
    mid = tmp_path / "whole" / "step=1.ckpt"  # batch 3 done, one step taken
    saved = torch.load(mid, weights_only=False)
    assert saved["global_step"] == 1
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"batches_served": 3}]
    resumed = fit(markov, tmp_path / "resumed", str(mid), **options)
    assert resumed.global_step == whole.global_step == 2 * EPOCH // 2
    weights = whole.lightning_module.state_dict()
    for name, value in resumed.lightning_module.state_dict().items():
        torch.testing.assert_close(value, weights[name], rtol=0, atol=0, msg=name)


def test_the_windows_gradient_is_given_back_only_to_a_fit_with_the_same_windows(caplog):
    """Another ``accumulate_grad_batches`` puts the windows elsewhere: the saved gradient is
    dropped, and the fit says so in one line; the same one gets it back, by parameter name."""
    gradient = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    checkpoint = {
        TRAIN_STATE_KEY: {"world_size": 1, "state": None, "metrics": {}, "rng": None},
        GRADIENTS_KEY: {"accumulate_grad_batches": 2, "gradients": {"weight": gradient}},
    }

    def trainer(accumulate: int) -> SimpleNamespace:
        return SimpleNamespace(world_size=1, accumulate_grad_batches=accumulate,
                               state=SimpleNamespace(fn=TrainerFn.FITTING))  # fmt: skip

    with caplog.at_level(logging.WARNING, logger="lightning_modules.epoch_resume"):
        assert "gradients" not in read_epoch_state(checkpoint, trainer(4))
    (record,) = caplog.records
    assert "accumulate_grad_batches 2, and this fit accumulates 4" in record.getMessage()
    assert "\n" not in record.getMessage()
    saved = read_epoch_state(checkpoint, trainer(2))["gradients"]
    module = torch.nn.Linear(3, 2, bias=True, dtype=torch.float64)
    restore_accumulated_gradients(module, saved)
    torch.testing.assert_close(module.weight.grad, gradient, rtol=0, atol=0)
    assert module.bias.grad is None  # no gradient saved for it: the optimizer skips it


LM_HPARAMS = {"hyper_parameters": {"_class_path": "lightning_modules.LanguageModel"}}


def test_a_checkpoint_of_another_task_is_named_with_the_class_that_loads_it():
    """A language model's checkpoint is a LanguageModel's, and a HeadTask's (its base, as
    Lightning loads a subclass's checkpoint through its base); a Translation's it is not."""
    check_checkpoint_task(LM_HPARAMS, LanguageModel, "'lm.ckpt'")
    check_checkpoint_task(LM_HPARAMS, HeadTask, "'lm.ckpt'")
    check_checkpoint_task({"state_dict": {}}, Translation, "'plain.ckpt'")  # names no class
    with pytest.raises(ModelConfigError) as raised:
        check_checkpoint_task(LM_HPARAMS, Translation, "'lm.ckpt'")
    assert str(raised.value) == (
        "'lm.ckpt' is a LanguageModel checkpoint (lightning_modules.LanguageModel), not a "
        "Translation one: load it with LanguageModel.load_from_checkpoint, or give a "
        "Translation checkpoint"
    )


def test_load_from_checkpoint_of_another_task_is_one_line_naming_both(tmp_path):
    """``Translation.load_from_checkpoint`` of a language model's checkpoint: Lightning's
    refusal spoke of blocked code execution and imports (or, before it, the rebuilt modules'
    configs); now one line naming both tasks."""
    path = tmp_path / "lm.ckpt"
    torch.save({**LM_HPARAMS, "state_dict": {}}, path)
    with pytest.raises(ModelConfigError, match="is a LanguageModel checkpoint .* not a "
                                               "Translation one"):  # fmt: skip
        Translation.load_from_checkpoint(str(path))
