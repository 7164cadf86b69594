import lightning as L
import torch

from datamodules.bptt import BPTTBatches
from datamodules.resumable import ResumableLoader


def _windows(loader) -> list[torch.Tensor]:
    return [inputs.clone() for inputs, _ in loader]


def test_resumes_after_the_batches_already_served_then_restarts_the_next_epoch():
    dataset = BPTTBatches(torch.arange(200), batch_size=4, bptt=5)
    full = _windows(ResumableLoader(dataset))

    interrupted = ResumableLoader(dataset)
    iterator = iter(interrupted)
    for _ in range(3):
        next(iterator)
    state = interrupted.state_dict()
    assert state == {"batches_served": 3}

    resumed = ResumableLoader(dataset)
    resumed.load_state_dict(state)
    rest = _windows(resumed)
    assert len(rest) == len(full) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, full[3:], strict=True))
    assert resumed.state_dict() == {"batches_served": len(full)}
    # the following epoch starts from the first batch again
    assert torch.equal(_windows(resumed)[0], full[0])


def test_the_position_saved_is_the_batch_being_trained_not_the_read_ahead():
    # Lightning's fetcher reads one batch ahead: the module marks the batch it trains
    dataset = BPTTBatches(torch.arange(200), batch_size=4, bptt=5)
    loader = ResumableLoader(dataset)
    iterator = iter(loader)
    next(iterator)
    next(iterator)  # batch 1 read ahead while batch 0 trains
    loader.mark_consumed(1)
    assert loader.state_dict() == {"batches_served": 1}
    resumed = ResumableLoader(dataset)
    resumed.load_state_dict(loader.state_dict())
    first = next(iter(resumed))[0]
    assert resumed.resumed_from == 1
    assert torch.equal(first, _windows(ResumableLoader(dataset))[1])


def test_the_pass_hook_runs_before_each_epoch_s_first_batch_is_made():
    """Where a data module installs what it scheduled for the next pass (a re-learnt table):
    the epoch's batches, also those of worker processes, must be made after it."""
    data = torch.zeros(40)

    def install() -> None:
        data.add_(1)  # the "new table": every item made after this sees it

    loader = ResumableLoader(
        torch.utils.data.TensorDataset(data), before_pass=install, batch_size=10
    )
    assert loader.before_pass is install
    assert [float(batch[0][0]) for batch in loader] == [1.0] * 4
    assert [float(batch[0][0]) for batch in loader] == [2.0] * 4


def test_overfit_batches_trains_the_same_whole_batches_every_epoch():
    """Lightning rebuilds an iterable loader for ``overfit_batches`` with
    ``batch_sampler=None``: the rebuilt loader still yields the dataset's whole BPTT windows
    (it batched them again, one window a batch: the LM's fit stopped at its first step)."""
    dataset = BPTTBatches(torch.arange(200), batch_size=4, bptt=5)
    seen: list[list[torch.Tensor]] = []

    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))

        def train_dataloader(self):
            return ResumableLoader(dataset)

        def on_train_epoch_start(self) -> None:
            seen.append([])

        def training_step(self, batch, batch_idx):
            seen[-1].append(batch[0].clone())
            return self.weight * 0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(max_epochs=3, overfit_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Recorder())
    first_two = _windows(ResumableLoader(dataset))[:2]
    assert len(seen) == 3
    for epoch in seen:
        assert len(epoch) == 2
        assert all(torch.equal(a, b) for a, b in zip(epoch, first_two, strict=True))
