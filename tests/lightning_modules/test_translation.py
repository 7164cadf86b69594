import importlib.util
from collections.abc import Callable

import lightning as L
import pytest
import sacrebleu
import torch

from datamodules import TranslationDataModule
from datamodules.pair_batches import collate_pairs
from heads import DSSoftmaxHead, MixtapeHead, MoSHead, SoftmaxHead
from lightning_modules import Translation
from lightning_modules.backbones import Seq2SeqTransformer
from lightning_modules.decoding import DecodeConfig, greedy_decode
from lightning_modules.errors import ModelConfigError
from lightning_modules.static_rows import padded_rows
from tests.datamodules.test_translation import TINY, write_corpus

D = 16


@pytest.fixture()
def data(tmp_path) -> TranslationDataModule:
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY[:5], "test_2016_flickr": TINY[:4]})
    return TranslationDataModule(path=path, max_tokens=12)


def make(data: TranslationDataModule, head_class=SoftmaxHead, **kwargs) -> Translation:
    torch.manual_seed(0)
    backbone = Seq2SeqTransformer(data.src_vocab_size, data.vocab_size, model_size=D,
                                  num_heads=2, encoder_layers=1, decoder_layers=1,
                                  feedforward_size=32, dropout=0.0)  # fmt: skip
    return Translation(backbone, head_class(D, data.vocab_size), **kwargs)


@torch.no_grad()
def reference_nll(model: Translation, batch) -> tuple[float, int, float]:
    """Sum over real target tokens of -log p, their count, and the sum of mean_x -log p_x."""
    hidden = model.backbone(batch["source"], batch["source_padding"], batch["target_input"])
    total, count, uniform = 0.0, 0, 0.0
    for b in range(hidden.size(0)):
        for t in range(hidden.size(1)):
            y = int(batch["target_output"][b, t])
            if y == -100:
                continue
            log_probs = model.head.log_prob(hidden[b, t][None])[0]
            total -= float(log_probs[y])
            uniform -= float(log_probs.mean())
            count += 1
    return total, count, uniform


@pytest.mark.parametrize("head_class", [SoftmaxHead, MoSHead, MixtapeHead])
def test_teacher_forced_loss_matches_a_plain_reference(data, head_class):
    model = make(data, head_class).eval()
    batch = next(iter(data.train_dataloader()))
    nll, loss = model.loss(batch)
    total, count, _ = reference_nll(model, batch)
    assert nll.item() == pytest.approx(total / count, rel=1e-5)
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


def test_label_smoothing_matches_a_plain_reference(data):
    model = make(data, label_smoothing=0.1).train()  # smoothing is for training only
    batch = next(iter(data.train_dataloader()))
    nll, loss = model.loss(batch)
    total, count, uniform = reference_nll(model, batch)  # (no dropout in this model)
    assert nll.item() == pytest.approx(total / count, rel=1e-5)
    assert loss.item() == pytest.approx((0.9 * total + 0.1 * uniform) / count, rel=1e-5)
    _, eval_loss = model.eval().loss(batch)
    assert eval_loss.item() == pytest.approx(total / count, rel=1e-5)


def test_padding_does_not_change_a_sentences_loss(data):
    """A pair's NLL is the same alone and padded inside a batch of longer pairs."""
    model = make(data).eval()
    items = [data.encoded("train")[i] for i in (0, 2, 5)]  # lengths 2, 3, 2 (+ <eos>)
    batched = collate_pairs(items, pad_id=data.bos_id, bos_id=data.bos_id)
    total_batched, count_batched, _ = reference_nll(model, batched)
    nll, _ = model.loss(batched)
    separate = [model.loss(collate_pairs([it], data.bos_id, data.bos_id)) for it in items]
    counts = [len(it["target_ids"]) for it in items]
    weighted = sum(n.item() * c for (n, _), c in zip(separate, counts, strict=True))
    assert nll.item() * sum(counts) == pytest.approx(weighted, rel=1e-5)
    assert count_batched == sum(counts)


