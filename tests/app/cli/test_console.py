"""The entry points' exit path (app/cli/console.py)."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from app.cli.console import exit_status
from heads.errors import UserError


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "user-error"])
def test_exit_destroys_the_gloo_group(fails: bool) -> None:
    """A Gloo group left to interpreter finalisation can abort the process (exit -6 instead of
    2 in a DDP run that met a NaN): the exit path destroys it while Python is whole."""

    def run() -> int:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)  # fmt: skip
        assert dist.is_initialized()
        if fails:
            raise UserError("bad config")
        return 0

    assert exit_status(run) == (2 if fails else 0)
    assert not dist.is_initialized()


def test_exit_without_a_group_is_untouched() -> None:
    assert exit_status(lambda: 3) == 3
    assert not dist.is_initialized()
