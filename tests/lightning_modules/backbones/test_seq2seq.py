import pytest
import torch

from lightning_modules.backbones import Seq2SeqTransformer
from lightning_modules.backbones.seq2seq import sinusoidal_positions
from lightning_modules.errors import ModelConfigError

SRC_V, TGT_V, D = 23, 17, 16


def make(**kwargs) -> Seq2SeqTransformer:
    torch.manual_seed(0)
    return Seq2SeqTransformer(SRC_V, TGT_V, model_size=D, num_heads=2, encoder_layers=2,
                              decoder_layers=2, feedforward_size=32, **kwargs).eval()  # fmt: skip


def batch(pad_value: int = 0):
    source = torch.randint(0, SRC_V, (3, 7))
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[0, 4:] = True
    padding[2, 6:] = True
    source[padding] = pad_value
    target = torch.randint(0, TGT_V, (3, 5))
    return source, padding, target


def test_shapes_and_positions():
    model = make()
    source, padding, target = batch()
    assert model(source, padding, target).shape == (3, 5, D)
    table = sinusoidal_positions(10, 8)
    assert torch.allclose(table[3, 0], torch.tensor(3.0).sin())
    assert torch.allclose(table[3, 1], torch.tensor(3.0).cos())
    torch.testing.assert_close(sinusoidal_positions(4, 8, first=6), table[6:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sequences_longer_than_the_position_table_are_read(dtype):
    """A long test sentence (source 7, target 5 tokens, a table of 4 positions): the same
    outputs as a model whose table holds them, in encoding, decoding and the cached decoding
    steps; nothing is refused."""
    short, long = make(max_length=4).to(dtype), make(max_length=64).to(dtype)
    source, padding, target = batch()
    torch.testing.assert_close(short(source, padding, target), long(source, padding, target))
    memory = long.encode(source, padding)
    torch.testing.assert_close(short.encode(source, padding), memory)
    cache_short = cache_long = None
    for t in range(1, target.size(1) + 1):
        step_short, cache_short = short.decode_step(target[:, :t], memory, padding, cache_short)
        step_long, cache_long = long.decode_step(target[:, :t], memory, padding, cache_long)
        torch.testing.assert_close(step_short, step_long)
        assert step_short.dtype == dtype


def test_no_attention_to_source_padding():
    """Other ids, or more padding, at padded source positions leave every output unchanged."""
    model = make()
    torch.manual_seed(1)
    source, padding, target = batch(pad_value=0)
    reference = model(source, padding, target)
    other = source.clone()
    other[padding] = torch.randint(1, SRC_V, (int(padding.sum()),))
    torch.testing.assert_close(model(other, padding, target), reference)
    longer = torch.cat((source, torch.randint(0, SRC_V, (3, 4))), dim=1)
    longer_padding = torch.cat((padding, torch.ones(3, 4, dtype=torch.bool)), dim=1)
    torch.testing.assert_close(model(longer, longer_padding, target), reference)
    # the encoder's real positions do not depend on the padding either
    memory = model.encode(other, padding)
    torch.testing.assert_close(memory[~padding], model.encode(source, padding)[~padding])
    # and a real source token does matter (the check above can fail)
    changed = source.clone()
    changed[0, 0] = (changed[0, 0] + 1) % SRC_V
    assert not torch.allclose(model(changed, padding, target)[0], reference[0])


def test_decoder_is_causal():
    """Changing target tokens after position t leaves outputs up to t unchanged."""
    model = make()
    source, padding, target = batch()
    reference = model(source, padding, target)
    for t in range(target.size(1) - 1):
        changed = target.clone()
        changed[:, t + 1 :] = (changed[:, t + 1 :] + 1) % TGT_V
        out = model(source, padding, changed)
        torch.testing.assert_close(out[:, : t + 1], reference[:, : t + 1])
        assert not torch.allclose(out[:, t + 1 :], reference[:, t + 1 :])


def test_shared_embeddings():
    model = Seq2SeqTransformer(20, 20, model_size=D, num_heads=2, share_embeddings=True)
    assert model.source_embedding is model.embedding
    assert sum(p.numel() for p in model.parameters() if p.dim() == 2 and p.size(0) == 20) == 20 * D
    assert make().source_embedding is not make().embedding
    with pytest.raises(ValueError, match="data.joint_vocab"):
        Seq2SeqTransformer(20, 21, model_size=D, num_heads=2, share_embeddings=True)


def test_incremental_decoding_equals_the_full_decoder():
    model = make()
    source, padding, target = batch()
    memory = model.encode(source, padding)
    full = model.decode(target, memory, padding)
    cache = None
    for t in range(target.size(1)):
        last, cache = model.decode_step(target[:, : t + 1], memory, padding, cache)
        torch.testing.assert_close(last, full[:, t], rtol=1e-5, atol=1e-5)
        assert [c.size(1) for c in cache] == [t + 1] * 2


def test_sizes_that_cannot_work_are_one_line_naming_the_options():
    with pytest.raises(
        ModelConfigError,
        match=r"^model.backbone.model_size \(30\) must be "
        r"divisible by model.backbone.num_heads \(4\)$",
    ):
        Seq2SeqTransformer(SRC_V, TGT_V, model_size=30, num_heads=4)
    with pytest.raises(ModelConfigError, match="model_size must be even"):
        Seq2SeqTransformer(SRC_V, TGT_V, model_size=9, num_heads=3)


@pytest.mark.parametrize(
    ("option", "value"),
    [("model_size", 0), ("num_heads", 0), ("feedforward_size", -1), ("decoder_layers", 0)],
)
def test_a_size_below_one_is_one_line_naming_the_option(option, value):
    """``model_size: 0`` was a ZeroDivisionError in the position encodings' ``size**-0.5``."""
    with pytest.raises(
        ModelConfigError,
        match=rf"^model.backbone.{option} must be a positive integer, got {value}$",
    ):
        Seq2SeqTransformer(SRC_V, TGT_V, **{option: value})


def test_a_seed_fixes_the_model():
    """The same seed builds the same weights, wherever the modules land in memory: the two
    embedding tables were initialised in the order of a set of the two modules (by address),
    so some models got each other's tables (6 of 20 models built here, kept alive)."""
    models = []
    for _ in range(20):
        torch.manual_seed(0)
        models.append(Seq2SeqTransformer(7, 5, model_size=8, num_heads=2, encoder_layers=1,
                                         decoder_layers=1, feedforward_size=16))  # fmt: skip
    first = models[0].state_dict()
    for model in models[1:]:
        for name, value in model.state_dict().items():
            assert torch.equal(value, first[name]), name


@pytest.mark.parametrize("dropout", [1.0, 1.5, -0.1])
def test_a_dropout_outside_0_1_is_one_line_naming_the_option(dropout):
    # nn.Dropout raised for 1.5 with a traceback naming no option, and took 1 (all zeros)
    with pytest.raises(ModelConfigError, match=r"model\.backbone\.dropout must be in \[0, 1\)"):
        Seq2SeqTransformer(10, 10, model_size=8, num_heads=2, dropout=dropout)
