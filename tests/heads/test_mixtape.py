import pytest
import torch

from heads import HeadConfigError, MixtapeHead
from heads.mixtape import sigmoid_tree_priors
from tests.heads.contract import ALL_CHECKS, HIDDEN, VOCAB


def make_head(**options) -> MixtapeHead:
    defaults = dict(num_components=4, frequent_ratio=0.3, gate_embedding_size=3, embedding_size=5)
    return MixtapeHead(HIDDEN, VOCAB, **{**defaults, **options})


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "options",
    [{}, {"frequent_ratio": 1.0}, {"num_components": 8, "weight_norm_scale": 2.0}],
    ids=["shared_gates", "no_sharing", "k8_weight_norm"],
)
def test_contract(check, options):
    torch.manual_seed(0)
    check(lambda: make_head(**options))


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
