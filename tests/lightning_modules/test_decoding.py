import itertools

import pytest
import torch

from heads import SoftmaxHead
from lightning_modules.backbones import Seq2SeqTransformer
from lightning_modules.decoding import DecodeConfig, beam_search, greedy_decode, length_penalty

D = 16


def make(src_vocab: int, tgt_vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    backbone = Seq2SeqTransformer(src_vocab, tgt_vocab, model_size=D, num_heads=2,
                                  encoder_layers=1, decoder_layers=1, feedforward_size=32,
                                  dropout=0.0)  # fmt: skip
    # uniform toy tokens, not frequency-sorted ids: a zero bias start, not the Zipf one
    head = SoftmaxHead(D, tgt_vocab, zipf_bias_init=False)
    with torch.no_grad():  # a random model that does not stop at once
        head.bias[0] = -1.0
    return backbone.eval(), head.eval()


def sources(vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    source = torch.randint(1, vocab, (5, 6), generator=gen)
    padding = torch.zeros(5, 6, dtype=torch.bool)
    for row, length in enumerate([6, 3, 5, 1, 4]):
        padding[row, length:] = True
    return source, padding


@torch.no_grad()
def rescore(backbone, head, source, padding, hypothesis: list[int], eos: int, bos: int) -> float:
    """Plain teacher-forced log P(hypothesis + <eos> | source) of one sentence."""
    target = torch.tensor([hypothesis + [eos]])
    decoder_input = torch.tensor([[bos] + hypothesis])
    hidden = backbone(source[None], padding[None], decoder_input)[0]
    log_probs = head.log_prob(hidden)
    return sum(float(log_probs[t, y]) for t, y in enumerate(target[0].tolist()))


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_size_one_is_greedy(alpha, seed):
    backbone, head = make(9, 7, seed)
    source, padding = sources(9, seed)
    config = DecodeConfig(max_length_a=1.0, max_length_b=4, length_penalty=alpha)
    greedy = greedy_decode(backbone, head, source, padding, config, 0, 0)
    assert greedy == beam_search(backbone, head, source, padding, config, 0, 0, beam_size=1)
    assert len({len(g) for g in greedy}) > 1  # varied lengths: the check has teeth
    for hyp, length in zip(greedy, (~padding).sum(1).tolist(), strict=True):
        assert len(hyp) + 1 <= length + 4  # max length a * |x| + b, <eos> included


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_wide_beam_finds_the_exhaustive_optimum(alpha):
    """With a beam wider than all prefixes, beam search is exhaustive: compare with a plain
    enumeration of every hypothesis up to the maximum length."""
    vocab, eos = 4, 0
    backbone, head = make(6, vocab, seed=3)
    source, padding = sources(6, seed=3)
    config = DecodeConfig(max_length_a=0.0, max_length_b=3, length_penalty=alpha)
    found = beam_search(backbone, head, source, padding, config, eos, eos, beam_size=16)
    for i in range(source.size(0)):
        candidates = [
            list(h)
            for n in range(3)  # up to 2 tokens + <eos> = the maximum length 3
            for h in itertools.product(range(1, vocab), repeat=n)
        ]
        scored = {
            tuple(h): rescore(backbone, head, source[i], padding[i], h, eos, eos)
            / length_penalty(len(h) + 1, alpha)
            for h in candidates
        }
        assert tuple(found[i]) == max(scored, key=scored.get)


@pytest.fixture(scope="module")
def trained():
    """A tiny model trained briefly to reverse sequences: peaked but imperfect."""
    vocab = 8
    backbone, head = make(vocab, vocab, seed=4)
    backbone.train(), head.train()
    params = list(backbone.parameters()) + list(head.parameters())
    optimizer = torch.optim.Adam(params, lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        source = torch.randint(1, vocab, (32, 5), generator=gen)
        padding = torch.zeros_like(source, dtype=torch.bool)
        target = torch.cat((source.flip(1), torch.zeros(32, 1, dtype=torch.long)), dim=1)
        decoder_input = torch.cat((torch.zeros(32, 1, dtype=torch.long), target[:, :-1]), dim=1)
        hidden = backbone(source, padding, decoder_input)
        loss = head(hidden.reshape(-1, D), target.reshape(-1)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return backbone.eval(), head.eval(), vocab


def test_beam_finds_a_sequence_at_least_as_likely_as_greedy(trained):
    backbone, head, vocab = trained
    gen = torch.Generator().manual_seed(1)
    source = torch.randint(1, vocab, (12, 5), generator=gen)
    padding = torch.zeros_like(source, dtype=torch.bool)
    config = DecodeConfig(length_penalty=0.0)
    greedy = greedy_decode(backbone, head, source, padding, config, 0, 0)
    beam = beam_search(backbone, head, source, padding, config, 0, 0, beam_size=4)
    gains = []
    for i in range(source.size(0)):
        g = rescore(backbone, head, source[i], padding[i], greedy[i], 0, 0)
        b = rescore(backbone, head, source[i], padding[i], beam[i], 0, 0)
        assert b >= g - 1e-5, (i, greedy[i], beam[i], g, b)
        gains.append(b - g)
    assert max(gains) > 1e-3  # beam found a strictly better sequence somewhere


def test_beam_uses_the_heads_topk_fast_path(trained, monkeypatch):
    backbone, head, vocab = trained
    source = torch.randint(1, vocab, (3, 5))
    padding = torch.zeros_like(source, dtype=torch.bool)
    calls = {"topk": 0}

    def counting_topk(hidden, k):
        calls["topk"] += 1
        return SoftmaxHead.log_prob(head, hidden).topk(k, dim=-1)

    def no_log_prob(hidden):
        raise AssertionError("log_prob is only for forced <eos> at the maximum length")

    monkeypatch.setattr(head, "topk", counting_topk)
    monkeypatch.setattr(head, "log_prob", no_log_prob)
    config = DecodeConfig(max_length_b=30, length_penalty=0.0)
    beam_search(backbone, head, source, padding, config, 0, 0, beam_size=3)
    assert calls["topk"] > 0


def after_2_only_3(
    log_probs: torch.Tensor, previous: torch.Tensor, closing: torch.Tensor
) -> torch.Tensor:
    """A toy grammar over 4 tokens (0 = <eos>): after 2 only 3; 2 never ends a sentence, so
    it may not be the last token before a forced <eos> (``closing``)."""
    allowed = torch.ones_like(log_probs, dtype=torch.bool)
    allowed[previous == 2] = torch.tensor([False, False, False, True])
    allowed[closing, 2] = False
    return log_probs.masked_fill(~allowed, float("-inf"))


def obeys(hypothesis: list[int]) -> bool:
    sequence = [*hypothesis, 0]  # with its <eos>
    return all(b == 3 for a, b in zip(sequence, sequence[1:], strict=False) if a == 2)


def test_a_restricted_beam_finds_the_best_hypothesis_the_grammar_allows():
    """A coded target (Hybrid-LightRNN) decodes under its grammar: exhaustive under it with a
    wide beam, the greedy choice among the allowed tokens, and a different answer than the
    unrestricted search where the model prefers a forbidden pair."""
    vocab, eos = 4, 0
    backbone, head = make(6, vocab, seed=0)
    source, padding = sources(6, seed=0)
    config = DecodeConfig(max_length_a=0.0, max_length_b=3, length_penalty=0.0)
    found = beam_search(backbone, head, source, padding, config, eos, eos, beam_size=16,
                        restrict=after_2_only_3)  # fmt: skip
    free = beam_search(backbone, head, source, padding, config, eos, eos, beam_size=16)
    assert any(not obeys(h) for h in free)  # the grammar changes some answers
    for i in range(source.size(0)):
        candidates = [
            list(h)
            for n in range(3)
            for h in itertools.product(range(1, vocab), repeat=n)
            if obeys(list(h))
        ]
        scored = {tuple(h): rescore(backbone, head, source[i], padding[i], h, eos, eos)
                  for h in candidates}  # fmt: skip
        assert scored[tuple(found[i])] == pytest.approx(max(scored.values()), abs=1e-5)
    greedy = greedy_decode(backbone, head, source, padding, config, eos, eos, after_2_only_3)
    assert greedy == beam_search(backbone, head, source, padding, config, eos, eos,
                                 beam_size=1, restrict=after_2_only_3)  # fmt: skip
    # at the length limit too: no 2 before the forced <eos> (a row code, then a broken pair)
    assert all(obeys(h) for h in greedy) and all(obeys(h) for h in found)
    assert any(len(h) == 2 for h in greedy)  # some reached the limit: the check has teeth


def test_a_head_without_eos_probability_still_ends_at_the_limit():
    """A DS-Softmax expert may hold no ``<eos>`` (log-prob -inf): the forced ``<eos>`` at the
    length limit then costs 0, so that every sentence still gets its best hypothesis (beam
    search returned none where every beam reached the limit) and greedy is beam size 1."""
    vocab, eos = 5, 0
    backbone, head = make(6, vocab, seed=1)
    source, padding = sources(6, seed=1)
    plain_log_prob = head.log_prob

    def no_eos(hidden):
        return plain_log_prob(hidden).index_fill(-1, torch.tensor([eos]), float("-inf"))

    head.log_prob = no_eos
    head.topk = lambda hidden, k: no_eos(hidden).topk(k, dim=-1)
    config = DecodeConfig(max_length_a=0.0, max_length_b=3, length_penalty=0.0)
    greedy = greedy_decode(backbone, head, source, padding, config, eos, eos)
    # beam 4: every first token of the 4 kept, so the search is exhaustive over 2 tokens
    found = beam_search(backbone, head, source, padding, config, eos, eos, beam_size=4)
    assert all(len(h) == 2 for h in greedy + found)
    assert greedy == beam_search(backbone, head, source, padding, config, eos, eos,
                                 beam_size=1)  # fmt: skip

    @torch.no_grad()
    def score(i: int, hypothesis: tuple[int, ...]) -> float:  # its tokens', <eos> costs 0
        decoder_input = torch.tensor([[eos, *hypothesis[:-1]]])
        hidden = backbone(source[i][None], padding[i][None], decoder_input)[0]
        return float(no_eos(hidden).gather(1, torch.tensor(hypothesis)[:, None]).sum())

    for i, hypothesis in enumerate(found):
        best = max(itertools.product(range(1, vocab), repeat=2), key=lambda h: score(i, h))
        assert tuple(hypothesis) == best


def test_hypotheses_may_outgrow_the_position_table():
    """The length limit is a * |x| + b alone: a backbone whose precomputed table holds 2
    positions searches as one whose table holds them all (it extends its sine/cosine
    positions), and no hypothesis is cut at the table's size."""
    backbone, head = make(9, 7)
    small = Seq2SeqTransformer(9, 7, model_size=D, num_heads=2, encoder_layers=1,
                               decoder_layers=1, feedforward_size=32, dropout=0.0,
                               max_length=2)  # fmt: skip
    small.load_state_dict(backbone.state_dict())
    small.eval()
    source, padding = sources(9)
    config = DecodeConfig(max_length_a=1.0, max_length_b=4, length_penalty=0.6)
    greedy = greedy_decode(small, head, source, padding, config, 0, 0)
    assert greedy == greedy_decode(backbone, head, source, padding, config, 0, 0)
    assert max(len(g) for g in greedy) >= 2  # past the small table (<eos> not counted)
    beams = beam_search(small, head, source, padding, config, 0, 0, beam_size=3)
    assert beams == beam_search(backbone, head, source, padding, config, 0, 0, beam_size=3)


@pytest.mark.parametrize("beam_size", [None, 1, 3])  # None: greedy_decode
def test_decoding_reads_back_once_a_step(beam_size, monkeypatch):
    """On a GPU every read-back waits for the queued step: a step may read back once (its
    tokens, or the beams' candidates in one tensor), plus the length limits once a batch. No
    boolean-mask indexing, ``bool(tensor)`` or read-back of the prefixes; the few host-to-device
    copies are of the host's own decisions (rows that end or go on), once the step is read."""
    from tests.lightning_modules.test_host_sync import SyncSentinel

    backbone, head = make(9, 7, seed=0)
    source, padding = sources(9, seed=0)
    config = DecodeConfig(max_length_a=1.0, max_length_b=4, length_penalty=0.6)
    steps = []
    decode_step = backbone.decode_step
    monkeypatch.setattr(backbone, "decode_step", lambda *a: steps.append(1) or decode_step(*a))
    sentinel = SyncSentinel()
    with sentinel.installed(monkeypatch):
        sentinel.active = True
        if beam_size is None:
            greedy_decode(backbone, head, source, padding, config, 0, 0)
        else:
            beam_search(backbone, head, source, padding, config, 0, 0, beam_size=beam_size)
        sentinel.active = False
    names = [name for name, _ in sentinel.calls]
    assert len(steps) >= 5  # several steps, some sentences ending before others
    assert names.count("tolist") == len(steps) + 1, sentinel.calls
    copies = names.count("torch.tensor(..., device=)")
    assert copies <= 2 * len(steps) and len(names) == len(steps) + 1 + copies, sentinel.calls
