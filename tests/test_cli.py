"""End to end through cli.py: fit, test, predict, head swapping, errors."""

import copy
import json
import subprocess
import sys

import pytest
import torch
from jsonargparse import Namespace

from app.callbacks.training.progress import IntervalTQDMProgressBar
from app.cli.errors import CommandLineError
from app.cli.lightning_cli import _predict_on_one_device, build
from cli import main
from datamodules import LanguageModelingDataModule
from datamodules.errors import VocabularyMismatchError
from datamodules.text_source import TextFiles
from datamodules.vocab import vocab_from_state
from heads import HeadConfigError, MixtapeHead, MoSHead, SoftmaxHead
from heads.errors import user_error
from lightning_modules import LanguageModel
from tests.conftest import EXPERIMENTS, PTB, REPO

SMALL = [
    "--model.init_args.backbone.init_args.embedding_size", "32",
    "--model.init_args.backbone.init_args.hidden_size", "32",
    "--trainer.enable_progress_bar", "false",
]  # fmt: skip
ON_PTB = ["--data.init_args.path", str(PTB), *SMALL]  # a small model on the shipped PTB


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cli_run):
    logs = tmp_path_factory.mktemp("logs")
    cli = cli_run("fit", *ON_PTB,
                  "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "300",
                  "--trainer.limit_val_batches", "20", "--trainer.logger.init_args.save_dir",
                  str(logs), experiment="ptb_softmax")  # fmt: skip
    return cli, logs


def test_fit_writes_checkpoint_and_tensorboard_events(trained):
    cli, logs = trained
    assert cli.trainer.global_step == 300
    assert list(logs.rglob("*.ckpt")), "no checkpoint written"
    assert list(logs.rglob("events.out.tfevents.*")), "no TensorBoard event file"
    assert torch.isfinite(cli.trainer.callback_metrics["val/ppl"])


def test_a_checkpoint_loads_in_python_by_its_path_alone(trained):
    """``LanguageModel.load_from_checkpoint(path)``: the backbone and head rebuilt from the
    configs the checkpoint holds (32-wide here, not the class defaults), every weight loaded,
    the vocabulary read from it too; it scores text as the trained model does."""
    cli, logs = trained
    path = next(logs.rglob("last.ckpt"))
    model = LanguageModel.load_from_checkpoint(str(path)).eval()
    assert type(model.head) is SoftmaxHead and model.head.hidden_size == 32
    trained_state = cli.model.state_dict()
    assert model.state_dict().keys() == trained_state.keys()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, trained_state[name].cpu(), msg=name)
    assert model.head.weight is model.backbone.embedding.weight  # tied as trained
    saved = torch.load(path, weights_only=False)["LanguageModelingDataModule"]
    vocab = vocab_from_state(saved["vocab"])
    ids = torch.tensor([vocab.encode_line("the company said")])
    reference = copy.deepcopy(cli.model).cpu().eval()  # (the fixture's model left as it is)
    with torch.no_grad():
        expected = reference.head.log_prob(reference.backbone(ids)[0][:, -1])
        torch.testing.assert_close(model.head.log_prob(model.backbone(ids)[0][:, -1]), expected)


def test_test_on_checkpoint_beats_untrained_model(trained, cli_run):
    cli, logs = trained
    ckpt = str(next(logs.rglob("last.ckpt")))
    common = ["--trainer.limit_test_batches", "50", "--trainer.logger", "false"]
    trained_ppl = cli_run("test", *ON_PTB, "--ckpt_path", ckpt, *common, experiment="ptb_softmax")
    untrained_ppl = cli_run("test", *ON_PTB, *common, experiment="ptb_softmax")
    trained_ppl = float(trained_ppl.trainer.callback_metrics["test/ppl"])
    untrained_ppl = float(untrained_ppl.trainer.callback_metrics["test/ppl"])
    # an untrained head already predicts the unigram's shape (its bias starts at the Zipf
    # log-prior: PTB's unigram perplexity is about 700, uniform would be 10,000)
    assert 300 < untrained_ppl < 2000, untrained_ppl
    assert trained_ppl < 0.9 * untrained_ppl, (trained_ppl, untrained_ppl)


