"""SVD-softmax post-approximation of DS-Softmax experts (ds-softmax.txt, section 4.6, Table 3).

SVD-softmax (Shim et al. 2017) speeds up a trained softmax ``z = A h`` (``A [n, r]``) with
``A = U S V^T``: a *preview* scores every class with the ``W`` largest singular directions
only, ``z~ = (A V_W)(V_W^T h)`` (``n W + W r`` products instead of ``n r``), and the ``N``
classes with the best preview get their exact logit, the *full view* ``z_c = A_c h``. The
normaliser sums the exact logits of the candidates and the previews of the other classes.
DS-Softmax applies it per expert, each expert being a softmax over its own classes, to the
experts holding more than about 1,000 classes (the paper's "SVD-50": ``W = 16`` preview
dimensions, the best 50% of the classes in full view; "SVD-10": 10%).

Two economies over the paper's description, same numbers in exact arithmetic: the full view
uses the original rows ``A_c h`` (equal to ``(U S)_c (V^T h)``), so only ``V_W`` is kept and
the query costs ``W r`` instead of ``r^2`` to transform; and only the top-``k`` candidates
are sorted. With a bias, ``A = [W | b]`` and ``h = [h; 1]``.

The exact ``log_prob`` never uses any of this: only ``DSSoftmaxHead.topk`` does, when the
head's ``svd_rank`` is set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from heads.errors import HeadConfigError


@dataclass(frozen=True)
class SVDPreview:
    """Which experts get a preview, and how large it is.

    rank: preview dimensions ``W`` (the paper's window width, 16).
    candidates: share of an expert's classes that get exact logits (SVD-10: 0.1, SVD-50:
        0.5); never fewer than the ``k`` asked for.
    min_classes: only experts with more classes than this get a preview (the paper: 1,000;
        smaller experts are cheaper exactly).
    """

    rank: int = 16
    candidates: float = 0.5
    min_classes: int = 1000

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank <= 0:
            raise HeadConfigError(f"svd_rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.candidates, (int, float)) or not 0 < self.candidates <= 1:
            raise HeadConfigError(
                f"svd_candidates is the share of an expert's classes given exact logits, "
                f"in (0, 1]; got {self.candidates!r}"
            )
        if not isinstance(self.min_classes, int) or self.min_classes < 0:
            raise HeadConfigError(
                f"svd_min_classes must be a non-negative integer, got {self.min_classes!r}"
            )

    def applies_to(self, classes: int, row_size: int) -> bool:
        """An expert of ``classes`` rows of ``row_size`` gets a preview: it is large enough, and
        the preview is smaller than the rows."""
        return classes > self.min_classes and self.rank < row_size

    def candidate_count(self, classes: int) -> int:
        return max(1, min(classes, math.ceil(self.candidates * classes)))


def expert_preview(rows: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(basis [W, r], preview [n, W])`` of one expert's rows ``A [n, r]``: ``V_W^T`` (top right
    singular vectors) and ``A V_W = U_W S_W``, computed in float64, returned in ``rows.dtype``."""
    exact = rows.detach().double()
    _, _, vh = torch.linalg.svd(exact, full_matrices=False)
    basis = vh[:rank]
    return basis.to(rows.dtype).contiguous(), (exact @ basis.T).to(rows.dtype).contiguous()


class ExpertPreviews:
    """The previews of every expert that gets one, per expert and packed for the C kernel.

    ``rank[e]`` is 0 for an expert answered exactly. ``basis[e]``/``preview[e]`` are views of
    the packed ``basis_packed``/``preview_packed`` (flat, float offsets in ``*_offsets``).
    """

    def __init__(self, experts: list[torch.Tensor], options: SVDPreview) -> None:
        self.options = options
        self.rank: list[int] = []
        self.candidates: list[int] = []
        self.basis: list[torch.Tensor | None] = []
        self.preview: list[torch.Tensor | None] = []
        ref = experts[0]
        bases, previews, basis_offsets, preview_offsets = [], [], [], []
        basis_at = preview_at = 0
        for rows in experts:
            n, r = rows.shape
            basis_offsets.append(basis_at)
            preview_offsets.append(preview_at)
            if options.applies_to(n, r):
                basis, preview = expert_preview(rows, options.rank)
                bases.append(basis.reshape(-1))
                previews.append(preview.reshape(-1))
                basis_at += basis.numel()
                preview_at += preview.numel()
                self.rank.append(options.rank)
            else:
                self.rank.append(0)
            self.candidates.append(options.candidate_count(n))
        self.basis_packed = torch.cat(bases) if bases else ref.new_zeros(1)
        self.preview_packed = torch.cat(previews) if previews else ref.new_zeros(1)
        for e, rows in enumerate(experts):
            w, n, r = self.rank[e], rows.size(0), rows.size(1)
            if w:
                b, p = basis_offsets[e], preview_offsets[e]
                self.basis.append(self.basis_packed[b : b + w * r].view(w, r))
                self.preview.append(self.preview_packed[p : p + n * w].view(n, w))
            else:
                self.basis.append(None)
                self.preview.append(None)
        self.basis_offsets = torch.tensor(basis_offsets, dtype=torch.int64)
        self.preview_offsets = torch.tensor(preview_offsets, dtype=torch.int64)

    @property
    def any(self) -> bool:
        return any(self.rank)


def preview_topk(
    rows: torch.Tensor,
    basis: torch.Tensor,
    preview: torch.Tensor,
    hidden: torch.Tensor,
    gate_value: torch.Tensor,
    k: int,
    candidates: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of one expert by SVD-softmax, for its queries ``hidden [c, r]`` (with the 1 of
    the bias appended when the rows carry one) and their gate values ``G [c]``.

    Returns ``(log-probabilities [c, k], row positions in the expert [c, k])``, best first.
    ``log Z`` sums ``exp(G z)`` over the exact logits of the candidates and the previews of
    the other classes (Shim et al. 2017).
    """
    n = rows.size(0)
    wanted = min(n, max(candidates, k))
    scores = (hidden @ basis.T) @ preview.T  # [c, n]: the preview z~ = (A V_W)(V_W^T h)
    picked = scores.topk(wanted, dim=1).indices  # [c, N]
    exact = torch.einsum("cnr,cr->cn", rows[picked], hidden)  # full view of the candidates
    gate = gate_value[:, None]
    log_norm = (scores.scatter(1, picked, exact) * gate).logsumexp(dim=1, keepdim=True)
    top, where = exact.topk(k, dim=1)
    return top * gate - log_norm, picked.gather(1, where)


def expert_cost(classes: int, row_size: int, options: SVDPreview | None, k: int) -> float:
    """Products of one expert's top-k in rows of ``row_size`` products (the unit of the DS
    paper's speed-up ``|V| / (sum_k |v_k| u_k + K)``): ``n`` exactly; with a preview, ``W``
    for the query's coordinates, ``n W / r`` for the preview and ``N`` for the full view."""
    if options is None or not options.applies_to(classes, row_size):
        return float(classes)
    candidates = min(classes, max(k, options.candidate_count(classes)))
    return options.rank + classes * options.rank / row_size + candidates
