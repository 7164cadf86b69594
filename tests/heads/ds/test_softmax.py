import copy
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from heads import HeadConfigError
from heads.ds.softmax import DSSoftmaxHead
from heads.softmax import SoftmaxHead
from tests.heads.contract import (
    HIDDEN,
    ROWS,
    VOCAB,
    _inputs,
    check_compiles_without_graph_breaks,
    check_inductor_compiles_every_batch_size,
    check_loss_matches_reference,
    check_training_keeps_no_vocabulary_rows,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def make_head(**options) -> DSSoftmaxHead:
    return DSSoftmaxHead(HIDDEN, VOCAB, **options)


def pruned_head(dtype=torch.float64, keep_every_class=True) -> DSSoftmaxHead:
    """A 4-expert head whose experts hold different subsets of classes (some rows shrunk)."""
    torch.manual_seed(0)
    head = make_head(num_experts=4).to(dtype)
    # expert k keeps the classes c with (c + k) % 3 == 0: every class stays somewhere
    expert_of_row = torch.arange(4).repeat_interleave(VOCAB)
    shrink = (head.row_class + expert_of_row) % 3 != 0
    with torch.no_grad():
        head.weight[shrink] *= 1e-4
    assert head.prune(gamma=1e-2, keep_every_class=keep_every_class) is not None
    assert min(head.expert_sizes()) >= 4  # so top-4 stays inside every expert
    return head.eval()


def reference_logits(head: DSSoftmaxHead, hidden: torch.Tensor, pruned_logit: float):
    """Eq. 1-2 token by token, with every expert evaluated densely over all V classes."""
    membership = head.membership()
    out = torch.empty(hidden.size(0), head.vocab_size, dtype=hidden.dtype)
    offsets = head.expert_offsets.tolist()
    for n in range(hidden.size(0)):
        gates = torch.softmax(head.gate @ hidden[n], dim=0)  # Eq. 1
        k = int(gates.argmax())
        dense = torch.zeros(head.vocab_size, head.hidden_size, dtype=hidden.dtype)
        dense[head.row_class[offsets[k] : offsets[k + 1]]] = head.weight[
            offsets[k] : offsets[k + 1]
        ]
        logits = gates[k] * (dense @ hidden[n])  # Eq. 2
        out[n] = torch.where(membership[k], logits, torch.full_like(logits, pruned_logit))
    return out


def test_sparse_and_dense_paths_match_reference():
    head = pruned_head()
    hidden, target = _inputs()
    with torch.no_grad():
        sparse = reference_logits(head, hidden, -math.inf).log_softmax(-1)
        zeroed = reference_logits(head, hidden, 0.0).log_softmax(-1)
        torch.testing.assert_close(head.log_prob(hidden), sparse)
        torch.testing.assert_close(head.training_log_prob(hidden), zeroed)
        output = head(hidden, target)
        torch.testing.assert_close(output.nll, -zeroed.gather(1, target[:, None]).squeeze(1))
    # some targets really fall outside their expert: the loss stays finite there
    assert torch.isinf(sparse.gather(1, target[:, None])).any()
    assert torch.isfinite(output.loss)


def test_pruned_loss_edges_equal_the_dense_reference():
    """The fused training loss of a pruned head (zero logits for pruned rows, chunked experts,
    one row, every row ignored, label smoothing) against Eq. 1-2 written densely."""

    def reference(head, hidden):
        return reference_logits(head, hidden, 0.0).log_softmax(-1)

    check_loss_matches_reference(lambda: pruned_head().train(), reference, inference=False)


def test_training_keeps_no_vocabulary_rows():
    check_training_keeps_no_vocabulary_rows(
        lambda: DSSoftmaxHead(4, 3000, num_experts=2, lambda_lasso=0.01)
    )


@pytest.mark.slow  # about 40 s of Inductor code generation
def test_inductor_compiles_every_batch_size():
    """The experts' captured group sizes under a symbolic batch size (validation's, then
    training's), through Inductor's code generation: the eager losses and gradients."""
    check_inductor_compiles_every_batch_size(
        lambda: make_head(num_experts=3, bias=True, lambda_lasso=0.01, lambda_expert=0.01)
    )


def test_compiles_without_graph_breaks():
    """Expert group sizes are data-dependent: captured as such, not a graph break."""
    check_compiles_without_graph_breaks(
        lambda: make_head(num_experts=3, bias=True, lambda_lasso=0.01)
    )


def test_pruned_head_contract_equivalents():
    """The contract's checks restated for a pruned head, whose sparse ``log_prob`` has -inf
    outside the selected expert: gradcheck's finite differences of -inf are NaN, and the
    training nll follows the zero-row distribution of Algorithm 1 (``training_log_prob``)
    rather than the sparse one, so those two checks are written against the right
    distribution here. Normalisation and top-k are checked as in the contract."""
    head = pruned_head()
    hidden, target = _inputs()
    log_probs = head.log_prob(hidden)
    torch.testing.assert_close(log_probs.logsumexp(-1), torch.zeros(ROWS, dtype=torch.float64))
    values, indices = head.topk(hidden, 4)
    torch.testing.assert_close(values, log_probs.topk(4).values)
    torch.testing.assert_close(log_probs.gather(1, indices), values)
    # batch-1 fast path agrees with the batched one
    for n in range(ROWS):
        v1, i1 = head.topk(hidden[n : n + 1], 4)
        torch.testing.assert_close(v1, values[n : n + 1])
        torch.testing.assert_close(i1, indices[n : n + 1])
    output = head(hidden, target)
    dense = head.training_log_prob(hidden)
    torch.testing.assert_close(dense.logsumexp(-1), torch.zeros(ROWS, dtype=torch.float64))
    torch.testing.assert_close(output.loss, -dense.gather(1, target[:, None]).mean())
    hidden.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h: head(h, target).loss, (hidden,))
    # alive columns of the sparse log_prob are differentiable as usual
    alive = head.membership().all(0).nonzero().squeeze(1)[:3]
    assert torch.autograd.gradcheck(lambda h: head.log_prob(h)[:, alive], (hidden,))


