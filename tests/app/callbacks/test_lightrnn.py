import contextlib
import math
import random
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch

from app.callbacks import LightRNNTableReassignment, ModelCheckpoint, lightrnn
from app.callbacks.lightrnn import eq6_costs, eq6_costs_translation, word_of_each_code
from datamodules import LanguageModelingDataModule, TranslationDataModule
from datamodules.bptt import BPTTBatches
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from datamodules.vocab.table_assignment import objective
from heads import SoftmaxHead
from lightning_modules import LanguageModel, Translation
from lightning_modules.backbones import LSTMBackbone, Seq2SeqTransformer

K, ROWS, COLS = 6, 6, 6


pytestmark = pytest.mark.usefixtures("one_thread_per_module")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A Markov chain over 30 words: each word has a likely successor, so a model learns."""
    rng = random.Random(0)
    folder = tmp_path_factory.mktemp("markov")
    nxt = {i: (7 * i + 3) % 30 for i in range(30)}
    for split, lines in (("train", 300), ("valid", 30), ("test", 30)):
        text = []
        for _ in range(lines):
            w, words = rng.randrange(30), []
            for _ in range(rng.randint(4, 10)):
                words.append(f"w{w}")
                w = nxt[w] if rng.random() < 0.8 else rng.randrange(30)
            text.append(" ".join(words))
        (folder / f"m.{split}.txt").write_text("\n".join(text) + "\n")
    return str(folder)


def make(corpus: str, **data_options):
    options = dict(vocab="hybrid_lightrnn", lightrnn_frequent=K, lightrnn_rows=ROWS,
                   lightrnn_cols=COLS, lightrnn_init="random", batch_size=8, bptt=10)  # fmt: skip
    data = LanguageModelingDataModule(path=corpus, **(options | data_options))
    torch.manual_seed(0)
    backbone = LSTMBackbone(data.vocab_size, 16, 16, num_layers=1, input_dropout=0.0,
                            hidden_dropout=0.0, output_dropout=0.0)  # fmt: skip
    model = LanguageModel(
        backbone, SoftmaxHead(16, data.vocab_size), optimizer=lambda p: torch.optim.Adam(p, 1e-2)
    )
    return data, model


def trainer(epochs: int, **options) -> L.Trainer:
    defaults = dict(accelerator="cpu", logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    return L.Trainer(max_epochs=epochs, **(defaults | options))


def slow_costs(model, vocab: HybridLightRNNVocab, codes: torch.Tensor, bptt: int):
    """Plain reference for Eq. 6: one stream, position by position."""
    row = np.zeros((vocab.num_rare, vocab.rows))
    col = np.zeros((vocab.num_rare, vocab.cols))
    model.eval()
    state, log_probs = None, []
    with torch.no_grad():
        for x, _ in BPTTBatches(codes, 1, bptt):
            hidden, state = model.backbone(x, state)
            log_probs += list(model.head.log_prob(hidden[0]))
    seq = codes.tolist()
    row_of = {int(code): r for r, code in enumerate(vocab.row_codes)}
    col_of = {int(code): c for c, code in enumerate(vocab.col_codes)}
    for k in range(len(seq) - 1):  # log_probs[k] predicts seq[k + 1]
        code = seq[k + 1]
        if code in row_of:  # first code of a rare word: the word is read off the table
            word = int(vocab.table()[row_of[code], col_of[seq[k + 2]]])
            row[word - K] -= log_probs[k][vocab.row_codes].numpy()
        elif code in col_of:
            word = int(vocab.table()[row_of[seq[k]], col_of[code]])
            col[word - K] -= log_probs[k][vocab.col_codes].numpy()
    return row, col


def test_eq6_costs_match_a_plain_reference(corpus):
    data, model = make(corpus)
    codes = data.split_tokens("valid")
    vocab = data.vocab
    row, col = eq6_costs(model, vocab, codes, batch_size=1, bptt=10)
    ref_row, ref_col = slow_costs(model, vocab, codes, bptt=10)
    np.testing.assert_allclose(row.numpy(), ref_row, rtol=1e-5)
    np.testing.assert_allclose(col.numpy(), ref_col, rtol=1e-5)
    # Eq. 6 at the current table = the model's NLL of the rare words' codes (paper, after
    # Eq. 6), here recomputed from the code log-probabilities directly
    words = word_of_each_code(vocab, codes)
    assert torch.equal(vocab.encode_word_ids(words[vocab.word_start_mask[codes]]), codes)
    nll = 0.0
    model.eval()
    with torch.no_grad():
        hidden, _ = model.backbone(codes[:-1].unsqueeze(0))
        lp = model.head.log_prob(hidden[0]).gather(1, codes[1:, None]).squeeze(1)
    nll = -lp[vocab.layout_of_code[codes[1:]] >= K].sum().item()
    assert objective(row, col, vocab.cells) == pytest.approx(nll, rel=1e-5)


def test_reassignment_during_training(corpus, caplog):
    data, model = make(corpus)
    callback = LightRNNTableReassignment(every_n_epochs=1, batch_size=4)
    history = []

    class Spy(L.Callback):  # records each re-assignment (runs after the callback)
        def on_train_epoch_start(self, trainer, pl_module):
            callback.last, callback.last_cells = {}, None

        def on_train_epoch_end(self, trainer, pl_module):
            history.append((dict(callback.last), callback.last_cells))

    initial = data.vocab.cells.clone()
    fit = trainer(3, callbacks=[callback, Spy()])
    fit.fit(model, data)
    # re-assigned after epochs 1 and 2, not after the last one
    moves = [h for h in history if h[0]]
    assert len(moves) == 2  # after epochs 1 and 2
    for stats, cells in moves:
        assert stats["lightrnn/objective_after"] <= stats["lightrnn/objective_before"] + 1e-9
        assert stats["lightrnn/lower_bound"] <= stats["lightrnn/objective_after"] + 1e-9
        assert 0 <= stats["lightrnn/moved"] <= 1
        assert len(set(cells.tolist())) == data.vocab.num_rare  # a bijection
    assert not torch.equal(data.vocab.cells, initial)  # a trained model moves words
    assert torch.equal(data.vocab.cells, moves[-1][1])  # installed for the last epoch
    # the data follows the table: the stream is the encoding of the words with the new table
    words = data.split_word_ids("train")
    assert torch.equal(data.split_tokens("train"), data.vocab.encode_word_ids(words))
    x, _ = next(iter(data.train_dataloader()))
    assert torch.equal(x[0], data.split_tokens("train")[: x.size(1)])
    assert "val/word_ppl" in fit.callback_metrics
    assert math.isfinite(fit.callback_metrics["val/word_ppl"])
    # each re-assignment says what it did in one line
    lines = [r.getMessage() for r in caplog.records if "table re-learnt" in r.getMessage()]
    assert [line.split(" in ")[0] for line in lines] == [
        f"Hybrid-LightRNN table re-learnt after epoch {epoch}" for epoch in (0, 1)
    ]
    assert f"{moves[-1][0]['lightrnn/moved']:.1%} of the rare words moved" in lines[-1]


@pytest.mark.parametrize(("max_epochs", "relearnt_after"), [(3, [1, 2]), (-1, [1, 2, 3]),
                                                          (None, [1, 2, 3])])  # fmt: skip
def test_the_table_is_re_learnt_after_every_epoch_but_a_known_last(max_epochs, relearnt_after):
    """``max_epochs: -1`` (a run bounded by steps or time) has no known last epoch: every
    epoch's end re-learns the table (-1 once read as 'every epoch is the last')."""
    callback = LightRNNTableReassignment()
    after = []
    callback.reassign_now = lambda trainer, module: after.append(trainer.current_epoch + 1)
    for epoch in range(3):
        trainer = SimpleNamespace(current_epoch=epoch, max_epochs=max_epochs, should_stop=False)
        callback.on_train_epoch_end(trainer, None)
    assert after == relearnt_after


