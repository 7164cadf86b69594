"""SVD-softmax on DS-Softmax experts (heads/ds/svd.py) against plain float64 references."""

import copy
import math

import pytest
import torch

from heads import HeadConfigError
from heads.ds.softmax import DSSoftmaxHead
from heads.ds.svd import ExpertPreviews, SVDPreview, expert_cost, expert_preview, preview_topk

pytestmark = pytest.mark.usefixtures("one_thread")


def low_rank(n: int, r: int, rank: int, generator: torch.Generator) -> torch.Tensor:
    """``[n, r]`` rows of exactly ``rank``: a preview of that rank is exact."""
    return torch.randn(n, rank, generator=generator) @ torch.randn(rank, r, generator=generator)


def reference_topk(rows, hidden, gate, k, rank, candidates):
    """SVD-softmax for one query as Shim et al. describe it, in float64 and in the paper's
    own terms: B = U S, h~ = V^T h; preview with B's first ``rank`` columns; the best
    ``candidates`` classes get the full view B_c h~; log Z over the full view of the
    candidates and the preview of the others."""
    u, s, vh = torch.linalg.svd(rows.double(), full_matrices=False)
    b, h = u * s, vh @ hidden.double()
    preview = b[:, :rank] @ h[:rank]
    chosen = sorted(range(rows.size(0)), key=lambda c: -float(preview[c]))[:candidates]
    logits = preview.clone()
    for c in chosen:
        logits[c] = b[c] @ h
    log_norm = torch.logsumexp(gate * logits, 0)
    best = sorted(chosen, key=lambda c: -float(logits[c]))[:k]
    return torch.tensor([gate * logits[c] - log_norm for c in best]), torch.tensor(best)


def test_preview_reconstructs_the_rows_at_full_rank():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(30, 7, generator=gen, dtype=torch.float64)
    basis, preview = expert_preview(rows, 7)
    torch.testing.assert_close(basis @ basis.T, torch.eye(7, dtype=torch.float64))
    torch.testing.assert_close(preview @ basis, rows)
    # a truncated preview keeps the largest singular directions: the best rank-3 error
    basis3, preview3 = expert_preview(rows, 3)
    singular = torch.linalg.svdvals(rows)
    error = torch.linalg.matrix_norm(rows - preview3 @ basis3)
    torch.testing.assert_close(error, singular[3:].square().sum().sqrt())


@pytest.mark.parametrize("candidates", [3, 8, 25])
def test_preview_topk_matches_the_papers_procedure(candidates):
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(25, 9, generator=gen, dtype=torch.float64)
    hidden = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    gate = torch.rand(6, generator=gen, dtype=torch.float64) + 0.5
    basis, preview = expert_preview(rows, 4)
    values, where = preview_topk(rows, basis, preview, hidden, gate, 3, candidates)
    for n in range(6):
        ref_values, ref_where = reference_topk(rows, hidden[n], gate[n], 3, 4, candidates)
        torch.testing.assert_close(values[n], ref_values)
        assert torch.equal(where[n], ref_where)


def test_all_candidates_or_a_low_rank_expert_give_the_exact_answer():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, 12, generator=gen, dtype=torch.float64)
    gate = torch.rand(10, generator=gen, dtype=torch.float64)
    for rows, rank, candidates in (
        (torch.randn(40, 12, generator=gen, dtype=torch.float64), 2, 40),  # every class exact
        (low_rank(40, 12, 3, gen).double(), 3, 5),  # the preview is exact: any candidates
    ):
        basis, preview = expert_preview(rows, rank)
        exact = (gate[:, None] * (hidden @ rows.T)).log_softmax(-1).topk(5)
        values, where = preview_topk(rows, basis, preview, hidden, gate, 5, candidates)
        torch.testing.assert_close(values, exact.values)
        assert torch.equal(where, exact.indices)


