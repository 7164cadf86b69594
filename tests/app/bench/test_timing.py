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
