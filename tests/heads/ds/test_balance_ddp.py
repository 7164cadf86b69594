"""DS-Softmax's load balance under DDP is the global batch's term.

``CV(sum_h G(h))^2`` (DS paper, section 3.3, "Loading balance") is not linear in the expert
importance, so the mean of the ranks' own terms (what DDP's gradient average made of it) is
not the term of the union of their batches. Two gloo processes on the CPU with different
batches of one size, a DS head with every loss term on behind a linear layer, must get the
gradients of one process on the union (and every rank the union's regulariser); that one
process runs in a world of one, where the head must make no collective call.

    python -m tests.heads.ds.test_balance_ddp <rank> <folder> <store port>

The ranks meet at a TCP store the test hosts on a port the system chose, and the world of one
at a store of its own process: a ``file://`` rendezvous hung now and then past the test's
limit in CI (torch's FileStore, whose last user deletes the file, is known to hang there).

Run as a module from the repository root (the test starts the processes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as collectives
from torch.nn.parallel import DistributedDataParallel

from heads import IGNORE_INDEX, DSSoftmaxHead
from heads.ds.softmax import sum_over_ranks

REPO = Path(__file__).resolve().parents[3]
FEATURES, HIDDEN, VOCAB, EXPERTS, ROWS = 5, 8, 11, 3, 9  # ROWS per rank
OPTIONS = {"num_experts": EXPERTS, "bias": True, "lambda_lasso": 0.01,
           "lambda_expert": 0.02, "lambda_load": 10.0}  # fmt: skip


def rank_batch(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank`` of 2's rows, or with ``world`` 1 the union of both ranks' rows. Rank 1's
    inputs are shifted, so its tokens favour other experts than rank 0's; one row of each
    rank is ignored (the same count on both: the task loss is a mean per rank)."""
    generator = torch.Generator().manual_seed(0)
    parts = []
    for r in range(2):
        inputs = torch.randn(ROWS, FEATURES, generator=generator) + 1.5 * r
        target = torch.randint(0, VOCAB, (ROWS,), generator=generator)
        target[r] = IGNORE_INDEX
        parts.append((inputs, target))
    if world == 1:
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return parts[rank]


class Step(nn.Module):
    """A linear layer and the DS head: one step's loss (label smoothing, every regulariser)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights in every process
        self.backbone = nn.Linear(FEATURES, HIDDEN)
        self.head = DSSoftmaxHead(HIDDEN, VOCAB, **OPTIONS)

    def forward(self, inputs: torch.Tensor, target: torch.Tensor):
        output = self.head(self.backbone(inputs), target, label_smoothing=0.1)
        return output.loss + output.aux_loss, output.aux_loss


def one_step(rank: int, world: int, port: int | None) -> dict:
    """One training forward and backward (DDP over ``world`` gloo processes), then evaluation
    forwards (rank 0 two, rank 1 one: evaluation batches differ in number across ranks, so
    the head must not all-reduce there): the gradients, the regulariser and the head's
    collective calls. ``port``: the test's TCP store, or None in a world of one."""
    timeout = timedelta(seconds=30)
    if port is None:
        store = dist.HashStore()
    else:
        store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=False,
                              timeout=timeout)  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    calls = {"train": 0, "eval": 0}
    stage = "train"
    all_reduce = collectives.all_reduce

    def counted(tensor, *args, **kwargs):
        if world == 1:
            raise AssertionError("a collective in a world of one")
        calls[stage] += 1
        return all_reduce(tensor, *args, **kwargs)

    collectives.all_reduce = counted
    try:
        step = Step()
        ddp = DistributedDataParallel(step)
        inputs, target = rank_batch(rank, world)
        loss, aux = ddp(inputs, target)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in step.named_parameters()}
        stage = "eval"
        step.eval()
        with torch.no_grad():
            for _ in range(2 - rank):
                step(inputs, target)
    finally:
        collectives.all_reduce = all_reduce
        dist.destroy_process_group()
    return {"grads": grads, "aux": aux.detach(), "calls": calls}


def run_rank(rank: int, folder: Path, port: int) -> None:
    """Rank ``rank`` of 2 saves its step; then rank 0 the step of one process on the union of
    both ranks' rows, in a world of one."""
    torch.save(one_step(rank, 2, port), folder / f"rank{rank}.pt")
    if rank == 0:
        torch.save(one_step(0, 1, None), folder / "single.pt")


def test_outside_torch_distributed_the_sum_is_the_tensor_itself():
    local = torch.randn(3)
    assert not dist.is_initialized() and sum_over_ranks(local) is local


def test_the_load_balance_of_two_ranks_is_the_global_batch_term(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))  # fmt: skip
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    command = [sys.executable, "-m", "tests.heads.ds.test_balance_ddp"]
    processes = [
        subprocess.Popen(
            [*command, str(rank), str(tmp_path), str(server.port)],
            cwd=REPO,
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        for rank, log in enumerate(logs)
    ]
    for process in processes:
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            break  # killed below: its log names where it stood
    for process in processes:
        process.kill()  # a no-op on an ended process
        process.wait()
    del server
    for process, log in zip(processes, logs, strict=True):
        assert process.returncode == 0, log.read_text()[-3000:]
    single = torch.load(tmp_path / "single.pt")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for rank in ranks:
        assert rank["grads"].keys() == single["grads"].keys()
        for name, expected in single["grads"].items():
            torch.testing.assert_close(rank["grads"][name], expected, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
        torch.testing.assert_close(rank["aux"], single["aux"], rtol=1e-5, atol=0)
    # one all-reduce in the training forward, none in evaluation nor in a world of one
    assert single["calls"] == {"train": 0, "eval": 0}
    assert [rank["calls"] for rank in ranks] == [{"train": 1, "eval": 0}] * 2


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
