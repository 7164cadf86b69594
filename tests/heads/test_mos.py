import pytest
import torch

from heads import MoSHead
from tests.heads.contract import ALL_CHECKS, HIDDEN, VOCAB


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
def test_contract(check):
    torch.manual_seed(0)
    check(lambda: MoSHead(HIDDEN, VOCAB, num_components=3, embedding_size=5))


def test_equals_plain_mixture_of_softmaxes():
    """P(x|c) = sum_k pi_k softmax(W tanh(H_k g) + b)_x, written in probability space."""
    torch.manual_seed(1)
    k, d = 4, 5
    head = MoSHead(HIDDEN, VOCAB, num_components=k, embedding_size=d).double().eval()
    g = torch.randn(7, HIDDEN, dtype=torch.float64)
    prior = torch.softmax(g @ head.prior.weight.T, dim=-1)  # [N, K]
    expected = torch.zeros(7, VOCAB, dtype=torch.float64)
    for comp in range(k):
        rows = slice(comp * d, (comp + 1) * d)
        h_k = torch.tanh(g @ head.context.weight[rows].T + head.context.bias[rows])
        expected += prior[:, comp : comp + 1] * torch.softmax(h_k @ head.weight.T + head.bias, -1)
    torch.testing.assert_close(head.log_prob(g), expected.log())
    target = torch.randint(0, VOCAB, (7,))
    torch.testing.assert_close(head(g, target).nll, -expected.log()[torch.arange(7), target])


def test_one_component_is_a_softmax_over_tanh_contexts():
    head = MoSHead(HIDDEN, VOCAB, num_components=1).double()
    g = torch.randn(3, HIDDEN, dtype=torch.float64)
    h = torch.tanh(head.context(g))
    torch.testing.assert_close(
        head.log_prob(g), torch.log_softmax(h @ head.weight.T + head.bias, -1)
    )


def test_no_underflow_for_confident_components():
    """Log-space mixing keeps log P finite where probabilities underflow in float32."""
    head = MoSHead(HIDDEN, VOCAB, num_components=2).eval()
    with torch.no_grad():
        head.weight.mul_(400.0)
    log_probs = head.log_prob(torch.randn(4, HIDDEN))
    assert torch.isfinite(log_probs).all()
    assert log_probs.min() < -200  # far below float32's smallest probability
