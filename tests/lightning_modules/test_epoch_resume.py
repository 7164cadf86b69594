"""``lightning_modules/epoch_resume.py``: what a mid-epoch checkpoint keeps of the epoch and how
a rank reads its own share back. The whole resume (every task, DDP) is ``tests/test_resume.py``."""

from types import SimpleNamespace

import torch

from lightning_modules.epoch_resume import read_epoch_state, rng_states, set_rng_states


def test_the_generators_given_back_draw_the_same_numbers_again():
    torch.manual_seed(3)
    saved = rng_states(torch.device("cpu"))
    first = torch.rand(5)
    torch.rand(100)  # the generator moves on
    set_rng_states(saved, torch.device("cpu"))
    assert torch.equal(torch.rand(5), first)


def test_a_ranks_row_of_gathered_states_is_given_back_whole():
    """Under DDP the states are stacked, one row a rank; row 1 is a view at an offset, which
    torch.set_rng_state would read from its storage's start."""
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        states.append(rng_states(torch.device("cpu"))["cpu"])
    torch.manual_seed(2)
    expected = torch.rand(5)
    gathered = torch.stack(states)
    set_rng_states({"cpu": gathered[1]}, torch.device("cpu"))
    assert torch.equal(torch.rand(5), expected)


def test_on_cuda_the_devices_generator_is_kept_and_given_back(monkeypatch):
    """The CUDA branch, run without a GPU: the device's state is saved beside the CPU's and
    given back to that device from a contiguous CPU copy (as torch.cuda.set_rng_state wants)."""
    device = torch.device("cuda", 1)
    cuda_state = torch.arange(16, dtype=torch.uint8)
    calls = []
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda d: calls.append(("get", d)) or cuda_state
    )
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: calls.append(("set", s, d)))
    saved = rng_states(device)
    assert set(saved) == {"cpu", "cuda"} and torch.equal(saved["cuda"], cuda_state)
    gathered = torch.stack([torch.zeros(16, dtype=torch.uint8), saved["cuda"]])
    set_rng_states({"cpu": saved["cpu"], "cuda": gathered[1]}, device)
    (_, got), (_, given, to) = calls
    assert got == device and to == device
    assert torch.equal(given, cuda_state) and given.is_contiguous()
    assert given.storage_offset() == 0 and given.device.type == "cpu"
    calls.clear()
    set_rng_states(saved, torch.device("cpu"))  # a CUDA checkpoint resumed on a CPU: CPU only
    assert calls == []


def _trainer(world_size, rank=0):
    return SimpleNamespace(world_size=world_size, global_rank=rank)


def test_each_rank_reads_its_own_row_and_another_world_size_reads_nothing():
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    checkpoint = {
        "train_epoch_state": {
            "world_size": 2,
            "state": (rows, rows + 10),
            "metrics": {"train": {"total": torch.tensor([5.0, 6.0])}},
            "rng": {"cpu": torch.tensor([[7], [8]], dtype=torch.uint8)},
        }
    }
    mine = read_epoch_state(checkpoint, _trainer(2, rank=1))
    assert torch.equal(mine["state"][0], rows[1]) and torch.equal(mine["state"][1], rows[1] + 10)
    assert mine["metrics"]["train"]["total"].item() == 6.0
    assert mine["rng"]["cpu"].tolist() == [8]
    assert read_epoch_state(checkpoint, _trainer(1)) is None  # fewer ranks: the sums start anew
    assert read_epoch_state({}, _trainer(2)) is None
    del checkpoint["train_epoch_state"]["rng"]  # written before the generators were saved
    assert read_epoch_state(checkpoint, _trainer(2, rank=0))["rng"] is None
    one = {"language_model_train_state": {"world_size": 1, "state": None, "metrics": {}}}
    assert read_epoch_state(one, _trainer(1)) == {"rng": None, **one["language_model_train_state"]}
