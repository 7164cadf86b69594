"""heads/kernels/mixture_lse.py (MoS's label-smoothing term, CPU plan): ``sum_x logsumexp_k(a_k
+ z_{k,x})`` and its gradients equal the plain float64 maths, and each chunk's ``[N, K, C]``
temporaries are gone before the next chunk's logits are made: the forward's shifted logits in
place (no ``z + a`` beside ``z``), the backward's ``z`` and ``r`` dropped at the chunk's end."""

from __future__ import annotations

import json

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from heads.kernels.mixture_lse import MixtureLogProbSum

pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(n, k, v, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=gen, dtype=dtype).requires_grad_()
            for s in ((n, k, d), (v, d), (v,), (n, k))]  # fmt: skip


def test_values_and_gradients_equal_the_plain_maths():
    contexts, weight, bias, shift = _inputs(5, 3, 23, 4, torch.float64)
    g = torch.linspace(-1.0, 2.0, 5, dtype=torch.float64)
    got = MixtureLogProbSum.apply(contexts, weight, bias, shift, torch.float64, 7)
    z = torch.einsum("nkd,vd->nkv", contexts, weight) + bias  # [N, K, V]
    want = torch.logsumexp(shift[:, :, None] + z, 1).sum(1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inputs = (contexts, weight, bias, shift)
    for a, b in zip(torch.autograd.grad(got, inputs, g), torch.autograd.grad(want, inputs, g),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _peak(fn, tmp_path) -> tuple[int, object]:
    """The most CPU memory allocated at once during ``fn()`` over what was allocated before
    (the profiler's running total, taken from its first event's)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    memory = [e["args"] for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("name") == "[memory]"]  # fmt: skip
    start = memory[0]["Total Allocated"] - memory[0]["Bytes"]
    return max(m["Total Allocated"] for m in memory) - start, out


def test_one_chunks_temporaries_at_a_time(tmp_path):
    """Peaks in chunks of ``[N, K, C]`` float32: the forward's logits, a softmax's exps and
    small rows (2.7; were 3.7 with ``z + a`` beside ``z``), the backward's the same plus the
    gradients themselves (0.7 here; were 3.7 with the last chunk's ``z`` and ``r`` alive while
    the next one's were made)."""
    n, k, v, d, width = 64, 3, 8192, 16, 1024
    contexts, weight, bias, shift = _inputs(n, k, v, d, torch.float32)
    chunk = n * k * width * 4
    grads = sum(x.numel() for x in (contexts, weight, bias, shift)) * 4
    inputs = (contexts, weight, bias, shift, torch.float32, width)
    forward, total = _peak(lambda: MixtureLogProbSum.apply(*inputs), tmp_path)
    backward, _ = _peak(lambda: total.sum().backward(), tmp_path)
    assert forward < 3 * chunk, forward / chunk
    assert backward - grads < 2.5 * chunk, (backward - grads) / chunk
