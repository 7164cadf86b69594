"""heads/kernels/mixtape_frequent.py's gate noise under a CUDA graph's capture (heads/graphs.py),
which cannot read the generator's state: the column plans keep the blocks' noise for the
backward instead of replaying it, with the same outputs and gradients (float64, on the CPU,
the capture stood in for)."""

import pytest
import torch

import heads.kernels.compiled_lse as compiled_lse
import heads.kernels.mixtape_frequent as mixtape_frequent
from tests.heads.kernels.test_compiled_mixtape import COMPILED, EAGER, _inputs, _outputs_and_grads

pytestmark = pytest.mark.usefixtures("one_thread")


def _unreadable(device):
    raise RuntimeError("a capture cannot read the generator's state")


@pytest.mark.parametrize("options", [EAGER, COMPILED], ids=["eager", "compiled"])
def test_under_a_capture_the_noise_is_kept_not_replayed(options, monkeypatch):
    monkeypatch.setattr(compiled_lse, "COMPILE_BACKEND", "aot_eager")
    tensors, target = _inputs(4, 7, 12)
    try:
        want, _ = _outputs_and_grads(options, tensors, target, noise=0.7)
        monkeypatch.setattr(mixtape_frequent, "capturing", lambda device: True)
        monkeypatch.setattr(mixtape_frequent, "rng_state", _unreadable)
        got, _ = _outputs_and_grads(options, tensors, target, noise=0.7)
    finally:
        torch._dynamo.reset()
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_outside_a_capture_the_cpu_never_counts_as_capturing():
    assert not mixtape_frequent.capturing(torch.device("cpu"))
