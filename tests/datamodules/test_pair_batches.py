import numpy as np
import pytest
import torch

from datamodules.errors import DataConfigError
from datamodules.pair_batches import (
    EncodedPairs,
    LengthSortedSampler,
    TokenBucketBatchSampler,
    collate_pairs,
)
from heads import IGNORE_INDEX

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


def test_evaluation_cut_into_fewer_batches_than_ranks_gives_each_rank_some_lines_once():
    # Multi30k's valid split is 3 batches of 8192 tokens: on 4 or 8 ranks some would get no
    # batch, and Lightning stops ("DataLoader within local rank has zero length")
    source = LENGTHS
    target = [n + (i % 3) for i, n in enumerate(LENGTHS)]
    evaluation = LengthSortedSampler(source, target, shuffle=False)
    assert len(list(TokenBucketBatchSampler(evaluation, 128))) == 3

    def cost(batch: list[int]) -> int:
        return len(batch) * max(max(source[i], target[i]) for i in batch)

    for world in (4, 8):
        shards = [list(TokenBucketBatchSampler(evaluation, 128, r, world)) for r in range(world)]
        assert all(len(shard) == 1 for shard in shards)
        lines = [i for shard in shards for batch in shard for i in batch]
        assert sorted(lines) == list(range(len(source)))  # every line once
        # the batches are pieces of the length-sorted order, dealt in turn
        assert lines == list(evaluation)
        assert max(cost(shard[0]) for shard in shards) <= 128 * 4 // world

    # with more batches than ranks nothing is cut: rank r takes batches r, r + n, ...
    whole = list(TokenBucketBatchSampler(evaluation, 64))
    assert len(whole) == 6
    shards = [list(TokenBucketBatchSampler(evaluation, 64, r, 4)) for r in range(4)]
    assert shards == [whole[r::4] for r in range(4)]


def test_an_evaluation_split_with_fewer_lines_than_ranks_is_one_clear_error():
    evaluation = LengthSortedSampler([2, 3, 4], [2, 3, 4], shuffle=False)
    message = r"evaluation split of 3 lines cannot give each of 4 DDP ranks a batch: .* at most 3"
    with pytest.raises(DataConfigError, match=message):
        TokenBucketBatchSampler(evaluation, 64, rank=3, world_size=4, longer_alone=True)
    assert list(TokenBucketBatchSampler(evaluation, 64, rank=2, world_size=3)) == [[2]]


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