def test_topk_beyond_expert_size_returns_zero_probabilities():
    head = pruned_head()
    hidden, _ = _inputs()
    k = max(head.expert_sizes()) + 2
    values, indices = head.topk(hidden, k)
    log_probs = head.log_prob(hidden)
    torch.testing.assert_close(log_probs.gather(1, indices), values)
    assert torch.isinf(values[:, -2:]).all()
    assert all(len(set(row)) == k for row in indices.tolist())  # no repeated class


@pytest.mark.parametrize("bias", [False, True])
def test_topk_paths_agree_with_the_dense_reference(bias):
    """Batch 1 (cached views, addmv), batched through the padded ``baddbmm`` and batched
    through the per-expert loop all return the dense sparse distribution's top-k, also
    after an in-place update of the parameters (what an optimizer step does)."""
    head = pruned_head()
    if bias:
        head = DSSoftmaxHead(HIDDEN, VOCAB, num_experts=1, bias=True).double()
        torch.manual_seed(1)
        rows = torch.cat([torch.randperm(VOCAB)[:size].sort().values for size in (5, 9, 14)])
        head.set_structure(
            torch.randn(rows.numel(), HIDDEN + 1), rows, [5, 9, 14], torch.randn(3, HIDDEN)
        )
    hidden = torch.randn(40, HIDDEN, dtype=torch.float64)
    for _ in range(2):
        reference = head.log_prob(hidden).topk(4)
        padded = head.topk(hidden, 4)
        assert head._inference_cache().padded is not None  # the padded path was taken
        head._inference_cache().can_pad = False
        looped = head.topk(hidden, 4)
        head._inference_cache().can_pad = True
        single = [head.topk(hidden[n : n + 1], 4) for n in range(hidden.size(0))]
        for values, indices in (padded, looped, tuple(map(torch.cat, zip(*single, strict=True)))):
            torch.testing.assert_close(values, reference.values)
            torch.testing.assert_close(indices, reference.indices)
        with torch.no_grad():  # an optimizer-like in-place step: caches must follow
            head.weight.add_(torch.randn_like(head.weight))
            head.gate.mul_(-1.5)


