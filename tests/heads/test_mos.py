import pytest
import torch

from heads import MoSHead, mos
from heads.fused_cross_entropy import LossOptions
from tests.heads.contract import (
    HIDDEN,
    VOCAB,
    check_compiles_without_graph_breaks,
    check_inductor_compiles_every_batch_size,
    check_loss_matches_reference,
    check_training_keeps_no_vocabulary_rows,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def make_head(**options) -> MoSHead:
    return MoSHead(HIDDEN, VOCAB, **{"num_components": 3, "embedding_size": 5, **options})


def plain_log_prob(head: MoSHead, g: torch.Tensor) -> torch.Tensor:
    """P(x|c) = sum_k pi_k softmax(W tanh(H_k g) + b)_x, written in probability space."""
    k, d = head.num_components, head.embedding_size
    prior = torch.softmax(g @ head.prior.weight.T, dim=-1)  # [N, K]
    expected = torch.zeros(g.size(0), head.vocab_size, dtype=g.dtype)
    for comp in range(k):
        rows = slice(comp * d, (comp + 1) * d)
        h_k = torch.tanh(g @ head.context.weight[rows].T + head.context.bias[rows])
        logits = h_k @ head.weight.T + (0 if head.bias is None else head.bias)
        expected = expected + prior[:, comp : comp + 1] * torch.softmax(logits, -1)
    return expected.log()


@pytest.mark.parametrize("plan", ["rows", "eager"])
@pytest.mark.parametrize("bias", [True, False])
def test_loss_gradients_log_prob_and_topk_equal_plain_reference(bias, plan, monkeypatch):
    """The training loss by either plan (rows: the gradient in the forward by token tiles;
    eager: K N component rows by column chunks; smoothing by recomputed chunks in both) and
    the exact log_prob by vocabulary blocks (7 columns here) against probability-space math."""
    monkeypatch.setattr(mos, "_EVAL_ENTRIES", 7 * 3 * 9)
    torch.manual_seed(2)

    def make() -> MoSHead:
        head = make_head(bias=bias)
        head.loss_options = LossOptions(plan=plan, rows=6)  # rows: tiles of 2 tokens
        return head

    check_loss_matches_reference(make, plain_log_prob)


def test_training_keeps_no_vocabulary_rows():
    """Not even [N, K, V] / 4: the K N component rows go through the fused primitive."""
    check_training_keeps_no_vocabulary_rows(
        lambda: MoSHead(8, 3000, num_components=4, embedding_size=4)
    )


def test_compiles_without_graph_breaks():
    check_compiles_without_graph_breaks(lambda: make_head(context_dropout=0.1))


def test_inductor_compiles_the_column_plan_with_label_smoothing():
    """Regression: Inductor's CPU code generation failed on the backward's bias scatter
    (``index_add_`` by the component rows' repeated targets), so a translation fit of MoS
    with the compile preset and label smoothing stopped at its first backward. (Row tiles
    and 9 components: Inductor vectorises the repeated index otherwise below 9.)"""
    check_inductor_compiles_every_batch_size(
        lambda: make_head(num_components=9),
        LossOptions(plan="eager", rows=128),
        label_smoothing=0.1,
        runs=((29, True),),
    )


def test_equals_plain_mixture_of_softmaxes():
    torch.manual_seed(1)
    head = MoSHead(HIDDEN, VOCAB, num_components=4, embedding_size=5).double().eval()
    g = torch.randn(7, HIDDEN, dtype=torch.float64)
    expected = plain_log_prob(head, g)
    torch.testing.assert_close(head.log_prob(g), expected)
    target = torch.randint(0, VOCAB, (7,))
    torch.testing.assert_close(head(g, target).nll, -expected[torch.arange(7), target])


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


@pytest.mark.parametrize("dropout", [1.0, 1.5])
def test_a_context_dropout_outside_0_1_is_refused(dropout):
    from heads.errors import HeadConfigError

    with pytest.raises(HeadConfigError, match=r"context_dropout must be in \[0, 1\)"):
        MoSHead(8, 20, num_components=2, context_dropout=dropout)
