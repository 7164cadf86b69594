import pytest
import torch

from datamodules.bptt import BPTTBatches


def test_batches_are_contiguous_across_steps():
    tokens = torch.arange(103)
    batches = list(BPTTBatches(tokens, batch_size=4, bptt=5))
    stream_len = 103 // 4  # 25 tokens per stream, 24 predictions
    assert len(batches) == len(BPTTBatches(tokens, 4, 5)) == 5
    for x, y in batches:
        torch.testing.assert_close(y, x + 1)  # target is the next token
    for (x0, _), (x1, _) in zip(batches, batches[1:], strict=False):
        torch.testing.assert_close(x1[:, 0], x0[:, -1] + 1)  # window i+1 continues window i
    inputs = torch.cat([x for x, _ in batches], dim=1)
    expected = torch.arange(4 * stream_len).view(4, stream_len)[:, :-1]
    torch.testing.assert_close(inputs, expected)


def test_ranks_split_streams_without_overlap_or_loss():
    tokens = torch.arange(1000)
    single = torch.cat([x for x, _ in BPTTBatches(tokens, 8, 7)], dim=1)
    per_rank = [
        torch.cat([x for x, _ in BPTTBatches(tokens, 8, 7, rank=r, world_size=4)], dim=1)
        for r in range(4)
    ]
    torch.testing.assert_close(torch.cat(per_rank, dim=0), single)


@pytest.mark.parametrize("args", [(0, 5), (4, 0), (-1, 3)])
def test_sizes_must_be_positive(args):
    with pytest.raises(ValueError, match="must be positive"):
        BPTTBatches(torch.arange(100), *args)


def test_batch_size_must_split_across_ranks():
    with pytest.raises(ValueError, match="divisible by the number of processes"):
        BPTTBatches(torch.arange(100), 5, 3, rank=0, world_size=2)
