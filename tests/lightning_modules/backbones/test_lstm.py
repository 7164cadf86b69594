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
