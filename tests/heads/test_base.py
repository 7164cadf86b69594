"""Shared pieces of ``heads/base.py`` that every head uses."""

import pytest
import torch

from heads import MixtapeHead, MoSHead, SoftmaxHead
from heads.base import zipf_log_prior


def test_zipf_log_prior_is_the_centred_log_of_one_over_rank():
    ranks = torch.arange(1, 51, dtype=torch.float64)
    expected = -ranks.log() + ranks.log().mean()
    torch.testing.assert_close(zipf_log_prior(50).double(), expected, rtol=0, atol=1e-6)
    p = torch.softmax(zipf_log_prior(50).double(), 0)
    torch.testing.assert_close(p[0] / p[9], torch.tensor(10.0, dtype=torch.float64))


@pytest.mark.parametrize("head_class", [SoftmaxHead, MoSHead, MixtapeHead])
def test_every_head_with_a_bias_starts_it_alike(head_class):
    # comparisons between heads start from the same unigram shape (issue 18)
    torch.testing.assert_close(head_class(8, 50).bias.detach(), zipf_log_prior(50))
    assert torch.count_nonzero(head_class(8, 50, zipf_bias_init=False).bias) == 0