def test_test_and_validate_never_read_the_training_split(trained, cli_run, monkeypatch, tmp_path):
    """Nothing tokenises while the CLI builds objects (the data module's str is lazy), and
    ``test``/``validate`` on a checkpoint read only their split; with an empty cache the
    vocabulary is counted on the training split, which is still never tokenised."""
    _, logs = trained
    read, mapped = [], []
    real_batches, real_ids = TextFiles.line_batches, LanguageModelingDataModule._split_ids

    def line_batches(self, part, desc=None):
        read.append(part)
        return real_batches(self, part, desc)

    def split_ids(self, split):
        mapped.append(split)
        return real_ids(self, split)

    monkeypatch.setattr(TextFiles, "line_batches", line_batches)
    monkeypatch.setattr(LanguageModelingDataModule, "_split_ids", split_ids)
    common = ["--ckpt_path", str(next(logs.rglob("last.ckpt"))), "--trainer.logger", "false",
              "--trainer.limit_test_batches", "2", "--trainer.limit_val_batches", "2"]  # fmt: skip
    cli_run("test", *ON_PTB, *common, experiment="ptb_softmax")
    cli_run("validate", *ON_PTB, *common, experiment="ptb_softmax")
    assert "train" not in read and set(mapped) == {"test", "valid"}
    read.clear(), mapped.clear()
    cli = cli_run("test", *ON_PTB, *common, "--data.init_args.cache_dir", str(tmp_path),
                  experiment="ptb_softmax")  # fmt: skip
    assert read == ["train", "test"]  # the vocabulary's count, then the test split's ids
    assert set(mapped) == {"test"} and not cli.datamodule.cache.has_ids("train")


def test_checkpoint_with_another_vocabulary_is_refused(trained, cli_run, tmp_path):
    _, logs = trained
    for split in ("train", "valid", "test"):
        (tmp_path / f"tiny.{split}.txt").write_text("a b c d\n" * 200)
    ckpt = str(next(logs.rglob("last.ckpt")))
    with pytest.raises(VocabularyMismatchError, match="another vocabulary"):
        cli_run("test", *SMALL, "--data.init_args.path", str(tmp_path), "--ckpt_path", ckpt,
                "--trainer.logger", "false", experiment="ptb_softmax")  # fmt: skip


def test_predict_reports_top_k_and_samples(trained, cli_run, tmp_path):
    _, logs = trained
    ckpt = str(next(logs.rglob("last.ckpt")))
    out = tmp_path / "predictions.jsonl"
    cli_run("predict", *ON_PTB, "--ckpt_path", ckpt, "--trainer.logger", "false",
            "--data.init_args.predict_prompts", '["the company said", "in new york"]',
            "--model.init_args.predict_top_k", "5", "--model.init_args.generate_tokens", "7",
            "--trainer.callbacks+=app.callbacks.PredictionWriter",
            f"--trainer.callbacks.output_file={out}", experiment="ptb_softmax")  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["the company said", "in new york"]
    for row in rows:
        probs = [c["prob"] for c in row["top_k"]]
        assert len(probs) == 5 and probs == sorted(probs, reverse=True) and sum(probs) <= 1
        assert len(row["sample"].split()) == 7


@pytest.mark.parametrize("callbacks", [["--trainer.callbacks", "null"], []])
def test_predict_prints_each_prediction_once_with_or_without_a_writer(
    trained, cli_run, capsys, callbacks
):
    """A config whose callbacks lack the writer (the DS recipes') still prints predictions:
    the CLI adds one; the shipped LM callbacks' own writer is not doubled."""
    _, logs = trained
    ckpt = str(next(logs.rglob("last.ckpt")))
    capsys.readouterr()
    cli_run("predict", *ON_PTB, "--ckpt_path", ckpt, "--trainer.logger", "false", *callbacks,
            "--data.init_args.predict_prompts", '["the company said", "in new york"]',
            experiment="ptb_softmax")  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [json.loads(line)["prompt"] for line in lines] == ["the company said", "in new york"]


def test_predict_output_is_json_lines_with_the_progress_bar_shown(trained, tmp_path):
    """``python cli.py predict ... > predictions.jsonl`` (README): the progress bar drew on
    stdout, and a line of it ended up in the file. It draws on stderr now."""
    _, logs = trained
    ckpt = str(next(logs.rglob("last.ckpt")))
    command = [sys.executable, "cli.py", "predict", "--trainer.default_root_dir", str(tmp_path),
               *EXPERIMENTS["ptb_softmax"], *ON_PTB, "--ckpt_path", ckpt,
               "--trainer.logger", "false", "--trainer.enable_progress_bar", "true",
               "--data.init_args.predict_prompts",
               '["the company said", "in new york"]']  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]  # every line
    assert [row["prompt"] for row in rows] == ["the company said", "in new york"]
    assert "Predicting" in done.stderr  # (Rich where installed: the bar shown, elsewhere)


