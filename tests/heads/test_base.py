"""Shared pieces of ``heads/base.py`` that every head uses."""

import pytest
import torch

from heads import MixtapeHead, MoSHead, SoftmaxHead
from heads.base import sort_into_slots, zipf_log_prior


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


@pytest.mark.parametrize(
    "highest, capacities",
    [(4, (24, 20)), (3, (30, 0)), (3, (30, 5)), (2, (4, 4))],  # groups 3, then 2 and 3, empty
)
def test_sort_into_slots_puts_each_groups_rows_in_its_slots_in_order(highest, capacities):
    """Groups 2.. in fixed slots: a group's rows, in the order they come, then slots marked
    invalid; every shape the capacities' (a group of none fills no slot)."""
    labels = torch.randint(0, highest, (40,), generator=torch.Generator().manual_seed(highest))
    rows, valid = sort_into_slots(labels, 4, 2, capacities)
    assert rows.shape == valid.shape == (sum(capacities),)
    start = 0
    for group, capacity in zip((2, 3), capacities, strict=True):
        members = (labels == group).nonzero().squeeze(1).tolist()
        slots = slice(start, start + capacity)
        assert valid[slots].tolist() == [i < len(members) for i in range(capacity)]
        assert rows[slots][: len(members)].tolist() == members
        start += capacity


def test_sort_into_slots_fails_a_group_over_its_capacity():
    labels = torch.tensor([2, 2, 2, 0, 1, 3])
    with pytest.raises(RuntimeError, match="outgrew its slots"):
        sort_into_slots(labels, 4, 2, (2, 4))