def test_words_outside_the_scored_sample_keep_their_cells(corpus):
    data, model = make(corpus)
    callback = LightRNNTableReassignment(max_batches=1, batch_size=2)
    before = data.vocab.cells.clone()
    words = word_of_each_code(data.vocab, data.split_tokens("train"))
    _, targets = next(iter(BPTTBatches(words, 2, data.hparams.bptt)))  # the scored window
    seen = set(targets.flatten().tolist())
    trainer(2, callbacks=[callback]).fit(model, data)  # one re-assignment, after epoch 1
    unseen = [i for i in range(data.vocab.num_rare) if K + i not in seen]
    assert unseen and all(data.vocab.cells[i] == before[i] for i in unseen)
    assert callback.last["lightrnn/seen"] == pytest.approx(1 - len(unseen) / data.vocab.num_rare)


def test_a_resumed_run_continues_with_the_saved_table(corpus, tmp_path):
    data, model = make(corpus)
    callback = LightRNNTableReassignment(batch_size=4)
    fit = trainer(2, callbacks=[callback], enable_checkpointing=True,
                  default_root_dir=tmp_path)  # fmt: skip
    fit.fit(model, data)
    learnt = data.vocab.cells.clone()
    ckpt = tmp_path / "resumable.ckpt"
    fit.save_checkpoint(ckpt)
    # a fresh process: the data module rebuilds the initial table, the checkpoint restores
    data2, model2 = make(corpus)
    assert not torch.equal(data2.vocab.cells, learnt)
    resumed = trainer(2, enable_checkpointing=False, default_root_dir=tmp_path)
    resumed.validate(model2, data2, ckpt_path=ckpt)
    assert torch.equal(data2.vocab.cells, learnt)
    assert torch.equal(data2.split_tokens("valid"), data2.vocab.encode_word_ids(
        data2.split_word_ids("valid")))  # fmt: skip