def test_predict_prints_json_lines_alone_with_the_tqdm_bar(trained, cli_run, capsys, monkeypatch):
    """Lightning's TQDM bars (where Rich is not installed) write to stdout too."""
    _, logs = trained
    ckpt = str(next(logs.rglob("last.ckpt")))
    monkeypatch.setattr("app.cli.lightning_cli.interval_progress_bar", IntervalTQDMProgressBar)
    capsys.readouterr()
    cli_run("predict", *ON_PTB, "--ckpt_path", ckpt, "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "true", "--data.init_args.predict_prompts",
            '["the company said"]', experiment="ptb_softmax")  # fmt: skip
    out, err = capsys.readouterr()
    assert [json.loads(line)["prompt"] for line in out.splitlines()] == ["the company said"]
    assert "Predicting" in err


def test_predict_with_a_multi_device_setting_prints_every_prompt_once(trained, cli_run, capsys):
    """A DDP run's saved setting (2 devices, ddp) given to predict: it split the prompts over
    two ranks and printed rank 0's only (a, c, e); now one device, every prompt, in order."""
    _, logs = trained
    ckpt = str(next(logs.rglob("last.ckpt")))
    prompts = ["a", "b", "c", "d", "e"]
    capsys.readouterr()
    cli = cli_run("predict", *ON_PTB, "--ckpt_path", ckpt, "--trainer.logger", "false",
                  "--trainer.accelerator", "cpu", "--trainer.devices", "2",
                  "--trainer.strategy", "ddp", "--data.init_args.predict_prompts",
                  json.dumps(prompts), experiment="ptb_softmax")  # fmt: skip
    out, err = capsys.readouterr()
    assert cli.trainer.world_size == 1
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert [json.loads(line)["prompt"] for line in lines] == prompts
    assert "warning: predict runs on one device, not the setting's devices=2" in err


@pytest.mark.parametrize(
    ("devices", "options", "asked"),
    [
        ("auto", {}, False),  # all GPUs of the machine: one, without a word
        (1, {"strategy": "ddp"}, True),
        (-1, {}, True),
        ([0], {}, False),
        ([0, 1], {}, True),
        (1, {"num_nodes": 2}, True),
    ],
)
def test_predict_settings_run_on_one_device(devices, options, asked):
    trainer = Namespace(**{"devices": devices, "num_nodes": 1, "strategy": "auto", **options})
    assert bool(_predict_on_one_device(trainer)) is asked
    assert trainer.devices in (1, [0]) and trainer.num_nodes == 1
    assert trainer.strategy == "auto" or not asked


@pytest.mark.parametrize("head_class", [SoftmaxHead, MoSHead, MixtapeHead])
def test_one_line_swaps_the_head_and_bf16_mixed_trains(head_class, cli_run):
    cli = cli_run("fit", *ON_PTB,
                  "--model.head.class_path", f"heads.{head_class.__name__}",
                  "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4",
                  "--trainer.limit_val_batches", "2",
                  "--trainer.precision", "bf16-mixed", "--trainer.logger", "false",
                  "--trainer.enable_checkpointing", "false", "--data.init_args.batch_size", "4",
                  "--trainer.callbacks", "null", experiment="ptb_mixtape")  # fmt: skip
    assert type(cli.model.head) is head_class
    assert cli.model.head.vocab_size == 10_000  # linked from the data module
    for key in ("train/loss", "val/loss", "val/ppl"):
        assert torch.isfinite(cli.trainer.callback_metrics[key]), key


def test_a_fit_without_a_logger_keeps_the_shipped_callbacks_that_need_none(cli_run):
    cli = cli_run("fit", *ON_PTB, "--trainer.logger", "false", "--trainer.max_steps", "2",
                  "--trainer.limit_val_batches", "1", "--data.init_args.batch_size", "4",
                  experiment="ptb_softmax")  # fmt: skip
    kept = {type(callback).__name__ for callback in cli.trainer.callbacks}
    assert "LearningRateMonitor" not in kept  # Lightning refuses it without a logger
    assert {"ModelCheckpoint", "TokenThroughputMonitor", "EpochTimer"} <= kept
    assert cli.trainer.global_step == 2


