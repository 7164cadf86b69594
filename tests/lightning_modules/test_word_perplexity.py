"""Word perplexity over codes: the summed code NLL over the words the targets start, per
stage, reset when read."""

import math

import pytest
import torch

from lightning_modules.word_perplexity import update_word_sums, word_perplexity, word_sums


def test_word_perplexity_is_the_code_nll_over_the_words_started():
    starts = torch.tensor([True, True, False])  # codes 0 and 1 start a word, 2 continues one
    sums = word_sums(["val", "test"])
    batches = [
        (torch.tensor([0.5, 1.0, 2.0, 9.0]), torch.tensor([0, 1, 2, -100])),  # 2 words
        (torch.tensor([0.25, 0.75]), torch.tensor([2, 1])),  # 1 word (2 ends the last one)
    ]
    for nll, targets in batches:
        update_word_sums(sums, "val", starts, nll * (targets != -100), targets)
    update_word_sums(sums, "test", starts, torch.tensor([3.0]), torch.tensor([0]))
    expected = math.exp((0.5 + 1.0 + 2.0 + 0.25 + 0.75) / 3)  # ignored positions: no NLL
    assert float(word_perplexity(sums, "val")) == pytest.approx(expected)
    assert float(word_perplexity(sums, "test")) == pytest.approx(math.exp(3.0))  # apart
    assert float(word_perplexity(sums, "val")) == 1.0  # reset: nothing since