def test_gate_gradient_flows_through_normalisation():
    head = make_head(num_experts=3).double()
    hidden, target = _inputs()
    head(hidden, target).loss.backward()
    # every gate row gets a gradient, not only the selected ones (Eq. 1)
    assert (head.gate.grad.abs().sum(1) > 0).all()


def test_training_costs_about_one_softmax_per_token():
    torch.manual_seed(0)
    vocab, hidden_size, rows, experts = 500, 16, 64, 8
    head = DSSoftmaxHead(hidden_size, vocab, num_experts=experts)
    softmax = SoftmaxHead(hidden_size, vocab)
    # as in training, where the backbone needs dL/dh (the fused loss then gives the gate's
    # gradient through that of G h: no extra product)
    hidden = torch.randn(rows, hidden_size, requires_grad=True)
    target = torch.randint(0, vocab, (rows,))

    def flops(module) -> int:
        with FlopCounterMode(display=False) as counter:
            module(hidden, target).loss.backward()
        return counter.get_total_flops()

    assert flops(head) < 1.2 * flops(softmax)  # not K = 8 softmaxes


def test_aux_loss_matches_reference():
    torch.manual_seed(0)
    head = make_head(num_experts=3, lambda_lasso=0.1, lambda_expert=0.2, lambda_load=10.0)
    head = head.double()
    hidden, target = _inputs()
    output = head(hidden, target)
    w = head.weight.view(3, VOCAB, HIDDEN)
    lasso = sum(w[k, c].norm() for k in range(3) for c in range(VOCAB))
    expert = sum(w[k].pow(2).sum().sqrt() for k in range(3))
    gates = torch.softmax(hidden @ head.gate.T, -1)
    sparse = torch.where(gates == gates.max(1, keepdim=True).values, gates, 0.0)
    importance = sparse.sum(0)
    cv = importance.std(unbiased=False) / importance.mean()
    expected = 0.1 * lasso + 0.2 * expert + 10.0 * cv**2
    torch.testing.assert_close(output.aux_loss, expected)


def test_an_expert_of_zero_rows_has_finite_regulariser_gradients():
    """An expert whose rows are all zero (new rows, ``set_expert_classes``): its group lasso
    is at the kink of sqrt, where the gradient is taken as 0, not NaN (0 * inf)."""
    torch.manual_seed(0)
    head = make_head(num_experts=3, lambda_lasso=0.1, lambda_expert=0.2).double()
    with torch.no_grad():
        head.weight.view(3, VOCAB, HIDDEN)[1] = 0.0
    hidden, target = _inputs()
    (grad,) = torch.autograd.grad(head(hidden, target).aux_loss, head.weight)
    w = head.weight.detach().view(3, VOCAB, HIDDEN)
    expected = torch.zeros_like(w)
    for k in (0, 2):  # d/dW of 0.1 sum_c ||w_kc|| + 0.2 ||W_k||_F
        expected[k] = 0.1 * w[k] / w[k].norm(dim=1, keepdim=True) + 0.2 * w[k] / w[k].norm()
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.view(3, VOCAB, HIDDEN), expected)


def test_prune_keeps_every_class_by_default():
    torch.manual_seed(0)
    head = make_head(num_experts=3).double()
    with torch.no_grad():
        head.weight[: 2 * VOCAB] *= 1e-4  # experts 0 and 1 below gamma everywhere
        head.weight[2 * VOCAB : 2 * VOCAB + 5] *= 1e-4  # and 5 classes of expert 2
    # the 5 classes' largest rows, over the 3 experts, decide where each is rescued
    norms = head.weight.detach().norm(dim=1).view(3, VOCAB)
    rescued_in = norms[:, :5].argmax(0)
    rows, gate_rows = head.prune(gamma=1e-2)
    assert head.classes_without_expert().numel() == 0
    # the 5 classes were rescued in their largest-norm expert; empty experts are removed
    assert sum(head.expert_sizes()) == VOCAB
    kept = sorted({2, *rescued_in.tolist()})
    assert gate_rows.tolist() == kept
    expected_sizes = [int((rescued_in == k).sum()) for k in kept[:-1]] + [
        VOCAB - 5 + int((rescued_in == 2).sum())
    ]
    assert head.expert_sizes() == expected_sizes
    assert head.num_experts == len(head.expert_sizes())


