"""Test helper for ``tests/test_adaptive_ddp.py``: a tiny adaptive-softmax LM trained on one
process, or on two CPU processes (gloo) with ``find_unused_parameters=False`` as in
``configs/presets/ddp.yaml``, where rank 1's batches never touch the last tail cluster (and
its second batch no tail cluster at all). Each rank saves its final parameters.

    python -m tests.adaptive_ddp_fit <devices> <folder>

Run as a module from the repository root: Lightning's DDP launcher re-executes this command
line for rank 1.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from heads import AdaptiveSoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone

VOCAB, D, CUTOFFS = 30, 8, [6, 14]  # short-list [0, 6), clusters [6, 14) and [14, 30)
STREAMS, BPTT, STEPS = 4, 5, 3  # global streams: rank r of 2 takes streams 2r and 2r + 1


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` batches of ``[STREAMS, BPTT]`` inputs and targets: streams 0-1 hit every
    cluster; streams 2-3 only the short-list and the first cluster, and in the second batch
    only the short-list."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for step in range(STEPS):
        inputs = torch.randint(0, VOCAB, (STREAMS, BPTT), generator=generator)
        targets = torch.randint(0, VOCAB, (STREAMS, BPTT), generator=generator)
        targets[0, :3] = torch.tensor([0, 7, 20])  # every cluster in streams 0-1
        high = CUTOFFS[0] if step == 1 else CUTOFFS[1]
        targets[2:] = torch.randint(0, high, (2, BPTT), generator=generator)
        batches.append((inputs, targets))
    return batches


class RankData(L.LightningDataModule):
    """Each rank takes its own rows of every global batch (the data modules' layout)."""

    def train_dataloader(self) -> DataLoader:
        rank, world = self.trainer.global_rank, self.trainer.world_size
        per_rank = STREAMS // world
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        batches = [(x[rows], y[rows]) for x, y in global_batches()]
        return DataLoader(batches, batch_size=None)


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.5)


def main(devices: int, folder: Path) -> None:
    L.seed_everything(0)
    backbone = LSTMBackbone(VOCAB, embedding_size=D, hidden_size=D, input_dropout=0.0,
                            hidden_dropout=0.0, output_dropout=0.0)  # fmt: skip
    head = AdaptiveSoftmaxHead(D, VOCAB, cutoffs=CUTOFFS, div_value=2.0)
    model = LanguageModel(backbone, head, optimizer=sgd)
    strategy = (
        DDPStrategy(
            find_unused_parameters=False,
            process_group_backend="gloo",
            timeout=timedelta(seconds=60),
        )  # fmt: skip
        if devices > 1
        else "auto"
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=RankData())
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    torch.save({"state": state, "steps": trainer.global_step},
               folder / f"rank{trainer.global_rank}.pt")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
