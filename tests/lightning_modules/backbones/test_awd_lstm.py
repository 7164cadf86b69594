"""AWD-LSTM: each regulariser against a plain computation of it, and the AR/TAR hook."""

import pytest
import torch
import torch.nn.functional as F

from heads import SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import AWDLSTMBackbone, LSTMBackbone
from lightning_modules.errors import ModelConfigError

pytestmark = pytest.mark.usefixtures("one_thread")
V = 30


def make(**options):
    defaults = dict(embedding_size=6, hidden_size=8, num_layers=3, output_size=5)
    return AWDLSTMBackbone(V, **{**defaults, **options})


def no_dropout(**options):
    zeros = dict(input_dropout=0.0, hidden_dropout=0.0, output_dropout=0.0,
                 embedding_dropout=0.0, weight_dropout=0.0, ar_alpha=0.0, tar_beta=0.0)  # fmt: skip
    return make(**{**zeros, **options})


def plain_forward(backbone, tokens, hh=None):
    """The stack written with torch's LSTM function, ``hh[i]`` replacing layer i's W_hh."""
    x = backbone.embedding(tokens)
    for i, layer in enumerate(backbone.layers):
        lstm = layer.lstm
        weights = [lstm.weight_ih_l0, lstm.weight_hh_l0 if hh is None else hh[i],
                   lstm.bias_ih_l0, lstm.bias_hh_l0]  # fmt: skip
        zeros = x.new_zeros(1, x.size(0), lstm.hidden_size)
        x = torch._VF.lstm(x, (zeros, zeros), weights, True, 1, 0.0, False, False, True)[0]
    return x


def test_state_dict_names_are_the_lstms_and_sizes_follow_the_options():
    backbone = make()
    assert "layers.0.lstm.weight_hh_l0" in backbone.state_dict()
    assert AWDLSTMBackbone.output_size_from({"embedding_size": 7}) == 7
    assert AWDLSTMBackbone.output_size_from({"embedding_size": 7, "output_size": 3}) == 3
    hidden, state = backbone(torch.randint(0, V, (2, 4)))
    assert hidden.shape == (2, 4, 5) and [s[0].shape[-1] for s in state] == [8, 8, 5]


def test_evaluation_is_the_plain_lstm_stack():
    backbone = make().eval()
    tokens = torch.randint(0, V, (3, 7))
    torch.testing.assert_close(backbone(tokens)[0], plain_forward(backbone, tokens))


def test_weight_drop_is_one_dropconnect_mask_on_each_hidden_matrix():
    backbone = no_dropout(weight_dropout=0.5).train()
    tokens = torch.randint(0, V, (3, 7))
    torch.manual_seed(5)
    hidden, _ = backbone(tokens)
    torch.manual_seed(5)  # the same masks, drawn in the same order
    dropped = [F.dropout(layer.lstm.weight_hh_l0, 0.5) for layer in backbone.layers]
    torch.testing.assert_close(hidden, plain_forward(backbone, tokens, dropped))
    assert all((d == 0).float().mean() > 0.3 for d in dropped)
    hidden.sum().backward()  # a dropped entry gets no gradient, a kept one does
    grad = backbone.layers[1].lstm.weight_hh_l0.grad
    assert torch.all(grad[dropped[1] == 0] == 0) and grad[dropped[1] != 0].abs().sum() > 0


def test_embedding_dropout_drops_whole_word_types():
    backbone = no_dropout(embedding_dropout=0.5).train()
    tokens = torch.tensor([[3, 3, 4, 4, 3], [4, 3, 5, 5, 3]])
    torch.manual_seed(1)
    embedded = backbone._embed(tokens)
    weight = backbone.embedding.weight
    for token in (3, 4, 5):
        rows = embedded[tokens == token]
        kept = torch.allclose(rows, weight[token].expand_as(rows) * 2)
        dropped = torch.all(rows == 0)
        assert kept or dropped, token  # every occurrence alike, scaled by 1 / (1 - p)
    backbone.eval()
    torch.testing.assert_close(backbone._embed(tokens), weight[tokens])


def test_ar_and_tar_are_the_papers_terms_and_read_once():
    backbone = no_dropout(output_dropout=0.4, ar_alpha=2.0, tar_beta=1.0).train()
    tokens = torch.randint(0, V, (2, 6))
    torch.manual_seed(2)
    output, _ = backbone(tokens)
    raw = plain_forward(backbone, tokens)
    expected = 2.0 * output.pow(2).mean() + 1.0 * (raw[:, 1:] - raw[:, :-1]).pow(2).mean()
    torch.testing.assert_close(backbone.extra_loss(), expected)
    assert backbone.extra_loss() is None  # consumed
    backbone.eval()
    backbone(tokens)
    assert backbone.extra_loss() is None  # evaluation adds nothing
    assert LSTMBackbone(V).extra_loss() is None  # the default hook


def test_language_model_adds_the_backbone_term_to_the_training_loss():
    torch.manual_seed(0)
    backbone = make(ar_alpha=2.0, tar_beta=1.0)
    model = LanguageModel(backbone, SoftmaxHead(5, V))
    tokens = torch.randint(0, V, (2, 6))
    batch = (tokens[:, :-1], tokens[:, 1:])
    model.train()
    torch.manual_seed(3)
    loss = model._step(batch, "train")
    torch.manual_seed(3)
    hidden, _ = backbone(batch[0])
    head_loss = model.head(hidden.reshape(-1, 5), batch[1].reshape(-1)).loss
    torch.testing.assert_close(loss, head_loss + backbone.extra_loss())


@pytest.mark.parametrize("option", ["weight_dropout", "embedding_dropout", "input_dropout"])
def test_bad_probability_is_one_clear_error(option):
    with pytest.raises(ModelConfigError, match=option):
        make(**{option: 1.0})


def test_an_output_size_of_zero_is_refused_not_taken_for_unset():
    assert AWDLSTMBackbone.output_size_from({"embedding_size": 8, "output_size": 0}) == 0
    assert AWDLSTMBackbone.output_size_from({"embedding_size": 8}) == 8
    with pytest.raises(ModelConfigError, match="model.backbone.output_size must be a positive"):
        AWDLSTMBackbone(20, embedding_size=8, hidden_size=8, output_size=0)
