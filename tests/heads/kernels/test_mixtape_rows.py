"""Mixtape's rows plan (heads/kernels/mixtape_rows.py): the mean loss, the per-token NLL and
the gradients of all eight inputs equal Eq. 2-6 written plainly here and differentiated by
autograd in float64, for both tile bodies (eager; Triton under its interpreter, where Triton
is installed), at tile edges, K = 2, 4 and 8, with and without rare tokens, ignored targets,
label smoothing, gate noise, and the NLL output differentiated as well."""

import math
import os
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import heads.kernels.rows_ce as rows_ce
import heads.kernels.triton_gemm as triton_gemm
import heads.kernels.triton_mixtape_gemm as triton_mixtape_gemm
from heads.kernels.mixtape_rows import MixtapeRowsCrossEntropy, tile_logits_per_row
from heads.kernels.sigmoid_tree import sigmoid_tree_priors

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=["eager", "triton", "fused"])
def body(request, monkeypatch):
    """The tile body under test: ``triton`` through Triton's interpreter on this CPU;
    ``fused``: its rare block by the fused products (heads/kernels/triton_gemm.py) and,
    without label smoothing, its frequent block too (heads/kernels/triton_mixtape_gemm.py),
    in tiles of a few blocks a row."""
    if request.param in ("triton", "fused"):
        pytest.importorskip("triton", reason="Triton is an optional GPU extra")
        if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without CUDA
            pytest.skip("with CUDA, the gpu tests run the kernels on the device")
        monkeypatch.setattr(rows_ce, "TRITON_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(rows_ce, "TRITON_DTYPES", (*rows_ce.TRITON_DTYPES, torch.float64))
    if request.param == "fused":
        from tests.heads.kernels.test_triton_gemm import SMALL

        monkeypatch.setattr(triton_gemm, "GEMM_LAUNCH", SMALL)
        small = triton_mixtape_gemm.FrequentLaunch(block_m=16, block_n=32, block_k=16, block_e=16)
        monkeypatch.setattr(triton_mixtape_gemm, "FREQUENT_LAUNCH", small)
        monkeypatch.setattr(rows_ce, "FUSED_PRODUCTS", True)
        monkeypatch.setattr(rows_ce, "FUSED_DTYPES", (*rows_ce.FUSED_DTYPES, torch.float64))
    return request.param


def _case(n=11, k=4, s=70, rare=90, d=6, e=5, seed=0):
    """Float64 inputs requiring gradients; targets at both blocks' edges and two ignored."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).requires_grad_()

    inputs = {
        "contexts": draw(n, k, d), "gate_inputs": draw(n, k - 1, e, scale=2.0),
        "mixed": draw(n, d) if rare else None, "w_freq": draw(s, d), "b_freq": draw(s),
        "gate_weights": draw(s, e), "w_rare": draw(rare, d) if rare else None,
        "b_rare": draw(rare) if rare else None,
    }  # fmt: skip
    target = torch.randint(0, s + rare, (n,), generator=gen)
    v = s + rare
    target[:6] = torch.tensor([0, s - 1, min(s, v - 2), v - 1, -1, -1])[: min(6, n)]
    return inputs, target


def _reference(inputs, target, eps, noise=None):
    """``(mean loss, nll)``: Eq. 2-6 plainly, PyTorch's cross-entropy over the ``[N, V]``."""
    pre = torch.einsum("nke,se->nks", inputs["gate_inputs"], inputs["gate_weights"])
    if noise is not None:
        pre = pre + noise
    priors = sigmoid_tree_priors(pre.transpose(1, 2)).transpose(1, 2)  # [N, K, S], Eq. 3
    values = torch.einsum("nkd,sd->nks", inputs["contexts"], inputs["w_freq"])
    logits = (priors * values).sum(1) + inputs["b_freq"]  # Eq. 2
    if inputs["mixed"] is not None:
        rare = inputs["mixed"] @ inputs["w_rare"].t() + inputs["b_rare"]  # Eq. 6
        logits = torch.cat((logits, rare), 1)
    loss = F.cross_entropy(logits, target, ignore_index=-1, label_smoothing=eps)
    nll = F.cross_entropy(logits, target, ignore_index=-1, reduction="none")
    return loss, nll


def _rows(inputs, target, eps, tile, noise_std=0.0, seed=None, dtype=torch.float64):
    keep = target >= 0
    weight, unit = keep.double(), 1 / keep.sum().clamp_min(1).double()
    return MixtapeRowsCrossEntropy.apply(*inputs.values(), target, weight, unit, eps, noise_std,
                                         seed, dtype, tile, True)  # fmt: skip


def _grads(output, inputs):
    present = [x for x in inputs.values() if x is not None]
    return torch.autograd.grad(output, present)


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("rare", [90, 0])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("tile", [3, 11])
def test_loss_and_gradients_equal_the_plain_maths(body, k, rare, eps, tile):
    inputs, target = _case(k=k, rare=rare)
    expected_loss, expected_nll = _reference(inputs, target, eps)
    loss, nll = _rows(inputs, target, eps, tile)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(nll, expected_nll, rtol=1e-10, atol=1e-12)
    for got, want in zip(_grads(loss, inputs), _grads(expected_loss, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_the_nll_output_differentiated_too(body):
    """``loss + sum g nll``: the backward's extra walk with ``g`` as the rows' weights."""
    inputs, target = _case()
    g = torch.linspace(0.5, 2.0, target.numel(), dtype=torch.float64)
    loss, nll = _rows(inputs, target, 0.1, 4)
    expected_loss, expected_nll = _reference(inputs, target, 0.1)
    got = _grads(3 * loss + (g * nll).sum(), inputs)
    want = _grads(3 * expected_loss + (g * expected_nll).sum(), inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_gate_noise_is_the_same_in_the_forward_and_its_gradient(body):
    """With noise, the loss and gradients are those of the plain maths with the very noise
    drawn (the Triton tiles' from the seed, the eager ones' from the generator)."""
    inputs, target = _case(n=9, k=4)
    n, k, s = 9, 4, inputs["w_freq"].size(0)
    std, tile = 0.7, 4
    if body in ("triton", "fused"):
        from heads.kernels.triton_mixtape import gate_noise

        seed = torch.tensor([12345], dtype=torch.int64)
        noise = gate_noise(seed, n, k, s).double()
    else:
        seed = None
        torch.manual_seed(3)
        noise = torch.cat([torch.randn(min(tile, n - t0), k - 1, s, dtype=torch.float64)
                           for t0 in range(0, n, tile)])  # fmt: skip
        torch.manual_seed(3)
    loss, nll = _rows(inputs, target, 0.0, tile, std, seed)
    expected_loss, expected_nll = _reference(inputs, target, 0.0, std * noise)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-12)
    got = _grads(loss + nll.sum(), inputs)
    want = _grads(expected_loss + expected_nll.sum(), inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_under_a_capture_the_eager_tiles_draw_noise_without_the_generators_state(monkeypatch):
    """A CUDA graph's capture cannot read the generator's state (heads/graphs.py, stood in for
    here): the loss and its gradients are the plain maths' with the noise drawn; the NLL
    output's gradient, which would replay the noise from that state, is refused by name."""
    import heads.kernels.mixtape_rows as mixtape_rows
    from tests.heads.kernels.test_mixtape_frequent import _unreadable

    monkeypatch.setattr(mixtape_rows, "capturing", lambda device: True)
    monkeypatch.setattr(mixtape_rows, "rng_state", _unreadable)
    inputs, target = _case(n=9, k=4)
    n, k, s, std, tile = 9, 4, inputs["w_freq"].size(0), 0.7, 4
    torch.manual_seed(3)
    noise = torch.cat([torch.randn(min(tile, n - t0), k - 1, s, dtype=torch.float64)
                       for t0 in range(0, n, tile)])  # fmt: skip
    torch.manual_seed(3)
    loss, nll = _rows(inputs, target, 0.0, tile, std)
    expected_loss, _ = _reference(inputs, target, 0.0, std * noise)
    for a, b in zip(_grads(loss, inputs), _grads(expected_loss, inputs), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    loss, nll = _rows(inputs, target, 0.0, tile, std)
    with pytest.raises(RuntimeError, match="CUDA graph's capture cannot read"):
        _grads(loss + nll.sum(), inputs)


def test_masked_rows_of_minus_infinity_give_finite_gradients(body):
    """A frequent block whose logits are all ``-inf`` (a bias of ``-inf``): no NaN."""
    inputs, target = _case()
    with torch.no_grad():
        inputs["b_freq"].fill_(-math.inf)
    target = torch.where(target < 70, -1, target)
    loss, nll = _rows(inputs, target, 0.0, 4)
    grads = _grads(loss, {k: v for k, v in inputs.items() if k != "b_freq"})
    assert torch.isfinite(loss) and torch.isfinite(nll).all()
    assert all(torch.isfinite(g).all() for g in grads)


def test_no_tokens():
    inputs, target = _case(n=0)
    loss, nll = _rows(inputs, target[:0], 0.0, 4)
    assert loss.item() == 0 and nll.shape == (0,)
    assert all((g == 0).all() for g in _grads(loss, inputs))


def test_tile_planning_counts_what_a_tile_holds(monkeypatch):
    """A Triton tile holds its three products' outputs (padded) in their dtype: at V = 100k
    (S = 10k, K = 4), 16,384 tokens, bf16 on an 80 GiB GPU, 7 tiles of 2,341 rows (issue 28's
    bound: at most 64 iterations a step); eager tiles about six float32 ``[K, S]`` slices."""
    from heads.fused_cross_entropy import LossOptions, row_tile

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert tile_logits_per_row(cpu, torch.float32, 4, 100, 900) == (6 * 4 * 100 + 2 * 900, 4)
    monkeypatch.setattr(rows_ce, "triton_available", lambda: True)
    logits, itemsize = tile_logits_per_row(cuda, torch.bfloat16, 4, 10_000, 90_000)
    assert (logits, itemsize) == (7 * 10_048 + 90_048, 2)
    tile = row_tile(16_384, logits, cuda, LossOptions(device_memory=80 << 30), itemsize)
    assert (768 << 20) // (2 * logits) == 2510  # at most: 7 tiles, evened out to 2,341
    assert tile == 2341 and math.ceil(16_384 / tile) == 7


@pytest.mark.parametrize("head", ["mixtape-shared_gates", "mixtape-no_sharing",
                                  "mixtape-k8_weight_norm"])  # fmt: skip
def test_the_head_by_its_rows_plan_matches_the_reference(body, head):
    """``MixtapeHead`` with ``plan="rows"`` (what ``auto`` runs on CUDA), tiles of 4 rows, at
    the contract's edges in float64: ignored rows, label smoothing, every row ignored."""
    from heads.fused_cross_entropy import LossOptions
    from tests.heads.contract import HEADS, check_loss_matches_reference, run_check

    options = (LossOptions(plan="rows", rows=4),)
    run_check(partial(check_loss_matches_reference, options=options, inference=False),
              HEADS[head])  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused", [False, True], ids=["cublas", "fused_products"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_head_on_cuda_matches_float64(monkeypatch, dtype, fused, eps):
    """On CUDA (the Triton tiles where Triton is installed) under autocast, at a vocabulary
    that is no multiple of the tiles' column padding, against the same head in float64; the
    rare block by cuBLAS's products or the fused ones (half precision only), and the frequent
    block too without label smoothing."""
    import copy

    monkeypatch.setattr(rows_ce, "FUSED_PRODUCTS", fused)
    from heads import MixtapeHead
    from heads.fused_cross_entropy import LossOptions

    torch.manual_seed(0)
    head = MixtapeHead(64, 30_011, frequent_ratio=0.1).cuda()
    head.loss_options = LossOptions(plan="rows", rows=200, saved_bytes=0)  # not plainly
    reference = copy.deepcopy(head).double()
    reference.loss_options = LossOptions(plan="eager")
    hidden = torch.randn(700, 64, device="cuda")
    target = torch.randint(0, 30_011, (700,), device="cuda")
    target[:5] = torch.tensor([0, 3001, 3002, 30_010, -100])
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = head(hidden, target, label_smoothing=eps)
    out.loss.backward()
    expected = reference(hidden.double(), target, label_smoothing=eps)
    expected.loss.backward()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.loss.double(), expected.loss, rtol=tol, atol=tol)
    torch.testing.assert_close(out.nll.double(), expected.nll, rtol=tol, atol=tol * 10)
    for (name, p), q in zip(head.named_parameters(), reference.parameters(), strict=True):
        error = (p.grad.double() - q.grad).norm() / q.grad.norm().clamp_min(1e-30)
        assert error < tol * 2, (name, error.item())
