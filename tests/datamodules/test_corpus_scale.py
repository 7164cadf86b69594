"""Translation batching and preparation at corpus scale: no Python step per pair where numpy
does the work, the same batches as the plain definition, and the <unk> share of each split."""

import random
import sys

import numpy as np
import pytest

from datamodules import pair_batches
from datamodules.pair_batches import LengthSortedSampler, TokenBucketBatchSampler


def plain_order(source: list[int], target: list[int], seed: int, epoch: int) -> list[int]:
    """The documented order: by (source, target) length, ties by ``random.Random(seed +
    epoch).random()`` drawn once per line in line order."""
    rng = random.Random(seed + epoch)
    tie = [rng.random() for _ in source]
    return sorted(range(len(source)), key=lambda i: (source[i], target[i], tie[i]))


def plain_greedy(sizes: list[int], budget: int) -> list[list[int]]:
    """Positions cut into batches: a batch grows while lines x longest stays in the budget."""
    batches, batch, longest = [], [], 0
    for position, size in enumerate(sizes):
        if batch and (len(batch) + 1) * max(longest, size) > budget:
            batches.append(batch)
            batch, longest = [], 0
        batch.append(position)
        longest = max(longest, size)
    return [*batches, batch] if batch else batches


def test_uniform_draws_are_the_generators_own_draws_bit_for_bit():
    from datamodules.pair_batches import uniform_draws

    for seed in (0, 7, 2**40 + 3):
        ours, theirs = random.Random(seed), random.Random(seed)
        expected = np.array([theirs.random() for _ in range(1001)], dtype=np.float64)
        assert np.array_equal(uniform_draws(ours, 1001), expected)
        assert ours.random() == theirs.random()  # the generator left in the same state
    assert uniform_draws(random.Random(0), 0).shape == (0,)


@pytest.mark.parametrize("seed", range(3))
def test_order_and_batches_are_those_of_the_plain_definition(seed):
    generator = random.Random(seed)
    n = 3000
    source = [generator.randint(2, 40) for _ in range(n)]
    target = [max(2, s + generator.randint(-6, 9)) for s in source]
    sampler = LengthSortedSampler(np.array(source), np.array(target), shuffle=True, seed=seed)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order = plain_order(source, target, seed, epoch)
        assert list(sampler) == order
        sizes = [max(source[i], target[i]) for i in order]
        expected = [[order[p] for p in batch] for batch in plain_greedy(sizes, 300)]
        got = list(TokenBucketBatchSampler(sampler, 300))
        # the batches are those of the plain cut, shuffled (as many, each once)
        assert sorted(got) == sorted(expected)
        assert all(len(b) * max(max(source[i], target[i]) for i in b) <= 300 for b in got)
    plain = LengthSortedSampler(source, target, shuffle=False)
    assert list(plain) == sorted(range(n), key=lambda i: (source[i], target[i], i))


def python_lines_run(function, *args) -> int:
    """Lines of ``datamodules/pair_batches.py`` the interpreter runs inside ``function``."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename == pair_batches.__file__:
            if event == "line":
                count += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        function(*args)
    finally:
        sys.settrace(None)
    return count


def test_an_epochs_batches_take_python_steps_per_batch_not_per_pair():
    # 400k pairs took 10 s an epoch (a Python sort key and a greedy loop per pair, on every
    # rank before the first step): the work in Python must grow with the batches, not the pairs
    generator = np.random.default_rng(0)
    counts = {}
    for n in (2_000, 20_000):
        source = generator.integers(5, 40, size=n)
        target = np.maximum(2, source + generator.integers(-5, 6, size=n))
        sampler = LengthSortedSampler(source, target, shuffle=True, seed=1)
        batches = TokenBucketBatchSampler(sampler, max_tokens=4000)
        counts[n] = python_lines_run(batches._cut_batches)
        cut = batches._cut_batches()
        assert sorted(i for b in cut for i in b) == list(range(n))  # every pair once
        assert counts[n] < n / 4, counts  # well under one line per pair
    # ten times the pairs (and batches) costs about ten times the Python lines, no more
    assert counts[20_000] < 15 * counts[2_000]


# -- the <unk> share of each split and side ---------------------------------------------------
def write_pairs(folder, prefix: str, pairs: list[tuple[str, str]]) -> None:
    (folder / f"{prefix}.de").write_text("".join(s + "\n" for s, _ in pairs))
    (folder / f"{prefix}.en").write_text("".join(t + "\n" for _, t in pairs))


TRAIN = [("ein Hund", "a dog"), ("eine Katze", "a cat"), ("zwei Hunde .", "two dogs .")] * 3 + [
    ("ein Pferd", "a horse"),  # seen once: <unk> with min_freq 2
]
VALID = [("ein Vogel", "a bird <unk>"), ("eine Katze", "a cat"), ("ein Pferd", "a horse")]


def unknown_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "tokens (" in r.getMessage()]


def test_each_splits_unk_share_is_counted_per_side_and_said_also_on_a_cache_hit(tmp_path, caplog):
    import logging

    from datamodules import TranslationDataModule

    for prefix, pairs in (("train", TRAIN), ("val", VALID), ("test_2016_flickr", TRAIN[:2])):
        write_pairs(tmp_path, prefix, pairs)
    options = dict(path=str(tmp_path), min_freq=2, cache_dir=str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger="datamodules")
    for run in ("miss", "hit"):
        caplog.clear()
        data = TranslationDataModule(**options)
        data.setup("fit")
        # words plainly: tokens with <eos> a line; <unk> those seen once in their training side
        # (a <unk> the text writes is not counted)
        train_tokens = {
            side: sum(len(p[k].split()) + 1 for p in TRAIN)
            for k, side in ((0, "source"), (1, "target"))
        }
        assert data.unknown_tokens["train"] == {
            "source": (1, train_tokens["source"]),  # Pferd
            "target": (1, train_tokens["target"]),  # horse
        }, run
        assert data.unknown_tokens["valid"] == {
            "source": (2, 9),  # Vogel, Pferd
            "target": (2, 10),  # bird, horse (the written <unk> not counted)
        }, run
        said = unknown_lines(caplog)
        assert len(said) == 2, (run, said)
        assert said[1].startswith(
            "warning: valid: <unk>: source 2 of 9 tokens (22.22%), target 2 of 10 tokens "
            "(20.00%) (words not in the training vocabulary"
        )
        assert "words seen fewer than data.min_freq=2 times" in said[0]


def test_a_bpe_splits_unseen_characters_are_counted(tmp_path, caplog):
    import logging

    from datamodules import TranslationDataModule

    valid = [("ein Hünd", "a dog"), ("eine Katze", "a cat")]  # ü never seen in training
    for prefix, pairs in (("train", TRAIN), ("val", valid), ("test_2016_flickr", valid)):
        write_pairs(tmp_path, prefix, pairs)
    options = dict(path=str(tmp_path), vocab="bpe", bpe_vocab_size=40)
    caplog.set_level(logging.INFO, logger="datamodules")
    data = TranslationDataModule(**options, cache_dir=str(tmp_path / "cache"))
    data.setup("fit")
    assert data.unknown_tokens["train"]["source"][0] == 0  # BPE saw every training character
    assert data.unknown_tokens["valid"]["source"][0] == 1
    assert data.unknown_tokens["valid"]["target"][0] == 0
    said = unknown_lines(caplog)
    assert any(line.startswith("warning: valid: <unk_char>: source 1 of") for line in said)
