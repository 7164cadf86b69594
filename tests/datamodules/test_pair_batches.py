import itertools
import random

import numpy as np
import pytest
import torch

from datamodules.errors import DataConfigError
from datamodules.pair_batches import (
    EncodedPairs,
    LengthSortedSampler,
    TokenBucketBatchSampler,
    balanced_batches,
    collate_pairs,
)
from heads import IGNORE_INDEX
from tests.conftest import MULTI30K, shipped_text

LENGTHS = [3, 5, 2, 8, 4, 4, 6, 1, 7, 2, 3] * 5


def test_encoded_pairs_read_their_lines_from_the_flat_token_files():
    source = np.arange(10, dtype=np.int32)  # lines [10, 11], [12], [13, 14, 15, ...]
    source_offsets = np.array([0, 2, 3, 10])
    target = np.arange(100, 106, dtype=np.int32)
    target_offsets = np.array([0, 1, 4, 6])
    pairs = EncodedPairs(source, source_offsets, target, target_offsets, index=np.array([2, 0]))
    assert len(pairs) == 2
    assert pairs.source_lengths.tolist() == [7, 2] and pairs.target_lengths.tolist() == [2, 1]
    item = pairs[0]
    assert item["index"] == 2
    assert item["source_ids"].tolist() == list(range(3, 10))
    assert item["target_ids"].tolist() == [104, 105]


def test_collate_pads_the_sources_and_shifts_the_targets_behind_bos():
    eos, pad, bos = 2, 0, 2
    items = [
        {"source_ids": [5, 6, eos], "target_ids": [7, eos], "index": 4},
        {"source_ids": [8, eos], "target_ids": [9, 10, 11, eos], "index": 1},
    ]
    batch = collate_pairs(items, pad_id=pad, bos_id=bos)
    assert batch["source"].tolist() == [[5, 6, eos], [8, eos, pad]]
    assert batch["source_padding"].tolist() == [[False, False, False], [False, False, True]]
    assert batch["target_input"].tolist() == [[bos, 7, pad, pad], [bos, 9, 10, 11]]
    ignored = IGNORE_INDEX
    assert batch["target_output"].tolist() == [[7, eos, ignored, ignored], [9, 10, 11, eos]]
    assert batch["index"].tolist() == [4, 1]
    assert all(t.dtype == torch.long for k, t in batch.items() if k != "source_padding")


def test_the_order_is_by_length_with_ties_shuffled_per_epoch_unless_epochs_are_alike():
    sampler = LengthSortedSampler(LENGTHS, LENGTHS, shuffle=True, seed=3)
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    for order in orders:
        assert sorted(order) == list(range(len(LENGTHS)))
        assert [LENGTHS[i] for i in order] == sorted(LENGTHS)
    assert orders[0] != orders[1] != orders[2]

    alike = LengthSortedSampler(LENGTHS, LENGTHS, shuffle=True, seed=3, epochs_alike=True)
    alike.set_epoch(2)
    assert list(alike) == orders[0]
    plain = LengthSortedSampler(LENGTHS, LENGTHS, shuffle=False)
    plain.set_epoch(1)
    # without shuffling, ties keep the lines' order: evaluation batches are the same each run
    assert list(plain) == sorted(range(len(LENGTHS)), key=lambda i: (LENGTHS[i], i))


def test_batches_hold_every_pair_once_within_the_token_budget():
    source = LENGTHS
    target = [n + (i % 3) for i, n in enumerate(LENGTHS)]
    sampler = LengthSortedSampler(source, target, shuffle=True)
    batches = list(TokenBucketBatchSampler(sampler, max_tokens=16))
    assert sorted(i for b in batches for i in b) == list(range(len(source)))
    for batch in batches:
        longest = max(max(source[i], target[i]) for i in batch)
        assert len(batch) * longest <= 16
    # the order of the batches is shuffled, not their contents' lengths
    firsts = [max(source[i] for i in b) for b in batches]
    assert firsts != sorted(firsts)