def test_a_ddp_rank_s_training_loss_is_per_token_of_the_whole_step(data, monkeypatch):
    """Under DDP (faked: world 2, the all-reduce adding another rank's sums) a rank's loss is
    its smoothed token sum * world / the step's tokens, so DDP's gradient average weighs every
    token alike; DS-Softmax's regulariser (a step's, not a token's) is added unscaled; the logs
    show the whole step's loss per token; nothing is read back to the host."""
    from lightning_modules import translation
    from tests.lightning_modules.test_host_sync import SyncSentinel

    head = DSSoftmaxHead(D, data.vocab_size, num_experts=2, lambda_lasso=0.05)
    model = make(data, lambda *_: head, label_smoothing=0.1).train()
    batch = next(iter(data.train_dataloader()))
    with torch.no_grad():
        hidden = model.backbone(batch["source"], batch["source_padding"], batch["target_input"])
        target = batch["target_output"].reshape(-1)
        output = model.head(hidden.reshape(-1, D), target, label_smoothing=0.1)
    tokens = int((target != -100).sum())
    nll = output.nll.sum() / tokens
    other = torch.tensor([10.0, 8.0, 5.0])  # the other rank's loss sum, NLL sum, token count
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda sums: sums.add_(other))
    monkeypatch.setattr(translation, "_ddp_world_size", lambda: 2, raising=False)
    logged, checked = {}, []
    monkeypatch.setattr(model, "log", lambda name, value, **_: logged.__setitem__(name, value))
    monkeypatch.setattr(model, "check_finite_loss", lambda loss, stage: checked.append(loss))
    with SyncSentinel().installed(monkeypatch) as sentinel:
        sentinel.active = True
        loss = model.training_step(batch, 0)
        sentinel.active = False
    # the sentinel sees DS-Softmax's one read-back of its expert sizes (heads/), and no other
    assert sentinel.calls and all(where.startswith("heads/") for _, where in sentinel.calls)
    total = tokens + 5
    expected = output.loss * tokens * 2 / total + output.aux_loss
    assert float(output.aux_loss) > 0
    torch.testing.assert_close(loss.detach(), expected)
    assert len(checked) == 1 and checked[0] is loss  # the loss the optimizer sees
    step_loss = (output.loss * tokens + 10) / total + output.aux_loss
    torch.testing.assert_close(logged["train/loss"], step_loss)
    torch.testing.assert_close(logged["train/nll"], (nll * tokens + 8) / total)


def test_options_are_checked(data):
    with pytest.raises(ModelConfigError, match="must equal the backbone's output size"):
        Translation(make(data).backbone, SoftmaxHead(D + 1, data.vocab_size))
    with pytest.raises(ValueError, match="label_smoothing"):
        make(data, label_smoothing=1.0)
    tied = make(data, tie_weights=True)
    assert tied.head.weight is tied.backbone.embedding.weight


def test_validation_bleu_and_test_translations_file(data, tmp_path):
    model = make(data, decode=DecodeConfig(beam_size=2, val_beam_size=1, num_samples=2))
    out = tmp_path / "out" / "translations.txt"
    model.translations_file = str(out)
    trainer = L.Trainer(max_steps=30, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, datamodule=data)
    (val,) = trainer.validate(model, datamodule=data)
    # val BLEU = sacreBLEU of the greedy translations against the raw reference lines
    batch = collate_pairs([data.encoded("valid")[i] for i in range(5)], data.bos_id, data.bos_id)
    model.eval()
    hypotheses = [data.detokenize(h) for h in greedy_decode(model.backbone, model.head,
                  batch["source"], batch["source_padding"], model.decode, data.bos_id,
                  data.target_vocab.eos_id)]  # fmt: skip
    expected = sacrebleu.corpus_bleu(hypotheses, [data.references("valid")]).score
    assert val["val/bleu"] == pytest.approx(expected, abs=1e-4)
    assert val["val/ppl"] < data.vocab_size  # learnt something in 30 steps
    assert val["val/decode_s"] > 0
    (test,) = trainer.test(model, datamodule=data)
    lines = out.read_text().splitlines()
    assert len(lines) == 4  # one per test line, in file order
    assert test["test/bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(lines, [data.references("test")]).score, abs=1e-4
    )


