import pytest
import torch

from heads import IGNORE_INDEX, HeadConfigError, MixtapeHead, mixtape
from heads.base import SingleSoftmaxHead
from heads.fused_cross_entropy import LossOptions
from heads.mixtape import sigmoid_tree_priors
from tests.heads.contract import (
    HIDDEN,
    PARTLY_KEPT,
    VOCAB,
    check_compiles_without_graph_breaks,
    check_loss_matches_reference,
    check_training_keeps_no_vocabulary_rows,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def make_head(**options) -> MixtapeHead:
    defaults = dict(num_components=4, frequent_ratio=0.3, gate_embedding_size=3, embedding_size=5)
    return MixtapeHead(HIDDEN, VOCAB, **{**defaults, **options})


def reference_log_prob(head: MixtapeHead, g: torch.Tensor) -> torch.Tensor:
    """Eq. 2-6 written plainly, token by token, with the sigmoid tree as explicit paths.

    Frequent tokens (x < S) get l_{c,x,k} = v_x . tanh(U_k g) + u_k . g + b_{x,k} (Eq. 4);
    the others get the shared l_{c,k} = u_k . g (Eq. 6). No mixing shortcut is used.
    """
    k_total, d2, s = head.num_components, head.gate_embedding_size, head.num_frequent
    d = head.embedding_size
    depth = k_total.bit_length() - 1
    U = head._gate_projection_weight()
    logits = torch.zeros(g.size(0), head.vocab_size, dtype=g.dtype)
    for n in range(g.size(0)):
        h = [
            torch.tanh(
                head.context.weight[k * d : (k + 1) * d] @ g[n]
                + head.context.bias[k * d : (k + 1) * d]
            )
            for k in range(k_total)
        ]  # Eq. 5
        for x in range(head.vocab_size):
            pre = []
            for j in range(k_total - 1):  # one pre-activation per internal tree node
                shared = head.gate_context.weight[j] @ g[n]
                if x < s:
                    rows = slice(j * d2, (j + 1) * d2)
                    gate = torch.tanh(U[rows] @ g[n] + head.gate_projection.bias[rows])
                    pre.append(head.gate_embedding[x] @ gate + shared + head.gate_bias[x, j])
                else:
                    pre.append(shared)
            logit = 0.0
            for leaf in range(k_total):  # Eq. 3: product along the root-to-leaf path
                prior, node = 1.0, 0
                for level in reversed(range(depth)):
                    go_right = (leaf >> level) & 1
                    gamma = torch.sigmoid(pre[node])
                    prior = prior * ((1 - gamma) if go_right else gamma)
                    node = 2 * node + 1 + go_right
                logit = logit + prior * (h[leaf] @ head.weight[x])
            logits[n, x] = logit + head.bias[x]
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("ratio", [1.0, 0.3], ids=["S=V", "shared"])
def test_equals_plain_reference(k, ratio):
    torch.manual_seed(k)
    head = make_head(num_components=k, frequent_ratio=ratio).double().eval()
    with torch.no_grad():  # non-zero biases so every term is checked
        head.gate_bias.normal_()
        head.bias.normal_()
    g = torch.randn(3, HIDDEN, dtype=torch.float64)
    torch.testing.assert_close(head.log_prob(g), reference_log_prob(head, g))


@pytest.mark.parametrize("k, d2", [(4, 64), (2, 5), (8, 1)])
def test_the_gate_products_rows_are_a_multiple_of_8_elements(k, d2):
    """Eq. 4's ``A B^T``: zero columns pad ``d2 + K`` to a multiple of 8 (16-byte rows in
    half precision, which tensor-core GEMMs need), in both factors; the gate logits are those
    of the unpadded factors."""
    head = MixtapeHead(16, 40, num_components=k, gate_embedding_size=d2, frequent_ratio=0.5)
    _, inputs, weights, *_ = head._pieces(torch.randn(5, 16), torch.randint(0, 40, (5,)))
    width = d2 + k
    assert inputs.size(-1) == weights.size(-1) == -(-width // 8) * 8
    assert not inputs[..., width:].any() and not weights[..., width:].any()
    torch.testing.assert_close(inputs @ weights.t(), inputs[..., :width] @ weights[:, :width].t())


def test_gate_sharing_shares_exactly_the_infrequent_tokens():
    head = make_head(frequent_ratio=0.3)
    assert head.num_frequent == 7  # ceil(0.3 * 23)
    assert head.gate_embedding.shape == (7, 3)
    assert make_head(frequent_ratio=1.0).num_frequent == VOCAB


@pytest.mark.parametrize("k", [2, 4, 8, 16])
def test_priors_sum_to_one_for_every_context_and_token(k):
    priors = sigmoid_tree_priors(torch.randn(5, 11, k - 1) * 4)
    assert priors.shape == (5, 11, k)
    assert (priors >= 0).all()
    torch.testing.assert_close(priors.sum(-1), torch.ones(5, 11))


def test_k4_tree_is_the_papers_eq3():
    logits = torch.randn(6, 3)
    g1, g2, g3 = torch.sigmoid(logits).unbind(-1)
    expected = torch.stack([g1 * g2, g1 * (1 - g2), (1 - g1) * g3, (1 - g1) * (1 - g3)], -1)
    torch.testing.assert_close(sigmoid_tree_priors(logits), expected)


def test_head_priors_sum_to_one_inside_the_head():
    """The priors the head actually mixes with, for frequent and shared tokens."""
    head = make_head().double()
    g = torch.randn(4, HIDDEN, dtype=torch.float64)
    with torch.no_grad():  # with all h_{c,k} . w_x equal to 1 the logit is sum_k pi = 1
        head.context.weight.zero_()
        head.context.bias.fill_(10.0)  # tanh -> 1
        head.weight.fill_(1.0 / head.embedding_size)
        head.bias.zero_()
    torch.testing.assert_close(head.logits(g), torch.ones(4, VOCAB, dtype=torch.float64))


def test_gate_noise_only_in_training():
    head = make_head(gate_noise=1.0)
    g = torch.randn(4, HIDDEN)
    head.eval()
    torch.testing.assert_close(head.logits(g), head.logits(g))
    head.train()
    assert not torch.allclose(head.logits(g), head.logits(g))


def test_weight_norm_rows_have_the_constant_scale():
    head = make_head(weight_norm_scale=3.0)
    norms = head._gate_projection_weight().norm(dim=1)
    torch.testing.assert_close(norms, torch.full_like(norms, 3.0))


@pytest.mark.parametrize("k", [0, 1, 3, 6, 12])
def test_k_must_be_a_power_of_two(k):
    with pytest.raises(HeadConfigError, match="power of two"):
        make_head(num_components=k)


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_ratio_must_be_in_unit_interval(ratio):
    with pytest.raises(HeadConfigError, match=r"frequent_ratio r must be in \(0, 1\]"):
        make_head(frequent_ratio=ratio)


# the loss over several blocks of each kind: frequent blocks of 2 columns, rare chunks of 5,
# recomputed in the backward; and the same with the first blocks kept
SMALL_BLOCKS = {
    "recomputed": LossOptions(plan="eager", columns=2, rows=3, saved_bytes=0),
    "partly_kept": LossOptions(plan="eager", columns=2, rows=3, saved_bytes=900),
    "row_tiles": LossOptions(plan="rows", rows=3),  # the rare block by the rows plan
}


def _nll_and_grads(loss_fn, head: MixtapeHead, g: torch.Tensor):
    g = g.detach().requires_grad_(True)
    nll = loss_fn(g)
    grads = torch.autograd.grad(nll.sum(), [g, *head.parameters()])
    return nll.detach(), grads


@pytest.mark.parametrize("blocks", SMALL_BLOCKS.values(), ids=SMALL_BLOCKS.keys())
@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("ratio", [1.0, 0.3], ids=["S=V", "shared"])
def test_fused_loss_equals_plain_reference(blocks, k, ratio):
    """``forward``: values and gradients of every input and parameter against the
    token-by-token reference above, ignored targets included, with blocks of the vocabulary
    recomputed in the backward (or partly kept)."""
    torch.manual_seed(k)
    head = make_head(num_components=k, frequent_ratio=ratio).double().eval()
    head.loss_options = blocks
    with torch.no_grad():
        head.gate_bias.normal_()
        head.bias.normal_()
    g = torch.randn(4, HIDDEN, dtype=torch.float64)
    target = torch.tensor([0, VOCAB - 1, IGNORE_INDEX, 5])

    def reference(h):
        nll = -reference_log_prob(head, h).gather(1, target.clamp_min(0)[:, None]).squeeze(1)
        return nll.masked_fill(target == IGNORE_INDEX, 0.0)

    nll, grads = _nll_and_grads(lambda h: head(h, target).nll, head, g)
    expected_nll, expected_grads = _nll_and_grads(reference, head, g)
    torch.testing.assert_close(nll, expected_nll)
    for name, grad, expected in zip(
        ["hidden", *dict(head.named_parameters())], grads, expected_grads, strict=True
    ):
        torch.testing.assert_close(grad, expected, msg=name)


@pytest.mark.parametrize("ratio", [1.0, 0.3], ids=["S=V", "shared"])
def test_loss_edges_log_prob_and_topk_equal_plain_reference(ratio, monkeypatch):
    """One row, every row ignored, label smoothing, kept and recomputed blocks; log_prob by
    blocks of rows (2 here)."""
    monkeypatch.setattr(mixtape, "_EVAL_ROWS", 2)
    torch.manual_seed(5)

    def make():
        head = make_head(frequent_ratio=ratio)
        with torch.no_grad():
            head.gate_bias.normal_()
            head.bias.normal_()
        return head

    check_loss_matches_reference(make, reference_log_prob,
                                 options=tuple(SMALL_BLOCKS.values()))  # fmt: skip


@pytest.mark.parametrize("ratio", [1.0, 0.3, 0.1], ids=["S=V", "shared", "few_frequent"])
def test_fused_loss_equals_logits_path_with_noise_and_dropout(ratio):
    """Same loss and gradients as ``logits`` + cross-entropy in training mode, with dropout
    (the same draws on both paths from the same seed) and weight normalisation."""
    options = dict(frequent_ratio=ratio, gate_dropout=0.3, context_dropout=0.2)
    head = make_head(weight_norm_scale=1.5, **options).double().train()
    head.loss_options = SMALL_BLOCKS["recomputed"]
    g = torch.randn(9, HIDDEN, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (9,))
    torch.manual_seed(3)
    nll, grads = _nll_and_grads(lambda h: head(h, target).nll, head, g)
    torch.manual_seed(3)
    expected_nll, expected_grads = _nll_and_grads(
        lambda h: SingleSoftmaxHead.forward(head, h, target).nll, head, g
    )
    torch.testing.assert_close(nll, expected_nll)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected)


def test_gate_noise_is_replayed_in_the_backward():
    """With gate noise, the column plan's blocks recomputed in the backward draw the
    forward's noise again: the gradients equal those of the same draws kept from the forward
    (same seed), and the random stream after the step is the one without the replay (it is
    restored)."""
    head = make_head(frequent_ratio=0.5, gate_noise=0.7).double().train()
    g = torch.randn(6, HIDDEN, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (6,))
    results = []
    for saved in (1 << 30, 0, 1500):  # all kept, all recomputed, the first block kept
        head.loss_options = LossOptions(plan="eager", columns=3, saved_bytes=saved)
        torch.manual_seed(4)
        nll, grads = _nll_and_grads(lambda h: head(h, target).nll, head, g)
        results.append((nll, grads, torch.rand(3)))
    for nll, grads, after in results[1:]:
        torch.testing.assert_close(nll, results[0][0])
        for grad, expected in zip(grads, results[0][1], strict=True):
            torch.testing.assert_close(grad, expected)
        torch.testing.assert_close(after, results[0][2], rtol=0, atol=0)
    # the noise is really there: another seed, another loss
    torch.manual_seed(5)
    assert not torch.allclose(head(g, target).nll, results[0][0])


def _fused_inputs(k: int, s: int, v: int, n: int = 5, d: int = 3, e: int = 4):
    gen = torch.Generator().manual_seed(k + s)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    target = torch.randint(0, v, (n,), generator=gen)
    target[1] = -1  # no target logit in this block
    return (rand(n, k - 1, e), rand(s, e), rand(n, k, d), rand(s, d), rand(s)), target


@pytest.mark.parametrize("blocks", SMALL_BLOCKS.values(), ids=SMALL_BLOCKS.keys())
@pytest.mark.parametrize("k,s,v", [(2, 3, 7), (4, 5, 5), (4, 2, 9), (8, 4, 6)])
def test_frequent_block_gradcheck(blocks, k, s, v):
    """The frequent tokens' function, every output (log-sum-exp, target logit, logit sum)
    against finite differences of every input (targets beyond S: another block's)."""
    tensors, target = _fused_inputs(k, s, v)

    def parts(*inputs):
        out = mixtape.mixtape_frequent_lse(*inputs, target, True, 0.0, blocks)
        return out.lse, out.target_logit, out.logit_sum

    assert torch.autograd.gradcheck(parts, tensors)


def test_fused_loss_survives_a_retained_graph():
    """The backward leaves its kept blocks intact: a second backward gives the same."""
    tensors, target = _fused_inputs(4, 3, 8)
    out = mixtape.mixtape_frequent_lse(*tensors, target, True, 0.0, SMALL_BLOCKS["partly_kept"])
    loss = (out.lse - out.target_logit - 0.1 * out.logit_sum).sum()
    first = torch.autograd.grad(loss, tensors, retain_graph=True)
    second = torch.autograd.grad(loss, tensors)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fused_loss_gate_noise_only_in_training():
    head = make_head(gate_noise=1.0)
    g, target = torch.randn(4, HIDDEN), torch.randint(0, VOCAB, (4,))
    head.eval()
    torch.testing.assert_close(head(g, target).nll, head(g, target).nll)
    head.train()
    assert not torch.allclose(head(g, target).nll, head(g, target).nll)


def test_training_keeps_no_vocabulary_rows():
    """Neither [N, V] nor [N, K, S]: the frequent blocks are recomputed in the backward."""
    check_training_keeps_no_vocabulary_rows(
        lambda: MixtapeHead(
            8, 3000, num_components=4, frequent_ratio=0.5, gate_embedding_size=4, embedding_size=4
        )  # fmt: skip
    )


@pytest.mark.parametrize("plan", ["partly_kept", "plain", "rows"])
def test_compiles_without_graph_breaks(plan):
    """With gate noise: the rows plan's eager tiles (a CPU's) once read the generator's state
    for the backward's replay, a graph break per call under torch.compile."""
    check_compiles_without_graph_breaks(
        lambda: make_head(
            gate_noise=0.1, gate_dropout=0.1, context_dropout=0.1, weight_norm_scale=1.0
        ),  # fmt: skip
        PARTLY_KEPT if plan == "partly_kept" else LossOptions(plan=plan, rows=4),
    )


def test_the_compiled_rows_plan_replays_its_kept_gate_noise():
    """Traced by torch.compile, the rows plan keeps its tiles' gate noise for the backward's
    second walk (the NLL output differentiated too) instead of the generator's state: the
    loss, the NLL and the gradients of ``loss + nll.sum() / 2`` equal those of the plain
    logits path (Eq. 2-4, ``SingleSoftmaxHead.forward``) drawing the same noise in float64.
    Every token frequent (S = V) and one tile: both paths draw one ``[N, K-1, V]`` block."""
    import torch._dynamo

    head = make_head(frequent_ratio=1.0, gate_noise=0.5).double().train()
    head.loss_options = LossOptions(plan="rows")
    g = torch.randn(7, HIDDEN, dtype=torch.float64)
    target = torch.tensor([0, VOCAB - 1, IGNORE_INDEX, 5, 3, 3, 11])

    def step(h):
        output = head(h, target)
        return output.loss, output.nll

    def reference(h):
        output = SingleSoftmaxHead.forward(head, h, target)
        return output.loss, output.nll

    results = []
    try:
        for run in (torch.compile(step, backend="aot_eager", fullgraph=True), reference):
            torch.manual_seed(3)
            h = g.clone().requires_grad_(True)
            loss, nll = run(h)
            grads = torch.autograd.grad(loss + nll.sum() / 2, [h, *head.parameters()])
            results.append((loss, nll, *grads))
    finally:
        torch._dynamo.reset()
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_bias_starts_at_the_centred_zipf_log_prior():
    head = MixtapeHead(8, 50)
    ranks = torch.arange(1, 51, dtype=torch.float64)
    expected = -ranks.log() + ranks.log().mean()
    torch.testing.assert_close(head.bias.double(), expected, rtol=0, atol=1e-6)
    assert torch.count_nonzero(MixtapeHead(8, 50, zipf_bias_init=False).bias) == 0


def _ptb_saturation(ptb_data, zipf_bias_init: bool, steps: int = 20, d: int = 64):
    """Issue 18's Mixtape failure, small: a tied 2-layer LSTM (the issue's dropouts) on PTB
    with Adam 5e-3 for ``steps`` updates; returns the mean |g_c| of the backbone's outputs and
    the share of context pre-activations ``|H_k g_c| > 3`` (saturated tanh, Eq. 5)."""
    from datamodules.bptt import BPTTBatches
    from lightning_modules.backbones import LSTMBackbone

    torch.manual_seed(1)
    vocab = ptb_data.vocab_size
    dropouts = {"input_dropout": 0.4, "hidden_dropout": 0.3, "output_dropout": 0.4}
    backbone = LSTMBackbone(vocab, d, d, 2, **dropouts)
    gates = {"gate_dropout": 0.1, "context_dropout": 0.2, "gate_noise": 0.05}
    head = MixtapeHead(d, vocab, gate_embedding_size=16, weight_norm_scale=1.0,
                       zipf_bias_init=zipf_bias_init, **gates)  # fmt: skip
    head.tie_output_embedding(backbone.embedding.weight)
    params = [*backbone.parameters(), *(p for p in head.parameters() if p is not head.weight)]
    optimizer = torch.optim.Adam(params, lr=5e-3)
    state = None
    for step, (x, y) in enumerate(BPTTBatches(ptb_data.split_tokens("train"), 20, 35)):
        if step == steps:
            break
        hidden, state = backbone(x, state)
        state = [(h.detach(), c.detach()) for h, c in state]
        loss = head(hidden.reshape(-1, d), y.reshape(-1)).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.25)
        optimizer.step()
    g = hidden.detach().reshape(-1, d)
    with torch.no_grad():
        return float(g.abs().mean()), float((head.context(g).abs() > 3).float().mean())


