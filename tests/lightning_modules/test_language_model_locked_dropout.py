"""The language model tells the head its rows' layout (``sequence_length``: B streams of T
steps, row ``b T + t``), so that MoS and Mixtape with ``locked_dropout`` draw one dropout mask
a stream, as the MoS code's locked latent dropout; heads whose ``forward`` does not take the
keyword are not given it."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from datamodules.bptt import BPTTBatches
from heads import HeadOutput, MixtapeHead, MoSHead, SoftmaxHead
from heads.fused_cross_entropy import LossOptions
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone
from lightning_modules.static_rows import padded_rows
from tests.lightning_modules.test_host_sync import assert_no_sync, fit_language_model

VOCAB, D, BATCH, BPTT = 40, 8, 3, 7  # 21 rows: padded to 22

pytestmark = pytest.mark.usefixtures("one_thread")


def trainer(steps: int = 2) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", max_steps=steps, limit_val_batches=1, num_sanity_val_steps=0,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
    )  # fmt: skip


def loader() -> DataLoader:
    tokens = torch.randint(0, VOCAB, (200,), generator=torch.Generator().manual_seed(0))
    return DataLoader(BPTTBatches(tokens, batch_size=BATCH, bptt=BPTT), batch_size=None)


def spied(head):
    """``head`` whose calls record ``(rows, sequence_length, training)``."""
    calls = []
    forward = head.forward

    @functools.wraps(forward)
    def spy(hidden, target, label_smoothing=0.0, sequence_length=None):
        calls.append((hidden.size(0), sequence_length, head.training))
        return forward(hidden, target, label_smoothing=label_smoothing,
                       sequence_length=sequence_length)  # fmt: skip

    head.forward = spy
    head.calls = calls
    return head


HEADS = {
    "mos": lambda: MoSHead(D, VOCAB, num_components=3, context_dropout=0.5, locked_dropout=True),
    "mixtape": lambda: MixtapeHead(
        D, VOCAB, frequent_ratio=0.5, gate_dropout=0.3, context_dropout=0.5, locked_dropout=True
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(HEADS))
def test_training_steps_give_the_head_the_streams_length(name):
    torch.manual_seed(0)
    head = spied(HEADS[name]())
    model = LanguageModel(LSTMBackbone(VOCAB, embedding_size=D, hidden_size=D), head)
    before = [p.detach().clone() for p in head.parameters()]
    trainer().fit(model, loader(), loader())
    training = [c for c in head.calls if c[2]]
    assert training == [(BATCH * BPTT, BPTT, True)] * 2
    assert all(not torch.equal(a, b) for a, b in zip(before, head.parameters(), strict=True))


def test_a_step_on_padded_rows_gives_the_layout_of_the_real_ones(monkeypatch):
    """Where the head's rows are padded to a static count (``compile``, ``cuda_graphs``), the
    padding comes after the B T real rows and the head is given T: the real rows keep their
    streams' masks (``tests/heads/test_mos_locked_dropout.py``)."""
    torch.manual_seed(0)
    head = spied(HEADS["mos"]())
    model = LanguageModel(LSTMBackbone(VOCAB, embedding_size=D, hidden_size=D), head)
    monkeypatch.setattr(LanguageModel, "_static_rows", lambda self, device: True)
    batch = next(iter(loader()))
    model.train()
    loss = model._step(batch, "train")
    loss.backward()
    rows = padded_rows(BATCH * BPTT)
    assert rows > BATCH * BPTT and head.calls == [(rows, BPTT, True)]


def test_the_locked_step_equals_the_head_given_the_layout_itself():
    """The task's training step is the head's loss on rows ``b T + t`` with ``T`` given: the
    same masks (from the same generator state) and loss as calling the head directly."""
    torch.manual_seed(0)
    model = LanguageModel(LSTMBackbone(VOCAB, embedding_size=D, hidden_size=D, input_dropout=0.0,
                                       hidden_dropout=0.0, output_dropout=0.0),
                          HEADS["mos"]()).train()  # fmt: skip
    inputs, targets = next(iter(loader()))
    torch.manual_seed(1)
    loss = model._step((inputs, targets), "train")
    hidden, _ = model.backbone(inputs)
    torch.manual_seed(1)
    want = model.head(hidden.reshape(-1, D), targets.reshape(-1), sequence_length=BPTT)
    torch.manual_seed(1)
    per_row = model.head(hidden.reshape(-1, D), targets.reshape(-1))
    assert torch.equal(loss, want.loss) and not torch.equal(loss, per_row.loss)


class OldSoftmax(SoftmaxHead):
    """A head written before the keyword (``forward`` without ``sequence_length``)."""

    def forward(self, hidden, target, label_smoothing: float = 0.0) -> HeadOutput:
        return super().forward(hidden, target, label_smoothing=label_smoothing)


def test_a_head_whose_forward_does_not_take_the_layout_is_not_given_it():
    assert not OldSoftmax.takes_sequence_length and MoSHead.takes_sequence_length
    torch.manual_seed(0)
    model = LanguageModel(
        LSTMBackbone(VOCAB, embedding_size=D, hidden_size=D), OldSoftmax(D, VOCAB)
    )
    trainer().fit(model, loader(), loader())
    assert model.global_step == 2


LOCKED = {
    "mos": lambda d, v: MoSHead(d, v, num_components=3, context_dropout=0.3, locked_dropout=True),
    "mixtape": lambda d, v: MixtapeHead(
        d, v, frequent_ratio=0.5, gate_dropout=0.2, context_dropout=0.3, locked_dropout=True
    ),  # fmt: skip
}


def _rows_plan(make):
    def make_rows(d, v):
        head = make(d, v)
        head.loss_options = LossOptions(plan="rows")
        return head

    return make_rows


@pytest.mark.parametrize("name", ["mos", "mixtape", "mixtape_rows"])
def test_locked_steps_make_no_host_sync(name, monkeypatch):
    """The sync sentinel of ``test_host_sync.py`` over a real fit with the locked masks drawn
    (dropout > 0, as the AWD configs): nothing read back in a training or validation step."""
    make = _rows_plan(LOCKED["mixtape"]) if name == "mixtape_rows" else LOCKED[name]
    assert_no_sync(fit_language_model(make, monkeypatch), 0)