def test_resuming_from_an_epoch_end_checkpoint_uses_the_scheduled_table(corpus, tmp_path):
    data, model = make(corpus)
    callback = LightRNNTableReassignment(batch_size=4)
    every_epoch = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    trainer(2, callbacks=[callback, every_epoch], enable_checkpointing=True).fit(model, data)
    scheduled = callback.last_cells  # re-assigned after epoch 1, trained with in epoch 2
    assert torch.equal(data.vocab.cells, scheduled)
    (first,) = tmp_path.glob("epoch=0-*.ckpt")
    state = torch.load(first, weights_only=False)["LanguageModelingDataModule"]
    assert state["vocab"]["scheduled_cells"] == scheduled.tolist()
    # validate that checkpoint: the table its weights were trained with (the initial one)
    data2, model2 = make(corpus)
    initial = data2.vocab.cells.clone()
    trainer(2).validate(model2, data2, ckpt_path=first, verbose=False)
    assert torch.equal(data2.vocab.cells, initial)
    # resume it: epoch 2 trains with the scheduled table, as the uninterrupted run did
    data3, model3 = make(corpus)
    trainer(2, callbacks=[LightRNNTableReassignment(batch_size=4)]).fit(
        model3, data3, ckpt_path=first
    )
    assert torch.equal(data3.vocab.cells, scheduled)


def test_a_fit_resumed_with_more_epochs_re_learns_the_table_its_last_epoch_skipped(
    corpus, tmp_path
):
    """A 2-epoch fit re-learns no table after its last epoch; resumed from that epoch's
    checkpoint with a third, it re-learns it as it starts, as a 3-epoch fit did after epoch
    2: the third epoch trains with the same table (it trained with the first one's)."""
    data, model = make(corpus)
    whole = LightRNNTableReassignment(batch_size=4)
    trainer(3, callbacks=[whole]).fit(model, data)

    data2, model2 = make(corpus)
    last = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)  # at each epoch end
    first = LightRNNTableReassignment(batch_size=4)
    trainer(2, callbacks=[first, last], enable_checkpointing=True).fit(model2, data2)
    data3, model3 = make(corpus)
    resumed = LightRNNTableReassignment(batch_size=4)
    trainer(3, callbacks=[resumed]).fit(model3, data3, ckpt_path=tmp_path / "last.ckpt")
    assert torch.equal(data3.vocab.cells, data.vocab.cells)
    assert torch.equal(resumed.last_cells, whole.last_cells)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(model3.state_dict()[name], value, msg=name)
    # (0-based) after epochs 0 and 1 in both; the 2-epoch fit skipped 1, its last
    assert (whole.relearnt_after, first.relearnt_after, resumed.relearnt_after) == (1, 0, 1)