def test_a_blank_test_line_is_translated_blank_as_predict_does(tmp_path):
    """A blank source line (a document break) gets a blank translation in the test file and
    its BLEU, as `predict` gives it, not what the model says after <eos> alone: the test
    file is predict's output on the test source file, and BLEU is sacreBLEU of that file."""
    test = [TINY[0], ("", ""), TINY[2], (" ", "")]
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY[:3], "test_2016_flickr": test})
    data = TranslationDataModule(path=path, max_tokens=12)
    model = make(data, decode=DecodeConfig(beam_size=2, val_beam_size=0))
    out = tmp_path / "translations.txt"
    model.translations_file = str(out)
    trainer = L.Trainer(max_steps=30, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, datamodule=data)
    (result,) = trainer.test(model, datamodule=data)
    lines = out.read_text("utf-8").split("\n")[:-1]
    assert lines[1] == lines[3] == "" and lines[0] and lines[2]
    assert result["test/bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(lines, [data.references("test")]).score, abs=1e-4
    )
    data.hparams.predict_sentences = data.sources("test")
    predicted = [row for batch in trainer.predict(model, datamodule=data) for row in batch]
    assert [row["translation"] for row in predicted] == lines
    # the model has words to say after <eos> alone: the blank lines are the policy's
    batch = collate_pairs([data.encoded("test")[1]], data.bos_id, data.bos_id)
    (blank,) = model.translate(batch, 2)
    assert blank


def test_model_summary_counts_the_flops_of_a_training_batch(data, tmp_path):
    """The summary's FLOPs column from ``example_input_array`` (this rank's first training
    batch, built by ``setup("fit")``): the head's product over every target position, not the
    zeros a translation run's summary showed."""
    from lightning.pytorch.utilities.model_summary import ModelSummary

    model = make(data)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, datamodule=data)
    source, padding, target_input, target_output = model.example_input_array
    assert source.shape == padding.shape and target_input.shape == target_output.shape
    summary = ModelSummary(model, max_depth=1)
    flops = dict(zip(summary.layer_names, (sum(c.values()) for c in summary.flop_counts.values()),
                     strict=True))  # fmt: skip
    assert flops["head"] == 2 * target_output.numel() * D * data.vocab_size
    assert flops["backbone"] > 0 and summary.total_flops == flops["backbone"] + flops["head"]


def test_the_sanity_check_s_bleu_line_says_so(data, tmp_path, caplog):
    """Lightning's sanity check decodes and scores too but logs nothing: its BLEU line is
    marked, so that a fit's first printed BLEU is not mistaken for the first epoch's."""
    model = make(data, decode=DecodeConfig(val_beam_size=1))
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=1,
                        default_root_dir=tmp_path)  # fmt: skip
    with caplog.at_level("INFO"):
        trainer.fit(model, datamodule=data)
    lines = [r.getMessage() for r in caplog.records if "BLEU" in r.getMessage()]
    assert [line.split(" on ")[0].rsplit(" ", 1)[0] for line in lines] == [
        "sanity check: val BLEU", "val BLEU"]  # fmt: skip


@pytest.mark.parametrize("joint", [False, True])
def test_shared_embeddings_need_a_joint_vocabulary(tmp_path, joint):
    """Two vocabularies of one size pass the backbone's size check (capped ones often have
    it): the task refuses to share their embeddings unless the data's vocabulary is joint."""
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY[:5], "test_2016_flickr": TINY[:4]})
    data = TranslationDataModule(path=path, max_tokens=12, joint_vocab=joint)
    size = max(data.src_vocab_size, data.vocab_size) if not joint else data.vocab_size
    backbone = Seq2SeqTransformer(size, size, model_size=D, num_heads=2, encoder_layers=1,
                                  decoder_layers=1, feedforward_size=32,
                                  share_embeddings=True)  # fmt: skip
    model = Translation(backbone, SoftmaxHead(D, size))
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
    if joint:
        trainer.fit(model, datamodule=data)
        assert backbone.source_embedding is backbone.embedding and trainer.global_step == 1
    else:
        with pytest.raises(ModelConfigError, match="set data.joint_vocab true$"):
            trainer.fit(model, datamodule=data)


