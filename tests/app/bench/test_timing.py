"""app/bench/timing.py: a timed repeat of several steps back to back is their mean."""

import torch

from app.bench.run import parse_args
from app.bench.timing import time_once


def test_steps_back_to_back_are_timed_together_and_averaged():
    calls, readings = [], iter([10.0, 14.0])  # the clock at the start, then at the end
    seconds = time_once(lambda: calls.append(1), torch.device("cpu"), lambda: next(readings),
                        steps=2)  # fmt: skip
    assert len(calls) == 2 and seconds == 2.0


def test_steps_per_repeat_is_an_option_of_the_benchmark():
    assert parse_args(["--steps-per-repeat", "3"]).steps_per_repeat == 3
    assert parse_args([]).steps_per_repeat == 1


def test_compile_workers_are_shut_down_where_inductor_is_loaded(monkeypatch):
    """Before the timed rounds: Inductor's worker pools shut down where its compile module is
    loaded, nothing imported where it is not."""
    import sys
    import types

    from app.bench.timing import release_compile_workers

    calls = []
    fake = types.SimpleNamespace(shutdown_compile_workers=lambda: calls.append(1))
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    release_compile_workers()
    assert calls == [1]
    monkeypatch.delitem(sys.modules, "torch._inductor.async_compile")
    release_compile_workers()  # not loaded: nothing to shut, and nothing imported
    assert "torch._inductor.async_compile" not in sys.modules
