"""The C batch-1 top-k of DS-Softmax (heads/ds/native/ds_topk.c) against the PyTorch paths."""

import shutil

import pytest
import torch

from heads.ds.native import ds_topk_kernels
from heads.ds.softmax import DSSoftmaxHead
from heads.user_cache import CACHE_ENV

needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("cc", "gcc", "clang")),
    reason="the native kernel is optional: this machine has no C compiler",
)


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """An empty build cache and no memoised kernel, restored afterwards."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    ds_topk_kernels.cache_clear()
    yield tmp_path
    ds_topk_kernels.cache_clear()


def uneven_head(bias: bool, hidden: int = 37, vocab: int = 300, seed: int = 0) -> DSSoftmaxHead:
    """Experts of uneven sizes (not multiples of the kernel's 4-row blocks), an odd hidden
    size (not a multiple of the vector width), float32."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [7, 30, 1, 121, 64, 13]
    rows = torch.cat([torch.randperm(vocab, generator=gen)[:s].sort().values for s in sizes])
    head = DSSoftmaxHead(hidden, vocab, num_experts=1, bias=bias)
    weight = torch.randn(rows.numel(), hidden + int(bias), generator=gen)
    head.set_structure(weight, rows, sizes, torch.randn(len(sizes), hidden, generator=gen))
    return head.eval()


@needs_compiler
@pytest.mark.parametrize("bias", [False, True])
def test_native_topk_matches_the_pytorch_path_and_the_dense_reference(bias):
    head = uneven_head(bias)
    assert head._inference_cache().native is not None  # the C path is the one under test
    hidden = torch.randn(200, head.hidden_size)
    reference = head.log_prob(hidden)
    chosen = head.select(hidden)[0]
    assert len(set(chosen.tolist())) >= 4  # several experts are exercised
    for _ in range(2):
        with torch.inference_mode():
            for n in range(hidden.size(0)):
                query = hidden[n : n + 1]
                k = min(5, head.expert_sizes()[int(chosen[n])])
                values, classes = head.topk(query, k)
                torch_values, torch_classes = head._inference_cache().topk_one(query[0], k)
                torch.testing.assert_close(values, torch_values, rtol=1e-5, atol=1e-5)
                assert torch.equal(classes, torch_classes)
                top = reference[n].topk(k)
                torch.testing.assert_close(values[0], top.values, rtol=1e-5, atol=1e-5)
                assert torch.equal(classes[0], top.indices)
        with torch.no_grad():  # an optimizer-like in-place step: the kernel reads the new values
            head.weight.mul_(-0.5).add_(0.1)
            head.gate.mul_(-2.0)
        reference = head.log_prob(hidden)
        chosen = head.select(hidden)[0]


@needs_compiler
def test_native_topk_falls_back_when_the_expert_is_smaller_than_k():
    head = uneven_head(bias=False)
    hidden = torch.randn(60, head.hidden_size)
    expert = head.select(hidden)[0]
    reference = head.log_prob(hidden)
    for n in range(hidden.size(0)):
        size = head.expert_sizes()[int(expert[n])]
        values, classes = head.topk(hidden[n : n + 1], size + 2)
        torch.testing.assert_close(values[0, :size], reference[n].topk(size).values)
        assert torch.isinf(values[0, size:]).all()  # classes outside: probability 0
        assert len(set(classes[0].tolist())) == size + 2


@needs_compiler
def test_native_topk_under_autocast_and_with_a_strided_query():
    head = uneven_head(bias=True)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(head.hidden_size, 3, generator=gen).T  # rows not contiguous
    reference = head.log_prob(hidden.contiguous()).topk(1)
    for n in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the C path stays float32
            values, classes = head.topk(hidden[n : n + 1].contiguous(), 1)
        assert classes.item() == reference.indices[n].item()
        torch.testing.assert_close(values[0], reference.values[n], rtol=1e-5, atol=1e-5)
        values, classes = head.topk(hidden[n : n + 1], 1)  # strided: the PyTorch path
        assert classes.item() == reference.indices[n].item()
        torch.testing.assert_close(values[0], reference.values[n])


def test_disabled_by_environment(fresh_kernel, monkeypatch):
    monkeypatch.setenv("OUTPUT_HEADS_NATIVE", "0")
    assert ds_topk_kernels() is None
    head = uneven_head(bias=False)
    assert head._inference_cache().native is None
    hidden = torch.randn(1, head.hidden_size)
    top = head.log_prob(hidden)[0].topk(1)
    values, classes = head.topk(hidden, 1)
    assert classes.item() == top.indices.item()
    torch.testing.assert_close(values[0], top.values)


def test_a_failing_compiler_leaves_the_pytorch_path(fresh_kernel, monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")  # exists everywhere, always fails
    assert ds_topk_kernels() is None
    assert "DS-Softmax top-k: native kernel not built" in caplog.text
    assert not list(fresh_kernel.rglob("*.so"))


@needs_compiler
def test_built_once_into_the_user_cache(fresh_kernel):
    assert ds_topk_kernels() is not None
    built = list(fresh_kernel.rglob("ds_topk_*.so"))
    assert len(built) == 1
    ds_topk_kernels.cache_clear()
    stamp = built[0].stat().st_mtime_ns
    assert ds_topk_kernels() is not None  # loaded, not rebuilt
    assert built[0].stat().st_mtime_ns == stamp


def spy_on_batches(head: DSSoftmaxHead) -> list[int]:
    """Records the batch sizes the C batch kernel answers for ``head``."""
    native = head._inference_cache().native
    calls, batch = [], native.batch

    def recorded(hidden, k):
        calls.append(hidden.size(0))
        return batch(hidden, k)

    native.batch = recorded
    return calls


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
def test_native_batch_matches_the_dense_reference(bias, threads):
    """Batches sorted by expert in C: the dense distribution's top-k, rows whose expert is
    smaller than k completed as the PyTorch path does, queries with a row stride."""
    head = uneven_head(bias)
    calls = spy_on_batches(head)
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(40, head.hidden_size + 3, generator=gen)
    hidden = wide[:, : head.hidden_size]  # row stride d + 3, unit column stride
    reference = head.log_prob(hidden.contiguous())
    sizes = torch.tensor(head.expert_sizes())[head.select(hidden)[0]]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        values, classes = head.topk(hidden, 5)
    finally:
        torch.set_num_threads(previous)
    assert calls == [40]  # the C kernel answered the whole batch
    for n in range(40):
        take = min(5, int(sizes[n]))
        top = reference[n].topk(take)
        torch.testing.assert_close(values[n, :take], top.values, rtol=1e-5, atol=1e-5)
        assert torch.equal(classes[n, :take], top.indices)
        assert torch.isinf(values[n, take:]).all()  # outside the expert: probability 0
        assert len(set(classes[n].tolist())) == 5
    assert (sizes < 5).any() and (sizes >= 5).any()  # both cases were exercised


@needs_compiler
def test_many_queries_per_expert_go_to_the_per_expert_products():
    head = uneven_head(bias=False)
    calls = spy_on_batches(head)
    hidden = torch.randn(500, head.hidden_size)  # ~80 per expert: matrix products pay more
    values, classes = head.topk(hidden, 1)
    assert calls == []
    top = head.log_prob(hidden).topk(1)
    torch.testing.assert_close(values, top.values)
    assert torch.equal(classes, top.indices)


@needs_compiler
def test_profile_times_the_batch_1_path():
    head = uneven_head(bias=True)
    hidden = torch.randn(50, head.hidden_size)
    sizes = torch.tensor(head.expert_sizes())[head.select(hidden)[0]]
    hidden = hidden[sizes >= 3]
    (values, classes), stages = head._inference_cache().profile(hidden, 3)
    answers = [head.topk(hidden[n : n + 1], 3) for n in range(hidden.size(0))]
    torch.testing.assert_close(values, torch.cat([v for v, _ in answers]))
    assert torch.equal(classes, torch.cat([c for _, c in answers]))
    assert set(stages) == {"gate", "expert_rows", "svd_select", "normalise_topk", "kernel_total"}
    assert all(t >= 0 for t in stages.values()) and stages["svd_select"] == 0  # no preview
    parts = stages["gate"] + stages["expert_rows"] + stages["normalise_topk"]
    assert 0 < parts <= stages["kernel_total"]


@needs_compiler
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_native_log_probabilities_are_float_accurate(scale):
    """The kernel's own (vectorised) exp and its log-sum-exp: values within float32 rounding
    of a float64 softmax of the same float32 inputs, also with logits of a few hundred."""
    head = uneven_head(bias=True)
    with torch.no_grad():
        head.weight.mul_(scale)
    hidden = torch.randn(60, head.hidden_size)
    sizes = torch.tensor(head.expert_sizes())[head.select(hidden)[0]]
    hidden = hidden[sizes >= 3]
    exact = head.double()  # the same float32 numbers, computed in float64
    reference = exact.log_prob(hidden.double())
    head = exact.float()
    values = torch.cat([head.topk(hidden[n : n + 1], 3)[0] for n in range(hidden.size(0))])
    largest_logit = reference.nan_to_num(neginf=0).abs().amax(1, keepdim=True)
    error = (values.double() - reference.topk(3).values).abs()
    assert (error <= 2e-6 * (1 + largest_logit)).all()