def test_needs_a_lightrnn_vocabulary(corpus):
    data, model = make(corpus, vocab="word")
    with pytest.raises(ValueError, match="hybrid_lightrnn"):
        trainer(1, callbacks=[LightRNNTableReassignment()]).fit(model, data)


@pytest.fixture(scope="module")
def parallel(tmp_path_factory) -> str:
    """Word-for-word pairs over 30 target words (word i appears more often for small i)."""
    rng = random.Random(1)
    folder = tmp_path_factory.mktemp("pairs")
    for prefix, lines in (("train", 120), ("val", 12), ("test_2016_flickr", 12)):
        pairs = []
        for _ in range(lines):
            words = [min(int(rng.expovariate(0.12)), 29) for _ in range(rng.randint(3, 8))]
            pairs.append((" ".join(f"s{w}" for w in words), " ".join(f"w{w}" for w in words)))
        (folder / f"{prefix}.de").write_text("".join(f"{s}\n" for s, _ in pairs))
        (folder / f"{prefix}.en").write_text("".join(f"{t}\n" for _, t in pairs))
    return str(folder)


def make_translation(path: str, **data_options):
    options = dict(vocab="hybrid_lightrnn", lightrnn_frequent=K, lightrnn_rows=ROWS,
                   lightrnn_cols=COLS, lightrnn_init="random", max_tokens=200)  # fmt: skip
    data = TranslationDataModule(path=path, **(options | data_options))
    torch.manual_seed(0)
    backbone = Seq2SeqTransformer(data.src_vocab_size, data.vocab_size, model_size=16,
                                  num_heads=2, encoder_layers=1, decoder_layers=1,
                                  feedforward_size=32, dropout=0.0)  # fmt: skip
    model = Translation(backbone, SoftmaxHead(16, data.vocab_size),
                        optimizer=lambda p: torch.optim.Adam(p, 1e-2))  # fmt: skip
    return data, model


def test_translation_eq6_costs_match_a_plain_reference(parallel):
    """The translation cost: each reference scored alone, code by code, from the full
    log-probabilities with the source and the reference before it as context."""
    data, model = make_translation(parallel)
    vocab = data.target_vocab
    model.train()
    row, col = eq6_costs_translation(model, vocab, data.table_scoring_dataloader())
    assert model.training and not row.requires_grad  # scored in eval mode, then restored
    ref_row, ref_col = np.zeros((vocab.num_rare, ROWS)), np.zeros((vocab.num_rare, COLS))
    row_of = {int(code): r for r, code in enumerate(vocab.row_codes)}
    col_of = {int(code): c for c, code in enumerate(vocab.col_codes)}
    pairs = data.encoded("train")
    model.eval()
    for i in range(len(pairs)):
        source, target = (torch.as_tensor(pairs[i][key], dtype=torch.long)
                          for key in ("source_ids", "target_ids"))  # fmt: skip
        target_input = torch.cat((torch.tensor([data.bos_id]), target[:-1]))
        with torch.no_grad():
            hidden = model.backbone(source[None], torch.zeros(1, len(source), dtype=torch.bool),
                                    target_input[None])[0]  # fmt: skip
            log_probs = model.head.log_prob(hidden)
        seq = target.tolist()
        for k, code in enumerate(seq):  # log_probs[k] predicts seq[k]
            if code in row_of:
                word = int(vocab.table()[row_of[code], col_of[seq[k + 1]]])
                ref_row[word - K] -= log_probs[k][vocab.row_codes].numpy()
            elif code in col_of:
                word = int(vocab.table()[row_of[seq[k - 1]], col_of[code]])
                ref_col[word - K] -= log_probs[k][vocab.col_codes].numpy()
    assert ref_row.any() and ref_col.any()
    np.testing.assert_allclose(row.numpy(), ref_row, rtol=1e-5)
    np.testing.assert_allclose(col.numpy(), ref_col, rtol=1e-5)


