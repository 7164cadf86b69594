import pytest
import torch

from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab

# word i appears 30 - i times; 27 rare words in a 4 x 8 table: 5 cells stay empty
CORPUS = [" ".join(f"w{i}" for i in range(30) if i <= j) for j in range(30)]


@pytest.fixture(params=["frequency", "random"])
def vocab(request) -> HybridLightRNNVocab:
    return HybridLightRNNVocab.build(CORPUS, num_frequent=5, rows=4, cols=8, init=request.param)


def plainly_allowed(vocab: HybridLightRNNVocab, previous: int, code: int) -> bool:
    """The rule read off the code names and the table: after a row, a column of a cell that
    holds a word; elsewhere, a word's own code or a row holding a word."""
    name, after = vocab.itos[previous], vocab.itos[code]
    table = vocab.table()
    if name.startswith("<row"):
        row = int(name[4:-1])
        return after.startswith("<col") and bool(table[row, int(after[4:-1])] >= 0)
    if after.startswith("<col"):
        return False
    if after.startswith("<row"):
        return bool((table[int(after[4:-1])] >= 0).any())
    return True


def test_the_masks_are_the_plain_rule(vocab):
    grammar = vocab.grammar()
    previous = torch.arange(len(vocab))
    allowed = grammar.allowed_after(previous)  # [V, V], all pairs at once
    for p in range(len(vocab)):
        for c in range(len(vocab)):
            assert bool(allowed[p, c]) == plainly_allowed(vocab, p, c), (vocab.itos[p], c)
    assert not allowed[vocab.row_codes[3]].all()  # row 3 has empty cells: the check has teeth


def test_every_allowed_walk_decodes_to_words_and_back(vocab):
    """A code stream drawn under the grammar always decodes to real words (no <unk> from a
    broken pair) and encodes back to itself."""
    grammar = vocab.grammar()
    generator = torch.Generator().manual_seed(0)
    previous = torch.tensor(vocab.eos_id)
    codes = []
    for _ in range(2000):
        choices = grammar.allowed_after(previous).nonzero().flatten()
        previous = choices[torch.randint(len(choices), (), generator=generator)]
        codes.append(int(previous))
    while grammar.is_row[codes[-1]]:  # end on a whole word
        codes.pop()
    words = vocab.decode_word_ids(codes)  # a broken pair would decode to <unk>, coded otherwise
    assert vocab.encode_word_ids(torch.tensor(words)).tolist() == codes
    assert sum(1 for c in codes if grammar.is_row[c]) > 100  # rare words drawn too


def test_restrict_masks_and_keeps_a_choice(vocab):
    grammar = vocab.grammar()
    row = vocab.row_codes[:1]
    log_probs = torch.randn(1, len(vocab)).log_softmax(-1)
    kept = grammar.restrict(log_probs, row)
    allowed = grammar.allowed_after(row)
    assert torch.equal(kept[allowed], log_probs[allowed])  # not renormalised
    assert kept[~allowed].isneginf().all()
    # a distribution with no mass on any allowed code (a DS-Softmax expert) keeps them all
    none = log_probs.masked_fill(allowed, float("-inf"))
    assert torch.equal(grammar.restrict(none, row).isfinite(), allowed)
    # ... but a search lets that hypothesis end: nothing allowed costs nothing
    assert grammar.restrict(none, row, fallback=False).isneginf().all()


def test_the_last_code_before_a_forced_eos_ends_a_word(vocab):
    grammar = vocab.grammar()
    log_probs = torch.randn(3, len(vocab)).log_softmax(-1)
    previous = torch.cat((vocab.row_codes[:1], torch.tensor([vocab.eos_id, vocab.eos_id])))
    closing = torch.tensor([True, True, False])
    kept = grammar.restrict(log_probs, previous, closing).isfinite()
    # after a row, its columns (they end the word); after a word, no row code when closing
    assert torch.equal(kept[0], grammar.allowed_after(previous[:1])[0])
    assert not kept[1, grammar.is_row].any() and kept[1, ~grammar.is_row].any()
    assert torch.equal(kept[1], grammar.word_start & ~grammar.is_row)
    assert kept[2, grammar.is_row].any()


def test_the_grammar_follows_the_installed_table(vocab):
    first = vocab.grammar()
    assert vocab.grammar() is first  # kept while the table stands
    cells = torch.randperm(vocab.rows * vocab.cols, generator=torch.Generator().manual_seed(1))
    vocab.set_cells(cells[: vocab.num_rare])
    second = vocab.grammar()
    assert second is not first
    assert torch.equal(second.columns, vocab.grammar().columns)
    occupied = (vocab.table() >= 0).tolist()
    for r in range(vocab.rows):
        for c in range(vocab.cols):
            assert bool(second.columns[r, vocab.col_codes[c]]) == occupied[r][c]
