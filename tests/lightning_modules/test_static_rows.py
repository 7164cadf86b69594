"""``lightning_modules/static_rows.py``: the few row counts a compiled or graphed head sees."""

from types import SimpleNamespace

import pytest
import torch

from heads import IGNORE_INDEX, AdaptiveSoftmaxHead, MixtapeHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone
from lightning_modules.static_rows import pad_rows, padded_rows


def test_eight_sizes_per_octave_at_most_an_eighth_more():
    for rows in range(1, 5000):
        padded = padded_rows(rows)
        assert rows <= padded <= rows + rows // 8
        assert padded_rows(padded) == padded  # a padded size pads to itself
    assert [padded_rows(n) for n in (0, 9, 15, 16, 17, 700, 1953, 2040, 2048, 2049)] == [
        0, 9, 15, 16, 18, 704, 2048, 2048, 2048, 2304,
    ]  # fmt: skip
    octave = {padded_rows(n) for n in range(1025, 2049)}  # (1024, 2048]: 8 sizes
    assert sorted(octave) == list(range(1152, 2049, 128))
    with pytest.raises(ValueError, match="rows must be >= 0"):
        padded_rows(-1)


def test_padding_rows_are_zero_and_ignored_and_never_a_view():
    hidden, target = torch.randn(2, 3, 4).reshape(6, 4), torch.arange(6).reshape(2, 3).reshape(6)
    padded_hidden, padded_target = pad_rows(hidden, target, 8)
    assert torch.equal(padded_hidden[:6], hidden) and not padded_hidden[6:].any()
    assert padded_target.tolist() == [0, 1, 2, 3, 4, 5, IGNORE_INDEX, IGNORE_INDEX]
    same_hidden, same_target = pad_rows(hidden, target, 6)
    assert same_hidden._base is None and same_target._base is None  # copies, as padded ones
    torch.testing.assert_close(same_hidden, hidden)


@pytest.mark.parametrize("head_class", [MixtapeHead, AdaptiveSoftmaxHead])
def test_a_compiled_task_s_head_loss_pads_and_gives_the_batch_s_loss(head_class):
    """``compile`` on: the head sees padded rows (here 17 -> 18), the step's loss and the
    batch's per-token NLL are those of the unpadded rows. (No trainer: nothing compiles.)"""
    torch.manual_seed(0)
    extra = {"cutoffs": [10, 25], "div_value": 2.0} if head_class is AdaptiveSoftmaxHead else {}
    head = head_class(8, 40, **extra).double().eval()
    backbone = LSTMBackbone(40, embedding_size=8, hidden_size=8)
    plain = LanguageModel(backbone, head, tie_weights=False)
    compiled = LanguageModel(backbone, head, tie_weights=False, compile={"backend": "eager"})
    hidden = torch.randn(17, 8, dtype=torch.float64)
    target = torch.randint(0, 40, (17,))
    target[3] = IGNORE_INDEX
    seen = []
    hook = head.register_forward_pre_hook(lambda module, args: seen.append(args[0].size(0)))
    # the targets told to the head on the host are padded as its rows will be
    compiled._trainer = SimpleNamespace(predicting=False)
    compiled.on_before_batch_transfer((None, target.reshape(1, 17)), 0)
    if head_class is AdaptiveSoftmaxHead:  # ignored, short-list and cluster sizes of 18 rows
        groups = torch.bucketize(target[target >= 0], torch.tensor([10, 25]), right=True)
        expected = [2, *torch.bincount(groups, minlength=3).tolist()]
        assert head._expected_for(18) == expected
    padded = compiled.head_loss(hidden, target)
    expected = plain.head_loss(hidden, target)
    hook.remove()
    assert seen == [18, 17]
    torch.testing.assert_close(padded.loss, expected.loss)
    torch.testing.assert_close(padded.nll, expected.nll)  # [17]: cut back to the batch
