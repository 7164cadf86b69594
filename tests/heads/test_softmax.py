import pytest
import torch

from heads import HeadConfigError, SoftmaxHead
from tests.heads.contract import ALL_CHECKS, HIDDEN, VOCAB


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("embedding_size", [None, 4], ids=["no_projection", "projection"])
def test_contract(check, embedding_size):
    torch.manual_seed(0)
    check(lambda: SoftmaxHead(HIDDEN, VOCAB, embedding_size=embedding_size))


def test_equals_plain_log_softmax():
    head = SoftmaxHead(HIDDEN, VOCAB).double()
    hidden = torch.randn(5, HIDDEN, dtype=torch.float64)
    expected = torch.log_softmax(hidden @ head.weight.T + head.bias, dim=-1)
    torch.testing.assert_close(head.log_prob(hidden), expected)


def test_weight_tying_shares_the_parameter_and_checks_shapes():
    head = SoftmaxHead(HIDDEN, VOCAB, embedding_size=4)
    embedding = torch.nn.Embedding(VOCAB, 4)
    head.tie_output_embedding(embedding.weight)
    assert head.weight is embedding.weight
    with pytest.raises(HeadConfigError, match="embedding_size"):
        SoftmaxHead(HIDDEN, VOCAB).tie_output_embedding(embedding.weight)


def test_bad_sizes_are_reported():
    with pytest.raises(HeadConfigError, match="vocab_size"):
        SoftmaxHead(HIDDEN, 0)
    with pytest.raises(ValueError, match=r"hidden of shape \[N, 6\]"):
        SoftmaxHead(HIDDEN, VOCAB).log_prob(torch.randn(3, 5))