def test_a_fit_without_checkpointing_leaves_the_configs_model_checkpoint_out(cli_run, tmp_path):
    """``--trainer.enable_checkpointing false`` with a config that lists a ModelCheckpoint
    (every shipped one): Lightning refused the pair; the run trains and writes none."""
    cli = cli_run("fit", *ON_PTB, "--trainer.enable_checkpointing", "false",
                  "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1",
                  "--data.init_args.batch_size", "4", "--trainer.logger.init_args.save_dir",
                  str(tmp_path), experiment="ptb_softmax")  # fmt: skip
    kept = {type(callback).__name__ for callback in cli.trainer.callbacks}
    assert "ModelCheckpoint" not in kept and cli.trainer.checkpoint_callback is None
    assert {"LearningRateMonitor", "TokenThroughputMonitor", "EpochTimer"} <= kept
    assert cli.trainer.global_step == 2
    assert list(tmp_path.rglob("*.ckpt")) == [] and list(tmp_path.rglob("config.yaml"))


def test_unknown_head_class_is_reported(cli_run):
    with pytest.raises(CommandLineError, match="no class 'NoSuchHead' in module 'heads'"):
        cli_run("fit", *ON_PTB, "--model.head.class_path", "heads.NoSuchHead",
                experiment="ptb_softmax")  # fmt: skip


def test_bad_mixtape_option_is_one_clear_line(cli_run, capsys):
    args = ["--data.init_args.path", str(PTB), "--model.head.init_args.num_components", "3"]
    with pytest.raises(Exception) as raised:
        cli_run("fit", *args, experiment="ptb_mixtape")
    assert isinstance(user_error(raised.value), HeadConfigError)
    assert cli_run("fit", *args, experiment="ptb_mixtape", console=True) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "error: MixtapeHead num_components must be a power of two >= 2 (sigmoid tree, Eq. 3), got 3"
    )


def test_missing_data_is_one_clear_line(cli_run, tmp_path, capsys):
    missing = str(tmp_path / "no_such_corpus")
    code = cli_run("fit", "--data.init_args.path", missing, experiment="ptb_softmax", console=True)
    assert code == 2
    assert f"error: data path {missing!r} does not exist" in capsys.readouterr().err


def test_sizes_are_linked_and_a_head_fragment_swaps_the_head(ptb_path):
    # the backbone's output size goes into head.hidden_size, the vocabulary's size into both
    cli = build(["configs/lm/ptb.yaml"], [
        "--data.init_args.path", ptb_path, "--model.init_args.tie_weights", "false",
        "--model.init_args.backbone.init_args.output_size", "12",
        "--model.init_args.head", "configs/heads/mos.yaml",
    ])  # fmt: skip
    head = cli.model.head
    assert type(head) is MoSHead and head.num_components == 15  # the fragment's options
    assert head.hidden_size == 12 == cli.model.backbone.output_size
    assert head.vocab_size == 10_000 == cli.model.backbone.embedding.num_embeddings


def test_adaptive_config_trains_under_bf16_mixed(cli_run):
    cli = cli_run("fit", *ON_PTB,
                  "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "4",
                  "--trainer.limit_val_batches", "2", "--trainer.precision", "bf16-mixed",
                  "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
                  "--data.init_args.batch_size", "4", "--trainer.callbacks", "null",
                  experiment="ptb_adaptive")  # fmt: skip
    assert cli.model.head.cutoffs == [386, 3011, 10_000]
    for key in ("train/loss", "val/loss", "val/ppl"):
        assert torch.isfinite(cli.trainer.callback_metrics[key]), key


def test_compile_preset_trains_with_the_head_in_one_graph(cli_run):
    """``--config configs/presets/compile.yaml``: the head's training step compiled by
    torch.compile (inductor, CPU) with no graph break, the LSTM left eager; losses finite."""
    import torch._dynamo.utils

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cli = cli_run("fit", *ON_PTB, "--config", "configs/presets/compile.yaml",
                  "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
                  "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
                  "--trainer.enable_checkpointing", "false", "--data.init_args.batch_size", "4",
                  "--trainer.callbacks", "null", experiment="ptb_mixtape")  # fmt: skip
    assert cli.model.head._compiled_call_impl is not None
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    for key in ("train/loss", "val/loss"):
        assert torch.isfinite(cli.trainer.callback_metrics[key]), key
    torch._dynamo.reset()