def test_ddp_ranks_get_disjoint_equal_shares_in_training_and_every_batch_in_evaluation():
    order = LengthSortedSampler(LENGTHS, LENGTHS, shuffle=True)
    shards = [list(TokenBucketBatchSampler(order, 16, rank=r, world_size=2)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1])
    flat = [{i for b in shard for i in b} for shard in shards]
    assert not flat[0] & flat[1]

    evaluation = LengthSortedSampler(LENGTHS, LENGTHS, shuffle=False)
    shards = [list(TokenBucketBatchSampler(evaluation, 16, rank=r, world_size=2)) for r in (0, 1)]
    whole = list(TokenBucketBatchSampler(evaluation, 16))
    assert sorted(map(tuple, shards[0] + shards[1])) == sorted(map(tuple, whole))


def cost(batch: list[int], source: list[int], target: list[int]) -> int:
    """Padded tokens of the longer side: ``lines x longest``, what the budget bounds."""
    return len(batch) * max(max(source[i], target[i]) for i in batch)


def test_evaluation_cut_into_fewer_batches_than_ranks_gives_each_rank_some_lines_once():
    # Multi30k's valid split is 3 batches of 8192 tokens: on 4 or 8 ranks some would get no
    # batch, and Lightning stops ("DataLoader within local rank has zero length")
    source = LENGTHS
    target = [n + (i % 3) for i, n in enumerate(LENGTHS)]
    evaluation = LengthSortedSampler(source, target, shuffle=False)
    assert len(list(TokenBucketBatchSampler(evaluation, 128))) == 3

    for world in (4, 8):
        shards = [list(TokenBucketBatchSampler(evaluation, 128, r, world)) for r in range(world)]
        assert all(len(shard) == 1 for shard in shards)
        lines = [i for shard in shards for batch in shard for i in batch]
        # every line once; the batches are pieces of the length-sorted order, dealt in turn
        assert lines == list(evaluation)
        total = sum(cost(shard[0], source, target) for shard in shards)
        assert max(cost(shard[0], source, target) for shard in shards) <= 1.2 * total / world


def test_evaluation_under_ddp_is_dealt_in_balanced_rounds_of_one_batch_per_rank():
    source = LENGTHS
    target = [n + (i % 3) for i, n in enumerate(LENGTHS)]
    evaluation = LengthSortedSampler(source, target, shuffle=False)
    whole = list(TokenBucketBatchSampler(evaluation, 64))
    assert len(whole) == 6
    shards = [list(TokenBucketBatchSampler(evaluation, 64, r, 4)) for r in range(4)]
    # ceil(6 / 4) = 2 rounds: every rank two batches, within the budget
    assert [len(shard) for shard in shards] == [2] * 4
    assert all(cost(b, source, target) <= 64 for shard in shards for b in shard)
    # round k holds the k-th quarter of the order's pieces: limit_*_batches=1 on each rank
    # evaluates the shortest lines, as one process's first batches do
    rounds = [[shard[k] for shard in shards] for k in range(2)]
    assert [i for batches in rounds for b in batches for i in b] == list(evaluation)
    loads = [sum(cost(b, source, target) for b in shard) for shard in shards]
    assert max(loads) <= 1.1 * sum(loads) / 4


