"""Translation under DDP, on two gloo processes on the CPU.

- A training step weighs every token of the step alike, whichever rank holds it. Token
  buckets give the ranks very different token counts in one step and DDP averages the ranks'
  gradients, so a mean of per-rank token means would weigh the tokens of the short batch
  more: the step must give the gradient of one process on the union of the ranks' batches,
  normalised per token (label smoothing included), and a regulariser of the step (DS-Softmax's
  group lasso) must keep its weight.
- A test split cut into fewer batches than ranks (Multi30k's on 4 or 8 GPUs) is still
  evaluated whole: the rank without a batch used to stop the run; the translations gathered
  from both ranks make the file one process writes.

    python -m tests.lightning_modules.test_translation_ddp <devices> <folder> <what>

``what``: ``softmax`` or ``ds`` (a training step), ``test`` (the test split). Run as a module
from the repository root: Lightning's DDP launcher re-executes this command line for rank 1
(as ``tests/ddp_fit.py``).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from datamodules import TranslationDataModule
from datamodules.pair_batches import collate_pairs
from heads import DSSoftmaxHead, Head, SoftmaxHead
from lightning_modules import Translation
from lightning_modules.backbones import Seq2SeqTransformer
from lightning_modules.decoding import DecodeConfig
from tests.datamodules.test_translation import TINY, write_corpus

REPO = Path(__file__).resolve().parents[2]
VOCAB, D, BOS = 24, 16, 1
# (source length, target length) of each rank's pairs: rank 0 holds 3 long pairs (27 target
# tokens), rank 1 a short one (3): a ratio like the one token buckets give
RANK_PAIRS = [[(9, 10), (8, 9), (7, 8)], [(3, 3)]]

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no"),
]


def rank_items(rank: int) -> list[dict]:
    """Rank ``rank``'s pairs of random ids, or with ``rank`` -1 both ranks'."""
    generator = torch.Generator().manual_seed(0)
    items = []
    for r, pairs in enumerate(RANK_PAIRS):
        for source, target in pairs:
            ids = torch.randint(2, VOCAB, (source + target,), generator=generator).tolist()
            if r == rank or rank < 0:
                items.append({"source_ids": ids[:source], "target_ids": ids[source:],
                              "index": len(items)})  # fmt: skip
    return items


class RankData(L.LightningDataModule):
    """One training batch: this rank's pairs, or on one process the union of both ranks'."""

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        items = rank_items(trainer.global_rank if trainer.world_size > 1 else -1)
        batch = collate_pairs(items, pad_id=BOS, bos_id=BOS)
        return DataLoader([batch], batch_size=None)


class SaveGradients(L.Callback):
    """Each rank's gradients as the optimizer sees them (DDP has averaged them), and the
    logged training loss."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters()}

    def on_train_end(self, trainer, pl_module) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        logged = {k: v.clone() for k, v in trainer.callback_metrics.items()}
        torch.save({"grads": self.grads, "logged": logged},
                   self.folder / f"rank{trainer.global_rank}.pt")  # fmt: skip


def translation(
    source_vocab: int,
    target_vocab: int,
    head: Callable[[int, int], Head] = SoftmaxHead,
    optimizer=torch.optim.SGD,
) -> Translation:
    torch.manual_seed(0)  # the same weights in every process
    backbone = Seq2SeqTransformer(source_vocab, target_vocab, model_size=D, num_heads=2,
                                  encoder_layers=1, decoder_layers=1, feedforward_size=32,
                                  dropout=0.0)  # fmt: skip
    output = head(D, target_vocab)
    return Translation(backbone, output, optimizer=optimizer, label_smoothing=0.1)


def trainer(devices: int, **kwargs) -> L.Trainer:
    strategy = (
        DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=60))
        if devices > 1
        else "auto"
    )
    return L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )  # fmt: skip


def train_step(devices: int, folder: Path, head: str) -> None:
    # DS: every regulariser (the load balance is the global batch's: heads/ds/softmax.py)
    ds = functools.partial(
        DSSoftmaxHead, num_experts=2, lambda_lasso=0.05, lambda_expert=0.05, lambda_load=10.0
    )
    model = translation(VOCAB, VOCAB, ds if head == "ds" else SoftmaxHead)
    fit = trainer(devices, max_steps=1, limit_val_batches=0, callbacks=[SaveGradients(folder)])
    fit.fit(model, datamodule=RankData())


def tiny_data(folder: Path) -> TranslationDataModule:
    # the 5 test lines fit in one batch of 64 tokens: fewer batches than 2 ranks
    return TranslationDataModule(path=str(folder / "corpus"), max_tokens=12, eval_max_tokens=64)


def evaluate(devices: int, folder: Path) -> None:
    data = tiny_data(folder)
    model = translation(data.src_vocab_size, data.vocab_size)
    model.load_state_dict(torch.load(folder / "model.pt"))
    model.decode = DecodeConfig(beam_size=2)
    model.translations_file = str(folder / f"translations{devices}.txt")
    evaluation = trainer(devices)
    (metrics,) = evaluation.test(model, datamodule=data)
    if evaluation.is_global_zero:
        torch.save(metrics, folder / f"test{devices}.pt")


def run_two_ranks(folder: Path, what: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.lightning_modules.test_translation_ddp", "2",
         str(folder), what],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("head", ["softmax", pytest.param("ds", marks=pytest.mark.slow)])
def test_a_ddp_step_weighs_every_token_of_both_ranks_alike(tmp_path, head):
    train_step(1, tmp_path / "single", head)  # in this process: the union of both ranks' pairs
    run_two_ranks(tmp_path / "ddp", head)
    single = torch.load(tmp_path / "single" / "rank0.pt")
    ranks = [torch.load(tmp_path / "ddp" / f"rank{r}.pt") for r in range(2)]
    assert single["grads"].keys() == ranks[0]["grads"].keys()
    for name, expected in single["grads"].items():
        for rank in ranks:
            torch.testing.assert_close(rank["grads"][name], expected, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
    # the logged loss and NLL are per token of the whole step too
    for key in ("train/loss", "train/nll"):
        expected = single["logged"][key]
        torch.testing.assert_close(ranks[0]["logged"][key], expected, rtol=1e-5, atol=0)


def test_a_test_split_in_fewer_batches_than_ranks_is_translated_whole(tmp_path):
    (tmp_path / "corpus").mkdir()
    splits = {"train": TINY, "val": TINY[:3], "test_2016_flickr": TINY[:5]}
    write_corpus(tmp_path / "corpus", splits)
    data = tiny_data(tmp_path)
    adam = functools.partial(torch.optim.Adam, lr=0.01)
    model = translation(data.src_vocab_size, data.vocab_size, optimizer=adam)
    trainer(1, max_steps=30, limit_val_batches=0).fit(model, datamodule=data)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    evaluate(1, tmp_path)  # in this process: the reference
    run_two_ranks(tmp_path, "test")
    lines = (tmp_path / "translations1.txt").read_text().splitlines()
    assert len(lines) == 5 and len(set(lines)) > 1  # a learnt model: the order shows
    # the test split in one batch on one process, cut in two for two ranks
    assert (tmp_path / "translations2.txt").read_text().splitlines() == lines
    single, ddp = torch.load(tmp_path / "test1.pt"), torch.load(tmp_path / "test2.pt")
    assert ddp["test/loss"] == pytest.approx(single["test/loss"], rel=1e-5)
    assert ddp["test/bleu"] == pytest.approx(single["test/bleu"], abs=1e-4)


if __name__ == "__main__":
    devices, folder, what = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    if what == "test":
        evaluate(devices, folder)
    else:
        train_step(devices, folder, what)