def test_cuda_graphs_preset_trains_eagerly_on_a_cpu_and_refuses_ds(cli_run, caplog, capsys):
    """``--config configs/presets/cuda_graphs.yaml``: on a CPU the head runs eagerly (said
    once); a head whose sizes come from the batch (DS-Softmax's experts) is refused in one
    line."""
    short = ["--config", "configs/presets/cuda_graphs.yaml", "--trainer.max_epochs", "1",
             "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "1",
             "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
             "--data.init_args.batch_size", "4", "--trainer.callbacks", "null"]  # fmt: skip
    cli = cli_run("fit", *ON_PTB, *short, experiment="ptb_mixtape")
    assert cli.model._graphed_loss is not None and cli.model._graphed_loss.captured == 0
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert any("captured on CUDA only" in r.getMessage() for r in caplog.records)
    ds = ["--model.head.class_path", "heads.DSSoftmaxHead"]
    assert cli_run("fit", *ON_PTB, *short, *ds, experiment="ptb_softmax", console=True) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "DSSoftmaxHead" in err and "cuda_graphs false" in err


GPU_SHORT_FIT = ["--trainer.accelerator", "gpu", "--trainer.devices", "1",
                 "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "60",
                 "--trainer.limit_val_batches", "10", "--trainer.logger", "false",
                 "--trainer.enable_checkpointing", "false"]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "32-true"])
@pytest.mark.parametrize("config", ["ptb_softmax", "ptb_mos", "ptb_mixtape", "ptb_adaptive"])
def test_gpu_fit_learns_under_each_precision(config, precision, cli_run):
    cli = cli_run("fit", *ON_PTB, *GPU_SHORT_FIT, "--trainer.precision", precision,
                  "--trainer.callbacks", "null", experiment=config)  # fmt: skip
    assert cli.trainer.strategy.root_device.type == "cuda"  # (Lightning moves it back after fit)
    metrics = cli.trainer.callback_metrics
    for key in ("train/loss", "val/loss", "val/ppl"):
        assert torch.isfinite(metrics[key]), key
    assert metrics["val/ppl"] < 2000, metrics["val/ppl"]  # uniform over 10k words is 10000


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["ptb_softmax", "ptb_mos", "ptb_mixtape", "ptb_adaptive"])
def test_gpu_fit_learns_with_cuda_graphs(config, cli_run):
    """The head's step captured (one shape for the windows, one for the epoch's last; the
    adaptive softmax's PTB step is dense) and replayed through a short bf16 fit, and the
    model learns."""
    cli = cli_run("fit", *ON_PTB, *GPU_SHORT_FIT, "--trainer.precision", "bf16-mixed",
                  "--config", "configs/presets/cuda_graphs.yaml", "--trainer.callbacks", "null",
                  experiment=config)  # fmt: skip
    assert 1 <= cli.model._graphed_loss.captured <= 2
    metrics = cli.trainer.callback_metrics
    for key in ("train/loss", "val/loss", "val/ppl"):
        assert torch.isfinite(metrics[key]), key
    assert metrics["val/ppl"] < 2000, metrics["val/ppl"]


@pytest.mark.gpu
def test_gpu_ds_recipe_with_mitosis_under_16_mixed(tmp_path, cli_run):
    """Softmax LM, then DS-Softmax from it with a split, on CUDA in 16-mixed: the optimizer that
    mitosis rebuilds must keep working with Lightning's GradScaler."""
    gpu = ["--trainer.accelerator", "gpu", "--trainer.devices", "1",
           "--trainer.precision", "16-mixed", "--trainer.logger.init_args.save_dir", str(tmp_path),
           "--trainer.limit_train_batches", "30", "--trainer.limit_val_batches", "5"]  # fmt: skip
    cli_run("fit", *ON_PTB, *gpu, "--trainer.max_epochs", "1", experiment="ptb_softmax")
    softmax_ckpt = str(next(tmp_path.glob("ptb/*/checkpoints/last.ckpt")))
    cli = cli_run("fit", "--config", "configs/ds/ptb_ds.yaml", *ON_PTB, *gpu,
                  "--trainer.max_epochs", "3",
                  "--model.init_args.pretrained_checkpoint", softmax_ckpt)  # fmt: skip
    head = cli.model.head
    assert head.num_experts == 4  # split once, at epoch 2
    assert cli.trainer.strategy.root_device.type == "cuda"
    metrics = cli.trainer.callback_metrics
    for key in ("train/loss", "val/loss", "val/acc_top1"):
        assert torch.isfinite(metrics[key]), key


def test_help_says_what_the_app_is_and_where_its_configs_are(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["--help"])
    assert stopped.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "swappable output layers (heads)" in text and "configs/heads" in text
    assert "Lightning Trainer command line tool" not in text
