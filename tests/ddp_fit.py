"""Test helper for ``tests/test_adaptive_ddp.py`` and ``tests/heads/test_graphs.py``: a tiny
LM trained on one process, or on two CPU processes (gloo) with ``find_unused_parameters=False``
as in ``configs/presets/ddp.yaml``. Each rank saves its final parameters. Its heads:

- ``adaptive``: rank 1's batches never touch the last tail cluster (and its second batch no
  tail cluster at all);
- ``softmax_graphs``: a softmax tied to the embedding, its steps through ``cuda_graphs``, on
  the CPU by the tests' stand-in capture (``tests.heads.test_graphs.Rerun``);
- ``softmax``: the same eagerly, the reference;
- ``adaptive_graphs``: ``adaptive`` by CUDA's whole-loss rows plan (run on the CPU), over the
  dense budget, its steps through ``cuda_graphs`` in slots (the task tells it the targets),
  captured by the stand-in.

    python -m tests.ddp_fit <devices> <folder> [<head>]

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

from heads import AdaptiveSoftmaxHead, SoftmaxHead
from heads.fused_cross_entropy import LossOptions
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


def main(devices: int, folder: Path, head: str = "adaptive") -> None:
    L.seed_everything(0)
    backbone = LSTMBackbone(VOCAB, embedding_size=D, hidden_size=D, input_dropout=0.0,
                            hidden_dropout=0.0, output_dropout=0.0)  # fmt: skip
    if head.startswith("adaptive"):
        adaptive = AdaptiveSoftmaxHead(D, VOCAB, cutoffs=CUTOFFS, div_value=2.0)
        graphs = head == "adaptive_graphs"
        if graphs:  # CUDA's plans on this CPU, over the dense budget: the rows plan in slots
            from heads.kernels import chunks

            chunks.GPU_PLAN_DEVICES.add("cpu")
            adaptive.loss_options = LossOptions(saved_bytes=0)
        model = LanguageModel(backbone, adaptive, optimizer=sgd,
                              loss_backend="rows" if graphs else "auto",
                              cuda_graphs=graphs)  # fmt: skip
    else:
        graphs = head == "softmax_graphs"
        model = LanguageModel(backbone, SoftmaxHead(D, VOCAB), optimizer=sgd, tie_weights=True,
                              cuda_graphs=graphs)  # fmt: skip
    if graphs:  # captured on this CPU by the tests' stand-in
        from heads import graphs as heads_graphs
        from tests.heads.test_graphs import Rerun

        heads_graphs.GRAPH_DEVICES.add("cpu")
        model._graphed_loss.capture = Rerun()
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
    graphed = getattr(model, "_graphed_loss", None)
    torch.save({"state": state, "steps": trainer.global_step,
                "captured": None if graphed is None else graphed.captured},
               folder / f"rank{trainer.global_rank}.pt")  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:4])