def test_a_mid_epoch_checkpoint_resumes_exactly(tmp_path):
    """``fit --ckpt_path`` of a checkpoint written mid-epoch continues at the next batch of
    the same shuffled order (the token buckets' position is saved), with the epoch's train
    NLL sums given back: the run ends with the uninterrupted run's weights and epoch NLL
    (Lightning warned "your dataloader is not resumable" and replayed the epoch's start)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    path = write_corpus(tmp_path, {"train": TINY, "val": TINY[:5], "test_2016_flickr": TINY[:4]})

    def fit(name: str, ckpt_path: str | None = None) -> tuple[Translation, L.Trainer]:
        data = TranslationDataModule(path=path, max_tokens=8)  # 6 batches an epoch
        model = make(data)
        every = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=8, save_top_k=-1,
                                filename="{step}")  # fmt: skip
        trainer = L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=0, callbacks=[every],
                            default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return model, trainer

    whole, whole_trainer = fit("whole")
    middle = tmp_path / "whole" / "step=8.ckpt"  # the 2nd batch of the second epoch
    assert torch.load(middle, weights_only=False)["loops"]["fit_loop"]["epoch_progress"][
        "current"]["completed"] == 1  # fmt: skip
    resumed, resumed_trainer = fit("resumed", str(middle))
    assert resumed_trainer.global_step == whole_trainer.global_step == 12
    for (name, value), other in zip(whole.state_dict().items(), resumed.state_dict().values(),
                                    strict=True):  # fmt: skip
        torch.testing.assert_close(other, value, rtol=0, atol=0, msg=name)
    epoch_nll = [t.callback_metrics["train/nll_epoch"] for t in (whole_trainer, resumed_trainer)]
    torch.testing.assert_close(epoch_nll[1], epoch_nll[0], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("head_class", [SoftmaxHead, MixtapeHead])
def test_a_tiny_model_learns_to_translate_the_toy_corpus(data, tmp_path, head_class):
    model = make(data, head_class, decode=DecodeConfig(beam_size=3))
    model.translations_file = str(tmp_path / "translations.txt")
    trainer = L.Trainer(max_steps=150, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, check_val_every_n_epoch=1000,
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, datamodule=data)
    trainer.test(model, datamodule=data)
    # (the toy sentences are too short for 4-gram BLEU: compare the text)
    assert (tmp_path / "translations.txt").read_text().splitlines() == data.references("test")


def test_bleu_schedule_and_the_checkpoint_chosen_by_validation_bleu(data, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = make(data, decode=DecodeConfig(bleu_every_n_epochs=2, val_beam_size=1))
    checkpoint = ModelCheckpoint(dirpath=tmp_path, monitor="val/bleu", mode="max",
                                 every_n_epochs=2, save_top_k=1)  # fmt: skip
    trainer = L.Trainer(max_epochs=6, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[checkpoint], num_sanity_val_steps=0,
                        default_root_dir=tmp_path)  # fmt: skip
    decoded_epochs, bleu = [], {}
    original_translate, original_log = model.translate, model.log

    def counting_translate(batch, beam_size):
        decoded_epochs.append(trainer.current_epoch)
        return original_translate(batch, beam_size)

    def recording_log(name, value, *args, **kwargs):
        if name == "val/bleu":
            bleu[trainer.current_epoch] = float(value)
        return original_log(name, value, *args, **kwargs)

    model.translate, model.log = counting_translate, recording_log
    trainer.fit(model, datamodule=data)
    assert sorted(set(decoded_epochs)) == [1, 3, 5]  # validation decodes every second epoch
    assert sorted(bleu) == [1, 3, 5]
    assert checkpoint.best_model_score == pytest.approx(max(bleu.values()))
    best_epoch = max(bleu, key=bleu.get)
    saved = torch.load(checkpoint.best_model_path, map_location="cpu", weights_only=False)
    assert saved["epoch"] == best_epoch
    # outside fitting, validation always decodes
    decoded_epochs.clear()
    trainer.validate(model, datamodule=data, verbose=False)
    assert decoded_epochs


def test_bleu_checkpoint_out_of_step_with_the_schedule_is_one_clear_error(data, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = make(data, decode=DecodeConfig(bleu_every_n_epochs=2))
    trainer = L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, monitor="val/bleu")],
                        use_distributed_sampler=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(ModelConfigError, match="every_n_epochs to a multiple"):
        trainer.fit(model, datamodule=data)
    with pytest.raises(ModelConfigError, match="bleu_every_n_epochs"):
        make(data, decode=DecodeConfig(bleu_every_n_epochs=0))


def test_a_compiled_head_sees_a_few_row_counts(tmp_path):
    """Batches of length buckets have a new B x T almost every step; compiled, the head's loss
    sees its rows padded to a few sizes, one compilation each (unpadded, every new count was
    one until Dynamo's limit of 8 sent the rest to eager), with the unpadded losses."""
    gen = torch.Generator().manual_seed(0)
    words = [f"w{i}" for i in range(12)]

    def sentence(length: int) -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, 12, (length,), generator=gen))

    lengths = torch.randint(2, 17, (300, 2), generator=gen)  # a target of about its source's
    pairs = [(sentence(s), sentence(max(s + d % 3 - 1, 1))) for s, d in lengths.tolist()]
    splits = {"train": pairs, "val": pairs[:40], "test_2016_flickr": pairs[:8]}
    path = write_corpus(tmp_path, splits)
    data = TranslationDataModule(path=path, max_tokens=128)
    compiled_rows: list[int] = []  # the rows of each compilation of the head's loss

    def counting_backend(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        compiled_rows.append(example_inputs[0].size(0))
        return graph.forward

    model = make(data, compile={"backend": counting_backend})
    model.backbone.compile = lambda **options: None  # the head's compilations alone
    trainer = L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, datamodule=data)
    train = [b["target_output"].numel() for b in data.train_dataloader()]
    val = [b["target_output"].numel() for b in data.val_dataloader()]
    assert len(set(train)) >= 8  # the batches' own row counts
    # one compilation per padded size, in training and (no gradients) in validation
    padded = [{padded_rows(n) for n in split} for split in (train, val)]
    assert sorted(compiled_rows) == sorted([*padded[0], *padded[1]])
    assert len(padded[0]) <= 4
    # the padded rows change no loss
    batch = next(b for b in data.train_dataloader() if padded_rows(b["target_output"].numel())
                 > b["target_output"].numel())  # fmt: skip
    eager = make(data).eval()
    eager.load_state_dict(model.state_dict())
    model.eval()
    torch.testing.assert_close(model.loss(batch), eager.loss(batch))


def test_bleu_takes_the_target_languages_tokenizer(caplog):
    from sacrebleu.metrics import BLEU

    from lightning_modules.translation import bleu_for

    hypotheses, references = ["我们今天去公园散步。"], [["我们今天去公园散步了。"]]
    assert BLEU().corpus_score(hypotheses, references).score == 0.0  # one 13a token each
    assert bleu_for("zh").corpus_score(hypotheses, references).score > 50
    english = ["the cat sat on the mat"], [["the cat sat on a mat"]]
    plain = BLEU().corpus_score(*english).score
    assert (
        bleu_for("en").corpus_score(*english).score
        == plain
        == bleu_for(None).corpus_score(*english).score
    )
    if importlib.util.find_spec("MeCab") is None:  # sacrebleu[ja] not installed: 13a, said
        assert bleu_for("ja").corpus_score(*english).score == plain
        assert "BLEU for 'ja' tokenized by 13a" in caplog.text
