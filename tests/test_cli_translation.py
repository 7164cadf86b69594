"""Translation end to end through cli.py: fit a few steps on Multi30k, test writes translations."""

import gzip
import json
import math

import pytest
import sacrebleu
import torch

from datamodules.errors import VocabularyMismatchError
from heads import MixtapeHead, MoSHead, SoftmaxHead
from tests.datamodules.test_translation import MULTI30K, TINY, write_corpus

SMALL = [
    "--model.init_args.backbone.init_args.model_size", "32",
    "--model.init_args.backbone.init_args.feedforward_size", "64",
    "--model.init_args.backbone.init_args.encoder_layers", "1",
    "--model.init_args.backbone.init_args.decoder_layers", "1",
    "--data.init_args.max_vocab_size", "2000",
    "--data.init_args.max_tokens", "400",
    "--data.init_args.eval_max_tokens", "400",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]  # fmt: skip
ON_MULTI30K = ["--data.init_args.path", str(MULTI30K), *SMALL]  # a small model on Multi30k


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cli_run):
    logs = tmp_path_factory.mktemp("logs")
    # limit_val_batches 2, not 1: jsonargparse reads "1" as the float 1.0 (the whole split)
    cli = cli_run("fit", *ON_MULTI30K, "--trainer.max_epochs", "1",
                  "--trainer.limit_train_batches", "4", "--trainer.limit_val_batches", "2",
                  "--trainer.num_sanity_val_steps", "0",
                  "--trainer.logger.init_args.save_dir", str(logs),
                  experiment="multi30k_mixtape")  # fmt: skip
    return cli, logs


def test_fit_logs_bleu_samples_and_checkpoint(trained):
    cli, logs = trained
    assert cli.trainer.global_step == 4
    assert type(cli.model.head) is MixtapeHead and cli.model.head.frequent_ratio == 0.5
    # sizes linked from the data module: target side into the head and decoder, source side
    # into the encoder
    data = cli.datamodule
    assert cli.model.head.vocab_size == data.vocab_size == 2000
    assert cli.model.backbone.source_embedding.num_embeddings == data.src_vocab_size == 2000
    for key in ("train/loss", "val/loss", "val/ppl", "val/bleu"):
        assert torch.isfinite(torch.as_tensor(cli.trainer.callback_metrics[key])), key
    assert list(logs.rglob("last.ckpt"))
    events = list(logs.rglob("events.out.tfevents.*"))
    assert events and any(b"val/samples" in e.read_bytes() for e in events)


def test_test_writes_translations_and_bleu(trained, cli_run, tmp_path):
    _, logs = trained
    ckpt = str(next(logs.rglob("last.ckpt")))
    out = tmp_path / "hyp.txt"
    cli = cli_run("test", *ON_MULTI30K, "--ckpt_path", ckpt, "--trainer.logger", "false",
                  "--trainer.limit_test_batches", "2", "--model.init_args.decode.beam_size", "2",
                  "--model.init_args.decode.max_length_a", "1.0",
                  "--model.init_args.decode.max_length_b", "2",
                  "--model.init_args.translations_file", str(out),
                  experiment="multi30k_mixtape")  # fmt: skip
    lines = out.read_text().splitlines()
    decoded = sorted(i for b in list(cli.datamodule.test_dataloader())[:2] for i in b["index"])
    assert len(lines) == len(decoded) > 10
    references = cli.datamodule.references("test")
    expected = sacrebleu.corpus_bleu(lines, [[references[int(i)] for i in decoded]]).score
    assert float(cli.trainer.callback_metrics["test/bleu"]) == pytest.approx(expected, abs=1e-3)


def test_predict_translates_given_sentences(trained, cli_run, tmp_path):
    _, logs = trained
    ckpt = str(next(logs.rglob("last.ckpt")))
    out = tmp_path / "predictions.jsonl"
    sentences = ["Ein Hund rennt durch den Schnee.", "Zwei Männer spielen Fußball."]
    cli_run("predict", *ON_MULTI30K, "--ckpt_path", ckpt, "--trainer.logger", "false",
            "--data.init_args.predict_sentences", json.dumps(sentences, ensure_ascii=False),
            "--model.init_args.decode.max_length_b", "3",
            "--trainer.callbacks+=app.callbacks.PredictionWriter",
            f"--trainer.callbacks.output_file={out}", experiment="multi30k_mixtape")  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]  # a sentence a line
    assert [r["source"] for r in rows] == sentences
    assert all(isinstance(r["translation"], str) for r in rows)


def test_predict_translates_a_file_in_its_order(trained, cli_run, tmp_path):
    """``data.predict_file``: a compressed file of more sentences than a predict batch (64),
    with an empty line; one JSON line per sentence, in the file's order."""
    _, logs = trained
    ckpt = str(next(logs.rglob("last.ckpt")))
    sentences = [f"{n} Hunde rennen durch den Schnee." for n in range(70)]
    sentences[3] = ""
    path = tmp_path / "sentences.de.gz"
    path.write_bytes(gzip.compress("\n".join(sentences).encode()))
    out = tmp_path / "predictions.jsonl"
    cli_run("predict", *ON_MULTI30K, "--ckpt_path", ckpt, "--trainer.logger", "false",
            "--data.init_args.predict_file", str(path),
            "--model.init_args.decode.max_length_b", "3",
            "--trainer.callbacks+=app.callbacks.PredictionWriter",
            f"--trainer.callbacks.output_file={out}", experiment="multi30k_mixtape")  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["source"] for r in rows] == sentences
    assert rows[3]["translation"] == ""


