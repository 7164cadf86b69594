"""A fit resumed mid-epoch on another number of processes says what it does not carry over
(lightning_modules/epoch_resume.py): each rank's train/ppl sums, carried state and generators
are its own, so another world size starts them afresh, and that was silent."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from lightning_modules.epoch_resume import TRAIN_STATE_KEY, read_epoch_state


def _checkpoint(world_size: int, position: int) -> dict:
    state = torch.zeros(world_size, 3)
    return {
        TRAIN_STATE_KEY: {"world_size": world_size, "state": state, "metrics": {}, "rng": None},
        "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"batches_served": position}]}}},
    }


def _trainer(world_size: int, fn: TrainerFn = TrainerFn.FITTING) -> SimpleNamespace:
    return SimpleNamespace(world_size=world_size, global_rank=0, state=SimpleNamespace(fn=fn))


@pytest.mark.parametrize(("saved", "ours"), [(2, 1), (1, 2)])
def test_a_mid_epoch_resume_on_another_world_size_warns_once(caplog, saved, ours):
    with caplog.at_level(logging.WARNING, logger="lightning_modules"):
        assert read_epoch_state(_checkpoint(saved, 7), _trainer(ours)) is None
    lines = [r.getMessage() for r in caplog.records]
    name = {1: "1 process", 2: "2 processes"}
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        f"warning: resumed at batch 7 of an epoch from a checkpoint of {name[saved]}, on "
        f"{name[ours]}: the epoch's train/ppl sums, the recurrent state carried between windows"
    )


@pytest.mark.parametrize(
    ("saved", "position", "fn"),
    [(2, 0, TrainerFn.FITTING), (2, 7, TrainerFn.TESTING), (1, 7, TrainerFn.FITTING)],
    ids=["at_an_epoch_end", "a_test", "the_same_world_size"],
)
def test_nothing_is_said_where_nothing_is_lost(caplog, saved, position, fn):
    with caplog.at_level(logging.WARNING, logger="lightning_modules"):
        read_epoch_state(_checkpoint(saved, position), _trainer(1, fn))
    assert caplog.records == []
