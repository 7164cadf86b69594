import pytest
import torch

from lightning_modules.backbones import LSTMBackbone
from lightning_modules.backbones.base import LMBackbone


def test_carried_state_continues_the_sequence():
    torch.manual_seed(0)
    model = LSTMBackbone(50, embedding_size=8, hidden_size=12, num_layers=3, output_size=6).eval()
    tokens = torch.randint(0, 50, (3, 10))
    whole, _ = model(tokens)
    first, state = model(tokens[:, :4])
    second, _ = model(tokens[:, 4:], LMBackbone.detach_state(state))
    assert whole.shape == (3, 10, 6)
    torch.testing.assert_close(torch.cat((first, second), 1), whole)


def test_detached_state_cuts_the_graph():
    model = LSTMBackbone(20, embedding_size=4, hidden_size=4, num_layers=2)
    _, state = model(torch.randint(0, 20, (2, 5)))
    assert state[0][0].requires_grad
    detached = LMBackbone.detach_state(state)
    assert all(not t.requires_grad for layer in detached for t in layer)
    torch.testing.assert_close(detached[1][1], state[1][1].detach())


def test_locked_dropout_shares_the_mask_over_time():
    model = LSTMBackbone(20, embedding_size=16, hidden_size=4, input_dropout=0.5).train()
    x = torch.ones(2, 7, 16)
    out = model.input_dropout(x)
    assert torch.equal(out[:, 0], out[:, -1])
    assert (out == 0).any()


def _masks(model):
    """The masks of every dropout (input, between layers, output) on a [2, 7, 16] input."""
    x = torch.ones(2, 7, 16)
    return [(d(x) != 0) for d in (model.input_dropout, model.hidden_dropout, model.output_dropout)]


def test_dropout_kinds_locked_one_mask_per_sequence_standard_one_per_step():
    torch.manual_seed(0)
    options = {"embedding_size": 16, "hidden_size": 16, "input_dropout": 0.5,
               "hidden_dropout": 0.5, "output_dropout": 0.5}  # fmt: skip
    locked = LSTMBackbone(20, **options).train()  # the default
    for mask in _masks(locked):
        assert (mask == mask[:, :1]).all()  # the same mask at every time step
        assert not mask.all()
    standard = LSTMBackbone(20, dropout_kind="standard", **options).train()
    for mask in _masks(standard):
        assert not (mask[:, 1:] == mask[:, :1]).all(dim=2).any()  # a new mask at every step
        assert 0.3 < mask.float().mean() < 0.7
    tokens = torch.randint(0, 20, (2, 7))
    torch.testing.assert_close(standard.eval()(tokens)[0], standard(tokens)[0])  # off in eval


def test_unknown_dropout_kind_is_a_config_error():
    from lightning_modules.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match="dropout_kind must be one of locked, standard"):
        LSTMBackbone(20, dropout_kind="zoneout")


def _lstm_flops(device: str) -> tuple[int, int]:
    """(counted, expected) FLOPs of a forward and backward through a 2-layer nn.LSTM."""
    from torch.utils.flop_counter import FlopCounterMode

    lstm = torch.nn.LSTM(8, 16, num_layers=2, batch_first=True).to(device)
    x = torch.randn(3, 5, 8, device=device, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        lstm(x)[0].sum().backward()
    forward = 2 * 15 * (64 * (8 + 16) + 64 * (16 + 16))  # W_ih, W_hh of each layer per step
    return counter.get_total_flops(), 3 * forward  # the backward costs twice the forward


def test_fused_lstm_kernels_have_flop_formulas():
    import lightning_modules.backbones  # noqa: F401  (registers the formulas)

    counted, expected = _lstm_flops("cpu")
    assert counted == expected


@pytest.mark.gpu
def test_fused_lstm_kernels_have_flop_formulas_on_cuda():
    import lightning_modules.backbones  # noqa: F401

    counted, expected = _lstm_flops("cuda")
    assert counted == expected


@pytest.mark.parametrize(
    ("option", "value"), [("hidden_size", 0), ("embedding_size", -1), ("output_size", 0)]
)
def test_a_size_below_one_is_one_line_naming_the_option(option, value):
    """torch said "hidden_size must be greater than zero" (for an output_size of 0 too) or
    "negative dimension -1", naming no option, through a traceback."""
    from lightning_modules.errors import ModelConfigError

    with pytest.raises(
        ModelConfigError,
        match=rf"^model.backbone.{option} must be a positive integer, got {value}$",
    ):
        LSTMBackbone(20, **{option: value})


def test_an_output_size_of_zero_is_not_taken_for_unset():
    """The head's hidden_size (linked from it) was the hidden size: the backbone's error then
    came from a head and a backbone that disagreed."""
    assert LSTMBackbone.output_size_from({"hidden_size": 16, "output_size": 0}) == 0
    assert LSTMBackbone.output_size_from({"hidden_size": 16, "output_size": None}) == 16