def test_prune_rescues_each_class_in_its_largest_row_on_every_run():
    """The row a class keeps is its largest-norm one, the same on every run and rank: at 50k
    classes over 16 experts on two threads, an indexed write with repeated indices kept
    another row for nearly every class in 3 of 4 runs."""
    experts, vocab = 16, 50_000
    torch.manual_seed(0)
    head = DSSoftmaxHead(4, vocab, num_experts=experts)
    with torch.no_grad():
        head.weight.mul_(1e-4)  # every row below gamma: every class rescued
    largest_in = head.weight.detach().norm(dim=1).view(experts, vocab).argmax(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(3):
            rows, _ = copy.deepcopy(head).prune(gamma=1.0)
            assert rows.numel() == vocab
            torch.testing.assert_close(rows // vocab, largest_in[rows % vocab], rtol=0, atol=0)
    finally:
        torch.set_num_threads(threads)


def test_prune_waits_when_the_survivors_exceed_max_rows_after():
    head = make_head(num_experts=2)
    with torch.no_grad():
        head.weight[: VOCAB // 2] *= 1e-4  # half of expert 0's rows fall below gamma
    rows = head.weight.size(0)
    assert head.prune(gamma=1e-2, max_rows_after=rows - VOCAB // 2 - 1) is None
    assert head.weight.size(0) == rows  # nothing changed
    assert head.prune(gamma=1e-2, max_rows_after=rows - VOCAB // 2) is not None
    assert head.weight.size(0) == rows - VOCAB // 2


def test_prune_star_variant_may_drop_classes():
    torch.manual_seed(0)
    head = make_head(num_experts=2).double()
    with torch.no_grad():
        head.weight[:5] *= 1e-4
        head.weight[VOCAB : VOCAB + 5] *= 1e-4
    head.prune(gamma=1e-2, keep_every_class=False)
    assert head.classes_without_expert().tolist() == [0, 1, 2, 3, 4]
    assert head.expert_sizes() == [VOCAB - 5, VOCAB - 5]
    assert head.prune(gamma=1e-2, keep_every_class=False) is None  # nothing left to prune


def test_set_expert_classes_adds_zero_rows_that_leave_the_training_loss_unchanged():
    head = pruned_head()
    hidden, target = _inputs()
    before, dense = head(hidden, target).loss, head.training_log_prob(hidden)
    had = head.membership()
    weight = head.weight.detach().clone()
    wanted = had.clone()
    wanted[0, :] = True  # expert 0 gets every class back
    rows, gate_rows = head.set_expert_classes(*wanted.nonzero(as_tuple=True))
    assert torch.equal(head.membership(), wanted) and gate_rows.tolist() == [0, 1, 2, 3]
    new = rows < 0
    assert int(new.sum()) == int((wanted & ~had).sum())
    assert torch.equal(head.weight[~new], weight[rows[~new]])  # old rows keep their weights
    assert not head.weight[new].any()  # new rows start at zero
    # a zero row is the logit 0 a pruned class already had in the training loss (Alg. 1)
    torch.testing.assert_close(head(hidden, target).loss, before)
    torch.testing.assert_close(head.training_log_prob(hidden), dense)


def test_set_expert_classes_drops_rows_and_empty_experts():
    head = pruned_head()
    old_classes = [head.expert_classes(k).clone() for k in range(4)]
    old_rows = list(head.weight.detach().clone().split(head.expert_sizes()))
    gate = head.gate.detach().clone()
    # experts 1 and 3 keep their first three classes, given in reverse order and twice
    expert = torch.tensor([3, 3, 3, 1, 1, 1, 1])
    classes = torch.cat((old_classes[3][:3].flip(0), old_classes[1][:3], old_classes[1][:1]))
    rows, gate_rows = head.set_expert_classes(expert, classes)
    assert gate_rows.tolist() == [1, 3] and head.expert_sizes() == [3, 3]
    assert (rows >= 0).all()
    torch.testing.assert_close(head.gate, gate[[1, 3]])
    for new_k, old_k in enumerate((1, 3)):
        assert torch.equal(head.expert_classes(new_k), old_classes[old_k][:3])
        torch.testing.assert_close(head.weight[3 * new_k : 3 * new_k + 3], old_rows[old_k][:3])


@pytest.mark.parametrize(
    "expert, classes, message",
    [
        ([0, 1], [0], "one size"),
        ([], [], "non-empty"),
        ([4], [0], "expert ids"),
        ([0], [VOCAB], "class ids"),
    ],
)
def test_set_expert_classes_rejects_bad_pairs(expert, classes, message):
    head = pruned_head()
    with pytest.raises(HeadConfigError, match=message):
        head.set_expert_classes(
            torch.tensor(expert, dtype=torch.long), torch.tensor(classes, dtype=torch.long)
        )


def test_split_doubles_experts_and_keeps_the_loss_continuous():
    head = pruned_head()
    hidden, target = _inputs()
    before = head(hidden, target).loss
    sizes = head.expert_sizes()
    classes = [head.expert_classes(k).clone() for k in range(head.num_experts)]
    head.split_experts(noise_std=0.0)
    assert head.num_experts == 8
    assert head.expert_sizes() == sizes + sizes
    for k in range(4):  # twins hold the parent's surviving classes
        assert torch.equal(head.expert_classes(k + 4), classes[k])
    torch.testing.assert_close(head(hidden, target).loss, before)
    head.split_experts(noise_std=1e-3, generator=torch.Generator().manual_seed(0))
    assert head.num_experts == 16
    torch.testing.assert_close(head(hidden, target).loss, before, atol=1e-2, rtol=0)
    head.split_experts(noise_std=0.0, max_experts=20)
    assert head.num_experts == 20


def test_split_without_rescaling_keeps_rows_and_topk():
    head = pruned_head()
    hidden, _ = _inputs()
    weight, top = head.weight.detach().clone(), head.topk(hidden, 3)
    head.split_experts(noise_std=0.0, rescale_rows=False)
    torch.testing.assert_close(head.weight[: weight.size(0)], weight)
    torch.testing.assert_close(head.weight[weight.size(0) :], weight)
    # G is halved, so the probabilities flatten, but the retrieved classes do not change
    assert torch.equal(head.topk(hidden, 3)[1], top[1])
    assert (head.topk(hidden, 3)[0][:, 0] < top[0][:, 0]).all()


def test_state_dict_round_trip_resizes_a_fresh_head():
    head = pruned_head()
    head.split_experts(noise_std=1e-2, generator=torch.Generator().manual_seed(0))
    fresh = make_head(num_experts=2).double().eval()
    fresh.load_state_dict(head.state_dict())
    assert fresh.num_experts == head.num_experts
    assert fresh.expert_sizes() == head.expert_sizes()
    assert torch.equal(fresh.row_class, head.row_class)
    hidden, target = _inputs()
    torch.testing.assert_close(fresh.log_prob(hidden), head.log_prob(hidden))
    torch.testing.assert_close(fresh.topk(hidden, 3), head.topk(hidden, 3))


def test_bias_is_part_of_the_row():
    """With ``bias`` the packed row is ``[W_c, b_c]``: logits ``G (W h + b)``, one lasso group."""
    torch.manual_seed(0)
    head = make_head(num_experts=2, bias=True, lambda_lasso=1.0, lambda_load=0.0).double()
    with torch.no_grad():
        head.weight[:, -1].normal_()
    hidden, target = _inputs()
    gates = torch.softmax(hidden @ head.gate.T, -1)
    k = gates.argmax(1)
    rows = head.weight.view(2, VOCAB, HIDDEN + 1)[k]  # [N, V, d + 1]
    logits = gates.max(1).values[:, None] * (
        torch.einsum("nvd,nd->nv", rows[..., :-1], hidden) + rows[..., -1]
    )
    torch.testing.assert_close(head.log_prob(hidden), logits.log_softmax(-1))
    torch.testing.assert_close(head.topk(hidden[:1], 3)[0], logits[:1].log_softmax(-1).topk(3)[0])
    expected_lasso = head.weight.norm(dim=1).sum()
    torch.testing.assert_close(head(hidden, target).aux_loss, expected_lasso)


def test_init_from_softmax_starts_at_the_softmax_logits():
    torch.manual_seed(0)
    softmax = SoftmaxHead(HIDDEN, VOCAB, bias=False).double()
    head = make_head(num_experts=4).double()
    head.init_from_softmax(softmax.weight.detach())
    hidden, _ = _inputs()
    torch.testing.assert_close(head.log_prob(hidden), softmax.log_prob(hidden), atol=1e-2, rtol=0)
    with pytest.raises(HeadConfigError, match="cannot initialise"):
        head.init_from_softmax(torch.zeros(VOCAB + 1, HIDDEN))
    # with a bias the softmax is matched exactly, bias included
    softmax = SoftmaxHead(HIDDEN, VOCAB).double()
    with torch.no_grad():
        softmax.bias.normal_()
    head = make_head(num_experts=4, bias=True).double()
    head.init_from_softmax(softmax.weight.detach(), softmax.bias.detach())
    torch.testing.assert_close(head.log_prob(hidden), softmax.log_prob(hidden), atol=1e-2, rtol=0)


def test_flops_speedup_formula():
    head = pruned_head()
    sizes = head.expert_sizes()
    u = [0.1, 0.2, 0.3, 0.4]
    expected = VOCAB / (sum(s * x for s, x in zip(sizes, u, strict=True)) + 4)
    assert head.flops_speedup(u) == pytest.approx(expected)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_experts": 0}, "num_experts"),
        ({"lambda_load": -1.0}, "lambda_load"),
        ({"init_std": 0.0}, "init_std"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(HeadConfigError, match=message):
        make_head(**options)


def test_bf16_autocast_on_a_pruned_head():
    head = pruned_head(dtype=torch.float32).train()
    hidden, target = _inputs(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = head(hidden * 10, target)
        values, _ = head.topk(hidden, 3)
    assert output.loss.dtype == torch.float32 and torch.isfinite(output.loss)
    assert values.dtype == torch.float32


def test_language_model_starts_ds_from_a_softmax_checkpoint(tmp_path):
    """Appendix B's recipe through ``LanguageModel(pretrained_checkpoint=...,
    freeze_backbone=True)``: same backbone, DS distribution starting at the softmax's."""
    from lightning_modules import LanguageModel
    from lightning_modules.backbones import LSTMBackbone
    from lightning_modules.errors import CheckpointPathError

    torch.manual_seed(0)
    backbone = LSTMBackbone(VOCAB, embedding_size=HIDDEN, hidden_size=HIDDEN, input_dropout=0.0,
                            hidden_dropout=0.0, output_dropout=0.0)  # fmt: skip
    softmax = SoftmaxHead(HIDDEN, VOCAB)
    with torch.no_grad():
        softmax.bias.normal_()
    path = tmp_path / "softmax.ckpt"
    torch.save({"state_dict": LanguageModel(backbone, softmax).state_dict()}, path)
    fresh = LSTMBackbone(VOCAB, embedding_size=HIDDEN, hidden_size=HIDDEN, input_dropout=0.0,
                         hidden_dropout=0.0, output_dropout=0.0)  # fmt: skip
    model = LanguageModel(
        fresh,
        make_head(num_experts=4, bias=True),
        pretrained_checkpoint=str(path),
        freeze_backbone=True,
    )
    assert not any(p.requires_grad for p in model.backbone.parameters())
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        hidden = model.backbone(ids)[0].reshape(-1, HIDDEN)
        torch.testing.assert_close(hidden, backbone(ids)[0].reshape(-1, HIDDEN))
        torch.testing.assert_close(
            model.head.log_prob(hidden), softmax.log_prob(hidden), atol=1e-2, rtol=0
        )
    with pytest.raises(CheckpointPathError, match="pretrained_checkpoint"):
        LanguageModel(fresh, make_head(), pretrained_checkpoint=str(tmp_path / "missing.ckpt"))


def test_copies_and_pickles_rebuild_the_inference_cache():
    """The cache holds raw pointers into the parameters (the C kernel's plan): a deep copy or
    a pickled head must not share it, and answers the same."""
    import copy
    import io

    head = pruned_head(dtype=torch.float32)
    hidden, _ = _inputs(dtype=torch.float32)
    expected = head.topk(hidden, 4)
    copied = copy.deepcopy(head)
    assert copied._cache is None and head._cache is not None
    buffer = io.BytesIO()
    torch.save(head, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        head.weight.zero_()  # the copies own their parameters
    for other in (copied, loaded):
        values, indices = other.topk(hidden, 4)
        torch.testing.assert_close(values, expected[0])
        assert torch.equal(indices, expected[1])


def test_load_pretrained_takes_a_ds_state_of_any_structure():
    """A pruned, split DS head's state starts a fresh DS head (fine-tuning a DS model with its
    backbone): the fresh head resizes to it."""
    trained = pruned_head()
    trained.split_experts(noise_std=0.01, generator=torch.Generator().manual_seed(0))
    fresh = make_head(num_experts=2).double()
    assert fresh.load_pretrained(trained.state_dict())
    assert fresh.expert_sizes() == trained.expert_sizes()
    hidden, _ = _inputs()
    torch.testing.assert_close(fresh.log_prob(hidden), trained.log_prob(hidden))
    assert not fresh.load_pretrained({"weight": torch.zeros(3, 3)})  # neither DS nor softmax


@pytest.mark.parametrize("other", ["MixtapeHead", "MoSHead"])
def test_load_pretrained_takes_a_softmax_not_another_head_with_a_weight_of_that_shape(other):
    """Mixtape's and MoS's states hold a ``weight [V, d]`` (and ``bias [V]``) beside their
    gates: every expert started from Mixtape's W and b, where README says a head that is not
    a softmax starts untrained (the run says so when load_pretrained refuses)."""
    import heads

    torch.manual_seed(0)
    state = getattr(heads, other)(HIDDEN, VOCAB, num_components=2).state_dict()
    assert state["weight"].shape == (VOCAB, HIDDEN)
    fresh = make_head(num_experts=2)
    before = copy.deepcopy(fresh.state_dict())
    assert not fresh.load_pretrained(state)
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, before[name]), name
    softmax = SoftmaxHead(HIDDEN, VOCAB).state_dict()
    assert fresh.load_pretrained(softmax)  # the recipe's softmax (bias or none) still starts it
    assert make_head(num_experts=2).load_pretrained({"weight": softmax["weight"]})


def test_row_experts_are_kept_per_structure_not_rebuilt_per_step():
    """The ``[R]`` expert of every row (the expert lasso's groups) is computed when the
    structure changes and follows pruning, mitosis, loading and moves; never per step (a
    list copied to the device would be a blocking copy in every step on a GPU)."""
    torch.manual_seed(0)
    head = DSSoftmaxHead(8, 30, num_experts=3, lambda_expert=1e-2)

    def expected(h: DSSoftmaxHead) -> torch.Tensor:
        return torch.repeat_interleave(torch.arange(h.num_experts), torch.tensor(h.expert_sizes()))

    assert torch.equal(head.row_expert(), expected(head))
    assert head.row_expert() is head.row_expert()  # kept, not rebuilt
    norms = torch.linalg.vector_norm(head.weight.detach(), dim=1)
    assert head.prune(float(norms.median())) is not None
    head.split_experts(noise_std=0.01)
    assert torch.equal(head.row_expert(), expected(head))
    fresh = DSSoftmaxHead(8, 30, num_experts=3, lambda_expert=1e-2)
    fresh.load_state_dict(head.state_dict())
    assert torch.equal(fresh.row_expert(), expected(head))
    assert "_row_expert" not in fresh.state_dict()  # derived: not saved
    assert fresh.double().row_expert().dtype == torch.long