def test_zipf_bias_keeps_the_contexts_out_of_saturation(ptb_data, one_thread):
    """Regression (issue 18): with a zero bias the first updates fit the unigram through the
    bounded tanh contexts and saturate them and the LSTM (measured: |g| 0.88-0.95, 68-78% of
    |H g| > 3 over seeds 1-3; loss stuck near the unigram's); with the Zipf prior neither."""
    g_abs, saturated = _ptb_saturation(ptb_data, zipf_bias_init=True)
    assert g_abs < 0.3 and saturated < 0.05
    g_abs_zero, saturated_zero = _ptb_saturation(ptb_data, zipf_bias_init=False)
    assert g_abs_zero > 0.6 and saturated_zero > 0.3  # the failure this test guards against


def test_the_compiled_plan_runs_the_shared_pieces_as_one_compiled_graph():
    """CUDA's plan runs ``mixtape_pieces`` (contexts, gates, the rare tokens' mixed context:
    ~40 small operations, as many launches) as one compiled function: with Inductor, the loss
    and every gradient equal the eager pieces' in float64 (weight norm, shared gates, ignored
    targets); one graph, reused at another row count, and no graph break."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    head = make_head(weight_norm_scale=1.5, frequent_ratio=0.4).double().train()
    results = {}
    for plan in ("compiled", "eager"):
        # blocks of 10 columns (the frequent 10) and 11 + 2 (the rare 13): no block width that
        # Dynamo would take for another dimension of the same size (and recompile for)
        head.loss_options = LossOptions(plan=plan, columns=11)
        results[plan] = []
        for n in (9, 13):
            torch.manual_seed(n)
            hidden = torch.randn(n, HIDDEN, dtype=torch.float64, requires_grad=True)
            target = torch.randint(0, VOCAB, (n,))
            target[2] = IGNORE_INDEX
            out = head(hidden, target)
            loss = out.loss + 0.3 * (out.nll * torch.arange(n, dtype=torch.float64)).sum()
            results[plan] += [loss, *torch.autograd.grad(loss, [hidden, *head.parameters()])]
    for got, want in zip(results["compiled"], results["eager"], strict=True):
        torch.testing.assert_close(got, want)
    # the pieces, the frequent block's 2 bodies and the rare block's 2 chunk bodies
    assert counters["stats"]["unique_graphs"] == 5, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def test_the_pieces_are_compiled_only_where_the_plan_is():
    """The CPU's eager plan and the evaluation path (``logits``) call the pieces as they are."""
    calls = []
    head = make_head()

    def spy(function):
        calls.append(function.__name__)
        return function

    original = mixtape.compiled_body
    mixtape.compiled_body = spy
    try:
        target = torch.randint(0, VOCAB, (4,))
        head(torch.randn(4, HIDDEN), target)  # CPU, auto: eager
        head.logits(torch.randn(4, HIDDEN))
        assert calls == []
        head.loss_options = LossOptions(plan="compiled", columns=4)
        head(torch.randn(4, HIDDEN), target)
        assert calls == ["mixtape_pieces"]
    finally:
        mixtape.compiled_body = original
    torch._dynamo.reset()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("compiled", [False, True])
