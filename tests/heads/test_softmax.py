import pytest
import torch

from heads import HeadConfigError, SoftmaxHead
from tests.heads.contract import (
    HIDDEN,
    VOCAB,
    check_compiles_without_graph_breaks,
    check_loss_matches_reference,
    check_training_keeps_no_vocabulary_rows,
    chunked,
)


def plain_log_prob(head: SoftmaxHead, hidden: torch.Tensor) -> torch.Tensor:
    if head.projection is not None:
        hidden = hidden @ head.projection.weight.T + head.projection.bias
    return torch.log_softmax(hidden @ head.weight.T + head.bias, dim=-1)


@pytest.mark.parametrize("bias", [True, False])
def test_loss_gradients_log_prob_and_topk_equal_plain_reference(bias):
    torch.manual_seed(1)

    def reference(head, hidden):
        if bias:
            return plain_log_prob(head, hidden)
        return torch.log_softmax(hidden @ head.weight.T, dim=-1)

    check_loss_matches_reference(lambda: SoftmaxHead(HIDDEN, VOCAB, bias=bias), reference)
    check_loss_matches_reference(lambda: SoftmaxHead(HIDDEN, VOCAB, embedding_size=4),
                                 plain_log_prob)  # fmt: skip


def test_tied_weights_train_through_the_fused_loss():
    """Tied with an input embedding: the fused loss's gradient of W reaches the embedding."""
    head = SoftmaxHead(HIDDEN, VOCAB, embedding_size=4).double()
    embedding = torch.nn.Embedding(VOCAB, 4).double()
    head.tie_output_embedding(embedding.weight)
    head.loss_options = chunked(lambda: head)().loss_options
    hidden = torch.randn(7, HIDDEN, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (7,))
    head(hidden, target).loss.backward()
    expected = torch.autograd.grad(
        torch.nn.functional.cross_entropy(plain_log_prob(head, hidden), target),
        embedding.weight,
    )[0]
    torch.testing.assert_close(embedding.weight.grad, expected)


def test_training_keeps_no_vocabulary_rows():
    check_training_keeps_no_vocabulary_rows(lambda: SoftmaxHead(8, 2000, embedding_size=4))


def test_compiles_without_graph_breaks():
    check_compiles_without_graph_breaks(lambda: SoftmaxHead(HIDDEN, VOCAB, embedding_size=4))


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


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_the_plain_step_equals_the_fused_plans_in_float64(smoothing):
    """A launch-bound CUDA step (``plain``: one product and PyTorch's log-softmax, as auto
    runs where the logits fit ``saved_bytes``) gives the fused plans' loss, per-token NLL and
    gradients, with a projection, label smoothing and an ignored target."""
    from heads import IGNORE_INDEX
    from heads.fused_cross_entropy import LossOptions

    torch.manual_seed(2)
    head = SoftmaxHead(HIDDEN, VOCAB, embedding_size=4).double()
    hidden = torch.randn(10, HIDDEN, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, VOCAB, (10,))
    target[3] = IGNORE_INDEX
    results = []
    for plan in ("plain", "eager", "rows"):
        head.loss_options = LossOptions(plan=plan, columns=5)
        out = head(hidden, target, label_smoothing=smoothing)
        loss = out.loss + 0.3 * (out.nll * torch.arange(10, dtype=torch.float64)).sum()
        results.append([loss, out.nll, *torch.autograd.grad(loss, [hidden, *head.parameters()])])
    for other in results[1:]:
        for got, want in zip(results[0], other, strict=True):
            torch.testing.assert_close(got, want)
