"""Exact resume around an epoch's end: the resumed fit ends with the uninterrupted fit's
weights and schedule, and the two parts' logged values make up the uninterrupted fit's.

- A save by step (``every_n_train_steps``) on an epoch's last batch: Lightning wrote it before
  the epoch's validation and end, and the fit resumed from it counted the epoch finished (its
  validation, end hooks and plateau step lost); it is written at the epoch's end now
  (``app/callbacks/training/checkpoint.py``).
- An epoch that no validation ends (one inside it only): Lightning steps the plateau scheduler
  after the epoch on the latest validation's ``val/loss`` (still in ``callback_metrics``), but
  not in a fit resumed inside that epoch (it keeps no ``callback_metrics``, and takes no plateau
  step while restarting), nor was the step in a checkpoint written at that epoch's end. The
  task takes it in ``on_train_epoch_end`` and a checkpoint keeps what it reads
  (``HeadTask``'s validation counters and the monitored value).
"""

from pathlib import Path

import lightning as L
import pytest
import torch

from tests import test_resume_gaps as gaps
from tests.lightning_modules import test_epoch_resume
from tests.test_resume_gaps import assert_continues, logged

markov = test_epoch_resume.markov  # the fixture: a small corpus (a Markov chain over 30 words)

pytestmark = pytest.mark.usefixtures("one_thread")


def fit(data_path: str, folder: Path, batches: int, ckpt_path: str | None = None,
        **options) -> L.Trainer:  # fmt: skip
    """``tests/test_resume_gaps.py``'s fit, ``batches`` an epoch, 4 epochs unless told."""
    return gaps.fit(data_path, folder, ckpt_path, batches=batches, **{"max_epochs": 4} | options)


def test_a_step_checkpoint_on_an_epochs_last_batch_holds_the_epochs_end(markov, tmp_path):
    """Saves every 4 steps, 6 batches an epoch: step 12 is the second epoch's last batch (its
    validation, its end and its plateau step come after it); step 8 is inside the third."""
    whole = fit(markov, tmp_path / "whole", 6, every=4)
    inside = torch.load(tmp_path / "whole" / "step=8.ckpt", weights_only=False)
    assert inside["global_step"] == 8  # saves inside an epoch: at their batch, as before
    assert inside["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"batches_served": 2}]
    saved = torch.load(tmp_path / "whole" / "step=12.ckpt", weights_only=False)
    assert saved["global_step"] == 12
    assert saved["lr_schedulers"][0]["last_epoch"] == 2  # the second epoch's step (before: 1)
    resumed = fit(markov, tmp_path / "resumed", 6, str(tmp_path / "whole" / "step=12.ckpt"))
    assert whole.lr_scheduler_configs[0].scheduler.last_epoch == 4
    expected = logged(tmp_path / "whole")
    assert ("val/loss", 11) in expected  # the second epoch's validation, at its last batch
    curves = {k: v for k, v in expected.items() if k[1] < 12} | logged(tmp_path / "resumed")
    assert_continues(whole, resumed, curves, expected)


@pytest.mark.parametrize(
    ("validation", "last", "at"),
    [
        ({"val_check_interval": 0.5}, {}, 13),
        ({"val_check_interval": 4}, {}, 11),
        ({"val_check_interval": 0.5}, {"save_on_train_epoch_end": True}, 14),
    ],
    ids=["half-an-epoch", "every-4-batches", "saved-at-the-epochs-end"],
)
def test_an_epoch_that_no_validation_ends_takes_its_plateau_step_once_resumed(
    markov, tmp_path, validation, last, at
):
    """7 batches an epoch, validations after batches 3 and 6 (``0.5``) or 4 (``4``) only: each
    epoch's end steps the plateau scheduler on its latest validation's ``val/loss``, as
    Lightning does in the uninterrupted fit (4 steps in 4 epochs). The fit stopped after 2
    epochs left ``last.ckpt`` at the second epoch's last validation (mid-epoch: the resumed fit
    trains its last batch again and ends it), or at its end (``save_on_train_epoch_end``)."""
    whole = fit(markov, tmp_path / "whole", 7, last=last, **validation)
    assert whole.lr_scheduler_configs[0].scheduler.last_epoch == 4
    fit(markov, tmp_path / "first", 7, last=last, **validation | {"max_epochs": 2})
    saved = torch.load(tmp_path / "first" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == at
    # mid-epoch: the first epoch's step; at the end: the second's too (before: the first only)
    assert saved["lr_schedulers"][0]["last_epoch"] == (2 if at == 14 else 1)
    resumed = fit(markov, tmp_path / "resumed", 7, str(tmp_path / "first" / "last.ckpt"),
                  last=last, **validation)  # fmt: skip
    curves = {k: v for k, v in logged(tmp_path / "first").items() if k[1] < at}
    curves |= logged(tmp_path / "resumed")
    assert_continues(whole, resumed, curves, logged(tmp_path / "whole"))