def test_a_translation_s_target_table_is_re_learnt_and_its_codes_follow(parallel, tmp_path):
    data, model = make_translation(parallel)
    callback = LightRNNTableReassignment(every_n_epochs=1)
    initial = data.target_vocab.cells.clone()
    every_epoch = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_top_k=-1)
    trainer(3, callbacks=[callback, every_epoch], enable_checkpointing=True,
            num_sanity_val_steps=0).fit(model, data)  # fmt: skip
    vocab = data.target_vocab
    assert callback.last["lightrnn/objective_after"] <= callback.last["lightrnn/objective_before"]
    assert callback.last["lightrnn/moved"] > 0 and not torch.equal(vocab.cells, initial)
    assert torch.equal(vocab.cells, callback.last_cells)  # installed for the last epoch
    # every split's codes, also in the datasets the loaders hold, follow the installed table
    for split in ("train", "valid"):
        pairs = data.encoded(split)
        for i in range(len(pairs)):
            words = data.target_vocab.words.encode_line(data.references(split)[int(pairs.index[i])])
            assert pairs[i]["target_ids"].tolist() == vocab.encode_word_ids(
                torch.tensor(words)).tolist()  # fmt: skip
    # a fresh data module restores the table from a checkpoint, and its codes follow it
    (second,) = tmp_path.glob("epoch=1-*.ckpt")
    data2, model2 = make_translation(parallel)
    assert torch.equal(data2.target_vocab.cells, initial)
    data2.encoded("valid")  # coded with the initial table before the checkpoint is read
    trainer(3).validate(model2, data2, ckpt_path=second, verbose=False)
    saved = torch.load(second, weights_only=False)["TranslationDataModule"]["target_vocab"]
    assert data2.target_vocab.cells.tolist() == saved["cells"]
    first = data2.encoded("valid")[0]
    line = data2.references("valid")[int(data2.encoded("valid").index[0])]
    assert first["target_ids"].tolist() == data2.target_vocab.encode_line(line)


@pytest.fixture
def bars(monkeypatch) -> list[tuple[str, int, int]]:
    """``(description, total, steps advanced)`` of each progress bar the callback opens."""
    opened = []

    @contextlib.contextmanager
    def recorded(trainer, description, total):
        steps = []
        yield lambda: steps.append(1)
        opened.append((description, total, len(steps)))

    monkeypatch.setattr(lightrnn, "side_progress", recorded)
    return opened


@pytest.mark.parametrize("max_batches", [None, 3])
def test_the_scoring_pass_is_a_bar_over_its_batches(corpus, parallel, bars, max_batches):
    data, model = make(corpus)
    callback = LightRNNTableReassignment(batch_size=4, max_batches=max_batches)
    trainer(2, callbacks=[callback]).fit(model, data)
    total = max_batches or len(BPTTBatches(data.split_tokens("train"), 4, data.hparams.bptt))
    assert bars == [
        (f"Hybrid-LightRNN table: scoring (Eq. 6) {total} training batches",) + (total,) * 2
    ]
    bars.clear()
    data, model = make_translation(parallel)
    trainer(2, callbacks=[LightRNNTableReassignment(max_batches=max_batches)]).fit(model, data)
    total = max_batches or len(data.table_scoring_dataloader())
    assert [bar[1:] for bar in bars] == [(total, total)] and total > 1


def test_a_translation_over_words_is_refused_in_one_line(parallel):
    data, model = make_translation(parallel, vocab="word")
    with pytest.raises(ValueError, match="needs data.vocab=hybrid_lightrnn .*target vocabulary"):
        trainer(1, callbacks=[LightRNNTableReassignment()]).fit(model, data)


