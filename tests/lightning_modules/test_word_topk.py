import pytest
import torch

from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from lightning_modules.word_topk import top_words

CORPUS = [" ".join(f"w{i}" for i in range(30) if i <= j) for j in range(30)]


def model(vocab: HybridLightRNNVocab, sharpness: float):
    """Next-code log-probabilities, and after each row code its own (seeded by the code)."""
    first = sharpness * torch.randn(len(vocab), generator=torch.Generator().manual_seed(0))
    calls = []

    def after(code: int) -> torch.Tensor:
        calls.append(code)
        generator = torch.Generator().manual_seed(100 + code)
        return (sharpness * torch.randn(len(vocab), generator=generator)).log_softmax(-1)

    return first.log_softmax(-1), after, calls


def every_word(vocab: HybridLightRNNVocab, log_probs, after) -> dict[int, float]:
    """Plainly: each frequent word its code's log-probability, each rare word its row's plus
    its column's after that row."""
    scores = {}
    for word in range(len(vocab.words)):
        codes = vocab.word_codes[word].tolist()
        if codes[1] < 0:
            scores[word] = float(log_probs[codes[0]])
        else:
            scores[word] = float(log_probs[codes[0]] + after(codes[0])[codes[1]])
    return scores


@pytest.mark.parametrize("sharpness", [0.5, 3.0])
@pytest.mark.parametrize("k", [1, 5, 40])
def test_the_top_words_are_those_of_a_plain_enumeration(sharpness, k):
    vocab = HybridLightRNNVocab.build(CORPUS, num_frequent=5, rows=4, cols=8, init="random")
    log_probs, after, calls = model(vocab, sharpness)
    found = top_words(log_probs, after, vocab, k)
    scores = every_word(vocab, log_probs, model(vocab, sharpness)[1])
    expected = sorted(scores.items(), key=lambda item: -item[1])[:k]
    assert [w for _, w in found] == [w for w, _ in expected]
    assert [lp for lp, _ in found] == pytest.approx([lp for _, lp in expected], abs=1e-6)
    assert len(calls) == len(set(calls)) <= vocab.rows  # each row read once at most
    if k == 1 and sharpness == 3.0:
        assert len(calls) < vocab.rows  # the bound skipped rows that could not win