def test_candidates_never_fewer_than_k():
    gen = torch.Generator().manual_seed(3)
    rows, hidden = torch.randn(20, 6, generator=gen), torch.randn(4, 6, generator=gen)
    basis, preview = expert_preview(rows, 2)
    values, where = preview_topk(rows, basis, preview, hidden, torch.ones(4), 6, candidates=1)
    assert where.shape == (4, 6) and all(len(set(r)) == 6 for r in where.tolist())
    assert (values[:, :-1] >= values[:, 1:]).all()  # best first


@pytest.mark.parametrize(
    "options, message",
    [
        ({"rank": 0}, "svd_rank"),
        ({"rank": 2.5}, "svd_rank"),
        ({"candidates": 0.0}, "svd_candidates"),
        ({"candidates": 1.5}, "svd_candidates"),
        ({"min_classes": -1}, "svd_min_classes"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(HeadConfigError, match=message):
        SVDPreview(**options)


def test_which_experts_get_a_preview_and_their_cost():
    spec = SVDPreview(rank=16, candidates=0.5, min_classes=1000)
    assert not spec.applies_to(1000, 201) and spec.applies_to(1001, 201)
    assert not SVDPreview(rank=16, min_classes=0).applies_to(5000, 16)  # no smaller than rows
    assert expert_cost(800, 201, spec, 10) == 800.0  # exact
    # W for the coordinates, n W / r for the preview, N for the full view (in rows)
    assert expert_cost(2000, 200, spec, 10) == pytest.approx(16 + 2000 * 16 / 200 + 1000)
    assert expert_cost(2000, 200, SVDPreview(16, 0.001, 0), 10) == pytest.approx(16 + 160 + 10)
    assert spec.candidate_count(3) == 2 and SVDPreview(16, 0.1, 0).candidate_count(25) == 3


def test_expert_previews_pack_only_the_large_experts():
    gen = torch.Generator().manual_seed(4)
    experts = [torch.randn(n, 5, generator=gen) for n in (3, 12, 7, 20)]
    packed = ExpertPreviews(experts, SVDPreview(rank=2, candidates=0.25, min_classes=10))
    assert packed.rank == [0, 2, 0, 2] and packed.candidates == [1, 3, 2, 5]
    for e in (1, 3):
        basis, preview = expert_preview(experts[e], 2)
        torch.testing.assert_close(packed.basis[e], basis)
        torch.testing.assert_close(packed.preview[e], preview)
        offset = int(packed.preview_offsets[e])  # where the C kernel finds them
        torch.testing.assert_close(packed.preview_packed[offset : offset + preview.numel()],
                                   preview.reshape(-1))  # fmt: skip
    assert packed.basis[0] is None and packed.any


def svd_head(bias: bool, dtype=torch.float64, rank: int = 3) -> DSSoftmaxHead:
    """Three experts of 40, 60 and 8 classes whose rows (bias column included) have rank 3:
    a rank-3 preview is exact, so SVD top-k must equal the exact one."""
    gen = torch.Generator().manual_seed(5)
    vocab, hidden = 80, 10
    head = DSSoftmaxHead(hidden, vocab, num_experts=1, bias=bias, svd_rank=rank,
                         svd_candidates=0.1, svd_min_classes=10)  # fmt: skip
    sizes = [40, 60, 8]
    classes = torch.cat([torch.randperm(vocab, generator=gen)[:n].sort().values for n in sizes])
    weight = low_rank(classes.numel(), hidden + int(bias), 3, gen)
    head.set_structure(weight, classes, sizes, torch.randn(3, hidden, generator=gen))
    return head.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("bias", [False, True])
def test_head_svd_topk_is_exact_on_low_rank_experts(bias, dtype):
    """Through ``DSSoftmaxHead.topk``: batch 1 and batched, the C kernel (float32) and the
    PyTorch paths (float64), before and after an in-place update (the previews follow)."""
    head = svd_head(bias, dtype)
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(30, head.hidden_size, generator=gen).to(dtype)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {}
    for _ in range(2):
        exact = head.log_prob(hidden).topk(4)
        assert head._inference_cache().previews.rank == [3, 3, 0]  # the 8-class expert: exact
        batched = head.topk(hidden, 4)
        single = [head.topk(hidden[n : n + 1], 4) for n in range(hidden.size(0))]
        for values, indices in (batched, tuple(map(torch.cat, zip(*single, strict=True)))):
            torch.testing.assert_close(values, exact.values, **tol)
            assert torch.equal(indices, exact.indices)
        with torch.no_grad():  # another rank-3 matrix, in place: stale previews would miss
            weight = low_rank(head.weight.size(0), head.row_size, 3, gen)
            head.weight.copy_(weight)
    assert head.log_prob(hidden).logsumexp(-1).abs().max() < 1e-5  # log_prob stays exact


def test_svd_topk_is_an_approximation_on_full_rank_experts():
    """On generic rows a small preview misses classes: the option really changes topk, and
    never log_prob."""
    head = svd_head(bias=False, rank=1)
    with torch.no_grad():
        head.weight.normal_()
    hidden = torch.randn(200, head.hidden_size, dtype=torch.float64)
    exact = head.log_prob(hidden)
    values, indices = head.topk(hidden, 4)
    assert not torch.equal(indices, exact.topk(4).indices)
    head.set_svd_preview(None)
    torch.testing.assert_close(head.log_prob(hidden), exact)
    assert torch.equal(head.topk(hidden, 4)[1], exact.topk(4).indices)


def test_bad_head_options():
    with pytest.raises(HeadConfigError, match="svd_rank"):
        DSSoftmaxHead(8, 20, svd_rank=-1)
    with pytest.raises(HeadConfigError, match="svd_candidates"):
        DSSoftmaxHead(8, 20, svd_rank=4, svd_candidates=2.0)
    assert DSSoftmaxHead(8, 20).svd_preview is None
    assert math.isclose(DSSoftmaxHead(8, 20, svd_rank=4).svd_preview.candidates, 0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
def test_svd_topk_on_cuda_matches_cpu(bias):
    """The PyTorch preview path on a GPU (previews built there too): the CPU's answers."""
    head = svd_head(bias)
    hidden = torch.randn(30, head.hidden_size, dtype=torch.float64)
    expected = head.topk(hidden, 4)
    cuda_head = copy.deepcopy(head).cuda()
    batched = cuda_head.topk(hidden.cuda(), 4)
    single = [cuda_head.topk(hidden[n : n + 1].cuda(), 4) for n in range(hidden.size(0))]
    for values, indices in (batched, tuple(map(torch.cat, zip(*single, strict=True)))):
        assert values.is_cuda
        torch.testing.assert_close(values.cpu(), expected[0])
        assert torch.equal(indices.cpu(), expected[1])


def test_native_svd_topk_matches_the_float64_path_on_full_rank_experts():
    """Where the preview is an approximation, the C kernel (float32, batch 1 and batched)
    makes the same approximation as the float64 PyTorch path: same candidates, same top-k,
    same normaliser over candidates' exact logits and the others' previews."""
    head = svd_head(bias=True, dtype=torch.float32, rank=2)
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=gen))
    reference = copy.deepcopy(head).double()
    hidden = torch.randn(40, head.hidden_size, generator=gen)
    expected = reference.topk(hidden.double(), 4)
    assert not torch.equal(expected[1], reference.log_prob(hidden.double()).topk(4).indices)
    batched = head.topk(hidden, 4)
    single = tuple(map(torch.cat, zip(*[head.topk(h[None], 4) for h in hidden], strict=True)))
    for values, indices in (batched, single):
        assert values.dtype == torch.float32
        assert torch.equal(indices, expected[1])
        torch.testing.assert_close(values.double(), expected[0], rtol=1e-4, atol=1e-4)