@pytest.mark.slow
def test_cli_fit_then_test_restores_the_learnt_table(ptb_path, tmp_path, monkeypatch):
    """End to end through cli.py with the shipped config (small sizes, a few batches)."""
    import sys

    from cli import main

    monkeypatch.setattr(sys, "argv", ["cli.py"])
    common = ["--config", "configs/lm/ptb_lightrnn.yaml", "--data.init_args.path",
              ptb_path, "--trainer.default_root_dir", str(tmp_path),
              "--model.init_args.backbone.init_args.embedding_size", "16",
              "--model.init_args.backbone.init_args.hidden_size", "16",
              "--trainer.enable_progress_bar", "false"]  # fmt: skip
    fit = main(["fit", *common, "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "5",
                "--trainer.limit_val_batches", "3", "--trainer.callbacks.max_batches", "3",
                "--trainer.logger.init_args.save_dir", str(tmp_path)])  # fmt: skip
    (callback,) = [c for c in fit.trainer.callbacks if isinstance(c, LightRNNTableReassignment)]
    assert callback.max_batches == 3
    assert fit.trainer.callback_metrics["lightrnn/moved"] > 0
    assert "val/word_ppl" in fit.trainer.callback_metrics
    learnt = fit.datamodule.vocab.cells
    ckpt = str(next(tmp_path.rglob("last.ckpt")))
    test = main(["test", *common, "--ckpt_path", ckpt, "--trainer.limit_test_batches", "3",
                 "--trainer.logger", "false"])  # fmt: skip
    assert torch.equal(test.datamodule.vocab.cells, learnt)
    assert math.isfinite(test.trainer.callback_metrics["test/word_ppl"])


def test_the_scoring_streams_split_evenly_over_any_number_of_ranks(corpus, monkeypatch):
    """The scoring pass's 64 streams (``batch_size``) on 3 ranks raised after the first epoch
    (``BPTTBatches`` splits streams evenly): rounded up to 66, rank 0 scores its 22. Here one
    process plays rank 0 of 3; its costs are those of a plain call with 6 streams (4 rounded
    up), its share of them."""
    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: 3))
    data, model = make(corpus, batch_size=6, eval_batch_size=6)
    callback = LightRNNTableReassignment(batch_size=4)
    expected = []

    class Reference(L.Callback):  # after the callback: the table it scored is still installed
        def on_train_epoch_end(self, trainer, pl_module):
            if callback.last:
                codes, vocab = data.split_tokens("train"), data.vocab
                row, col = eq6_costs(pl_module, vocab, codes, 6, data.hparams.bptt, None, 0, 3)
                expected.append(objective(row, col, vocab.cells))

    trainer(2, callbacks=[callback, Reference()]).fit(model, data)
    assert callback.relearnt_after == 0
    assert callback.last["lightrnn/objective_before"] == pytest.approx(expected[0], rel=1e-9)
    assert lightrnn.scoring_streams(64, 10_000, 3) == 66
    assert lightrnn.scoring_streams(64, 40, 3) == 18  # 2 codes a stream at least


@pytest.mark.parametrize("max_batches", [0, -1])
def test_a_max_batches_that_scores_nothing_is_refused(max_batches):
    """0 scored no batch: every rare word looked unseen and the table silently never moved."""
    with pytest.raises(ValueError, match="max_batches must be positive"):
        LightRNNTableReassignment(max_batches=max_batches)


def test_no_table_is_re_learnt_at_the_max_steps_stop(corpus, caplog):
    """``trainer.max_steps`` ends the fit inside an epoch, whose end hooks then run: the table
    re-learnt there (a whole scoring pass and solve) was never trained on, and a fit resumed
    with more steps continues that epoch from a last.ckpt written before it."""
    data, model = make(corpus)
    per_epoch = len(data.train_dataloader())
    callback = LightRNNTableReassignment(batch_size=4)
    trainer(-1, max_steps=per_epoch + 2, callbacks=[callback]).fit(model, data)
    lines = [r.getMessage() for r in caplog.records if "table re-learnt" in r.getMessage()]
    assert [line.split(" in ")[0] for line in lines] == [
        "Hybrid-LightRNN table re-learnt after epoch 0"
    ]
    assert callback.relearnt_after == 0 and data.vocab.scheduled_cells is None