def test_checkpoint_with_other_vocabularies_is_refused(trained, cli_run):
    _, logs = trained
    ckpt = str(next(logs.rglob("last.ckpt")))
    with pytest.raises(VocabularyMismatchError, match="another source vocabulary"):
        cli_run("test", *SMALL, "--data.init_args.max_vocab_size", "1500", "--ckpt_path", ckpt,
                "--trainer.logger", "false", experiment="multi30k_mixtape")  # fmt: skip


@pytest.mark.parametrize("head_class", [SoftmaxHead, MoSHead])
def test_configs_swap_the_head_and_bf16_mixed_trains_and_searches(head_class, cli_run):
    config = {SoftmaxHead: "multi30k_softmax", MoSHead: "multi30k_mos"}[head_class]
    cli = cli_run("fit", *ON_MULTI30K, "--trainer.max_epochs", "1",
                  "--trainer.limit_train_batches", "2",
                  "--trainer.limit_val_batches", "2", "--trainer.num_sanity_val_steps", "0",
                  "--trainer.precision", "bf16-mixed",
                  "--model.init_args.decode.val_beam_size", "2",
                  "--model.init_args.decode.max_length_b", "3",
                  "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
                  "--trainer.callbacks", "null", experiment=config)  # fmt: skip
    assert type(cli.model.head) is head_class and cli.model.head.vocab_size == 2000
    for key in ("train/loss", "val/loss", "val/bleu"):
        assert torch.isfinite(torch.as_tensor(cli.trainer.callback_metrics[key])), key


def test_hybrid_lightrnn_target_codes_train_test_and_translate(cli_run, tmp_path):
    """The decoder and the head work in codes (K frequent words one each, the others two);
    BLEU and the translations are words, decoded from the codes."""
    codes = ["--data.init_args.vocab", "hybrid_lightrnn",
             "--data.init_args.lightrnn_frequent", "500"]  # fmt: skip
    logs = tmp_path / "logs"
    fit = cli_run("fit", *ON_MULTI30K, *codes, "--trainer.max_epochs", "1",
                  "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
                  "--trainer.num_sanity_val_steps", "0",
                  "--model.init_args.decode.max_length_b", "3",
                  "--trainer.logger.init_args.save_dir", str(logs),
                  experiment="multi30k_softmax")  # fmt: skip
    vocab = fit.datamodule.target_vocab
    assert type(vocab).__name__ == "HybridLightRNNVocab" and len(vocab.words) == 2000
    assert fit.model.head.vocab_size == len(vocab) == 500 + vocab.rows + vocab.cols < 2000
    assert torch.isfinite(torch.as_tensor(fit.trainer.callback_metrics["val/bleu"]))
    out = tmp_path / "hyp.txt"
    ckpt = str(next(logs.rglob("last.ckpt")))
    test = cli_run("test", *ON_MULTI30K, *codes, "--ckpt_path", ckpt, "--trainer.logger", "false",
                   "--trainer.limit_test_batches", "1",
                   "--model.init_args.decode.max_length_b", "3",
                   "--model.init_args.translations_file", str(out),
                   experiment="multi30k_softmax")  # fmt: skip
    lines = out.read_text().splitlines()
    assert lines and all("<row" not in line and "<col" not in line for line in lines)
    words = set(vocab.words.itos)
    assert all(word in words for line in lines for word in line.split())
    decoded = sorted(i for b in list(test.datamodule.test_dataloader())[:1] for i in b["index"])
    references = test.datamodule.references("test")
    expected = sacrebleu.corpus_bleu(lines, [[references[int(i)] for i in decoded]]).score
    assert float(test.trainer.callback_metrics["test/bleu"]) == pytest.approx(expected, abs=1e-3)
    # per word: the codes' summed NLL over the words of the references (rows and frequent
    # codes start one), counted here plainly from the batch
    targets = next(iter(test.datamodule.test_dataloader()))["target_output"].flatten()
    targets = targets[targets != -100].tolist()
    columns = set(vocab.col_codes.tolist())  # a column code ends a rare word
    words = sum(1 for t in targets if t not in columns)
    metrics = test.trainer.callback_metrics
    expected = float(metrics["test/loss"]) * len(targets) / words
    assert math.log(float(metrics["test/word_ppl"])) == pytest.approx(expected, rel=1e-4)
    assert len(targets) > words  # some words took two codes


def test_misaligned_files_are_one_clear_line(cli_run, tmp_path, capsys):
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY, "test_2016_flickr": TINY})
    (tmp_path / "train.en").write_text("x\n")
    code = cli_run("fit", "--data.init_args.path", path, experiment="multi30k_softmax",
                   console=True)  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: misaligned parallel train files: ")
    assert "has 12 lines but" in err and "has 1" in err


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_gpu_fit_and_beam_search_under_mixed_precision(precision, cli_run):
    cli = cli_run("fit", *ON_MULTI30K, "--trainer.accelerator", "gpu", "--trainer.devices", "1",
                  "--trainer.precision", precision, "--trainer.max_epochs", "1",
                  "--trainer.limit_train_batches", "20", "--trainer.limit_val_batches", "2",
                  "--trainer.num_sanity_val_steps", "0",
                  "--model.init_args.decode.val_beam_size", "3",
                  "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
                  "--trainer.callbacks", "null", experiment="multi30k_mixtape")  # fmt: skip
    assert cli.trainer.strategy.root_device.type == "cuda"  # (Lightning moves it back after fit)
    for key in ("train/loss", "val/loss", "val/bleu"):
        assert torch.isfinite(torch.as_tensor(cli.trainer.callback_metrics[key])), key
