import torch

from lightning_modules.backbones import NGramBackbone


def test_order_one_is_the_embedding():
    backbone = NGramBackbone(vocab_size=10, output_size=4)
    tokens = torch.tensor([[1, 2, 3]])
    hidden, state = backbone(tokens)
    assert state is None and torch.equal(hidden, backbone.embedding(tokens))


def test_higher_order_carries_history_across_windows():
    torch.manual_seed(0)
    backbone = NGramBackbone(vocab_size=10, output_size=4, order=3, hidden_layers=1)
    tokens = torch.randint(0, 10, (2, 12))
    whole, _ = backbone(tokens)
    first, state = backbone(tokens[:, :5])
    second, _ = backbone(tokens[:, 5:], state)
    torch.testing.assert_close(torch.cat((first, second), 1), whole)
    # position t depends on tokens t-2..t only
    changed = tokens.clone()
    changed[:, 3] = (changed[:, 3] + 1) % 10
    other, _ = backbone(changed)
    torch.testing.assert_close(other[:, :3], whole[:, :3])
    torch.testing.assert_close(other[:, 6:], whole[:, 6:])
    assert not torch.allclose(other[:, 3:6], whole[:, 3:6])
