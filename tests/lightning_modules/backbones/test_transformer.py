import pytest
import torch

from lightning_modules.backbones import TransformerBackbone


def test_is_causal():
    torch.manual_seed(0)
    model = TransformerBackbone(30, embedding_size=16, num_heads=2, num_layers=2).eval()
    tokens = torch.randint(0, 30, (2, 9))
    out, state = model(tokens)
    assert out.shape == (2, 9, 16) and state is None
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % 30
    out_changed, _ = model(changed)
    torch.testing.assert_close(out_changed[:, :6], out[:, :6])  # the past ignores the future
    assert not torch.allclose(out_changed[:, 6:], out[:, 6:])


def test_rejects_too_long_sequences():
    model = TransformerBackbone(30, embedding_size=8, num_heads=2, max_length=4)
    with pytest.raises(ValueError, match="max_length"):
        model(torch.zeros(1, 5, dtype=torch.long))


@pytest.mark.parametrize(("option", "value"), [("embedding_size", 0), ("num_heads", 0)])
def test_a_size_below_one_is_one_line_naming_the_option(option, value):
    """``num_heads: 0`` was a ZeroDivisionError (``embedding_size % num_heads``)."""
    from lightning_modules.errors import ModelConfigError

    with pytest.raises(
        ModelConfigError,
        match=rf"^model.backbone.{option} must be a positive integer, got {value}$",
    ):
        TransformerBackbone(30, **{option: value})


def test_a_dropout_of_one_is_one_line_naming_the_option():
    from lightning_modules.errors import ModelConfigError

    with pytest.raises(ModelConfigError, match=r"model\.backbone\.dropout must be in \[0, 1\)"):
        TransformerBackbone(10, embedding_size=8, num_heads=2, dropout=1.0)