def optimal_partition_cost(sizes: list[int], count: int) -> int:
    """The least possible cost of the costliest of ``count`` contiguous batches of lines of
    ``sizes``, by trying every set of cut positions."""
    n, best = len(sizes), None
    for cuts in itertools.combinations(range(1, n), count - 1):
        bounds = [0, *cuts, n]
        worst = max((b - a) * max(sizes[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_balanced_batches_cost_the_least_possible_and_keep_the_order(seed):
    generator = random.Random(seed)
    sizes = [generator.randint(1, 12) for _ in range(11)]
    order = [generator.randrange(100) for _ in sizes]  # any line ids, kept in this order
    for count in (1, 2, 3, 5, 11):
        batches = balanced_batches(order, sizes, count)
        assert len(batches) == count and [i for b in batches for i in b] == order
        at = list(itertools.accumulate(len(b) for b in batches))
        worst = max(len(b) * max(sizes[e - len(b) : e]) for b, e in zip(batches, at, strict=True))
        assert worst == optimal_partition_cost(sizes, count), (sizes, count)


def multi30k_valid_lengths() -> tuple[list[int], list[int]]:
    """Tokens per line of the shipped validation split, ``<eos>`` included (the word
    vocabulary's: one a whitespace-separated word)."""
    sides = (shipped_text(MULTI30K / f"val.{lang}.xz").splitlines() for lang in ("de", "en"))
    source, target = ([len(line.split()) + 1 for line in lines] for lines in sides)
    return source, target


@pytest.mark.parametrize("world", [4, 8])
def test_multi30k_validation_on_4_and_8_ranks_costs_every_rank_alike(world):
    # cut by the budget of 8192 padded tokens it is 3 batches: dealt one to a rank, after
    # cutting the costliest until every rank had one, one rank padded 1.6 times the mean
    # (8177 tokens against 4 x 5042, 3780 against 8 x 2281); each rank's time is the slowest's
    source, target = multi30k_valid_lengths()
    evaluation = LengthSortedSampler(source, target, shuffle=False)
    assert len(list(TokenBucketBatchSampler(evaluation, 8192, longer_alone=True))) == 3
    shards = [
        list(TokenBucketBatchSampler(evaluation, 8192, r, world, longer_alone=True))
        for r in range(world)
    ]
    lines = sorted(i for shard in shards for batch in shard for i in batch)
    assert lines == list(range(len(source)))
    loads = [sum(cost(b, source, target) for b in shard) for shard in shards]
    assert max(loads) <= 1.02 * sum(loads) / world, loads


def test_a_training_split_cut_into_fewer_batches_than_ranks_gives_each_rank_one():
    # one batch of 64 tokens for 2 (or 4) ranks: dropping the batches that do not fill a
    # round left every rank none, and Lightning's fit stopped at once ("No training batches")
    lengths = [2, 3, 2, 4, 3, 2]
    order = LengthSortedSampler(lengths, lengths, shuffle=True, seed=1)
    assert len(list(TokenBucketBatchSampler(order, 64))) == 1
    for world in (2, 4):
        shards = [list(TokenBucketBatchSampler(order, 64, r, world)) for r in range(world)]
        assert [len(shard) for shard in shards] == [1] * world  # an epoch of one step
        lines = sorted(i for shard in shards for i in shard[0])
        assert lines == list(range(len(lengths)))  # every pair, once
    with pytest.raises(DataConfigError, match=r"training split of 6 lines .* 8 DDP ranks"):
        TokenBucketBatchSampler(order, 64, rank=0, world_size=8)


def test_a_pair_over_the_budget_is_refused_in_training_and_alone_in_evaluation():
    lengths = [2, 3, 9, 2]
    with pytest.raises(DataConfigError, match=r"data.max_tokens \(8\) must hold .* \(9 tokens\)"):
        TokenBucketBatchSampler(LengthSortedSampler(lengths, lengths, shuffle=True), 8)
    evaluation = LengthSortedSampler(lengths, lengths, shuffle=False)
    batches = list(TokenBucketBatchSampler(evaluation, 8, longer_alone=True))
    assert batches == [[0, 3], [1], [2]]  # 3 x 3 tokens would be over the budget too


def test_the_batches_are_cut_once_an_epoch_and_anew_for_the_next():
    sampler = LengthSortedSampler(LENGTHS, LENGTHS, shuffle=True)
    batches = TokenBucketBatchSampler(sampler, 16)
    first = list(batches)
    assert batches._batches() is batches._batches() and len(batches) == len(first)
    batches.set_epoch(1)
    assert sampler.epoch == 1 and list(batches) != first