def test_the_plain_step_equals_the_plans_in_float64(smoothing, compiled, monkeypatch):
    """A launch-bound step as plain maths (Eq. 2-6 over the exact logits, one compiled
    function on CUDA; here Inductor on the CPU where asked): loss, per-token NLL and every
    gradient equal the block plan's (weight norm, shared gates, an ignored target)."""
    head = make_head(weight_norm_scale=1.5, frequent_ratio=0.4).double().train()
    if compiled:
        monkeypatch.setattr(mixtape, "resolve_plan", lambda plan, hidden: "compiled")
    results = []
    for plan in ("plain", "eager"):
        head.loss_options = LossOptions(plan=plan, columns=4)
        torch.manual_seed(3)
        hidden = torch.randn(11, HIDDEN, dtype=torch.float64, requires_grad=True)
        target = torch.randint(0, VOCAB, (11,))
        target[5] = IGNORE_INDEX
        out = head(hidden, target, label_smoothing=smoothing)
        loss = out.loss + 0.3 * (out.nll * torch.arange(11, dtype=torch.float64)).sum()
        results.append([loss, out.nll, *torch.autograd.grad(loss, [hidden, *head.parameters()])])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)
    torch._dynamo.reset()


def test_a_step_runs_plainly_where_cuda_would_be_launch_bound():
    """On CUDA under auto (or the measured rows plan) a step whose logits and gates fit
    saved_bytes runs plainly; a large one, another backend, or a CPU run the plans."""
    from heads.mixtape import plain_step_fits

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto, rows = LossOptions(), LossOptions(plan="rows")
    # the PTB LM step: 700 tokens, V = 10k, K = 4, S = 1,000 -> 62 MB of float32
    assert plain_step_fits(auto, cuda, 700, 10_000, 4, 1_000)
    assert plain_step_fits(rows, cuda, 700, 10_000, 4, 1_000)
    assert not plain_step_fits(auto, cuda, 16_384, 10_000, 4, 1_000)  # 1.2 GB
    assert not plain_step_fits(auto, cpu, 700, 10_000, 4, 1_000)
    assert not plain_step_fits(LossOptions(plan="compiled"), cuda, 700, 10_000, 4, 1_000)
    assert not plain_step_fits(LossOptions(backend="liger"), cuda, 700, 10_000, 4, 1_000)
    assert plain_step_fits(LossOptions(plan="plain"), cpu, 16_384, 10_000, 4, 1_000)


@pytest.mark.parametrize("option", ["gate_dropout", "context_dropout"])
def test_a_dropout_outside_0_1_is_refused(option):
    with pytest.raises(HeadConfigError, match=rf"{option} must be in \[0, 1\)"):
        MixtapeHead(8, 20, **{option: 1.0})
