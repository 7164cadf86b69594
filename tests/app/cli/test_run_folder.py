"""TensorBoard tells the truth: a 2-epoch fit and a ``test`` of its ``last.ckpt`` through the CLI
give one run folder, one meaning per tag on the training step axis, and HPARAMS that compare
runs (issue 36)."""

import os
import re
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from jsonargparse import Namespace
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from app.cli.run_folder import (
    FLUSH_SECS,
    checkpoint_run_dir,
    configure_loggers,
    run_checkpoint,
)
from cli import main
from lightning_modules.errors import CheckpointPathError

pytestmark = pytest.mark.usefixtures("cli_argv")

TINY = [
    "--config", "configs/lm/ptb.yaml",
    "--model.init_args.backbone.init_args.embedding_size", "16",
    "--model.init_args.backbone.init_args.hidden_size", "16",
    "--data.init_args.batch_size", "4", "--trainer.enable_progress_bar", "false",
    "--trainer.limit_train_batches", "12", "--trainer.limit_val_batches", "8",
    "--trainer.limit_test_batches", "4", "--trainer.log_every_n_steps", "2",
]  # fmt: skip
# every tag of the run and what a reader needs of it; nothing else (no throughput counters,
# no validation figures at validation-batch steps)
EXPECTED_TAGS = {
    "epoch",  # Lightning's epoch number at each logged step
    "lr-Adam",
    "train/loss",  # per batch
    "train/ppl_batch",
    "train/loss_epoch",  # the epoch's token-weighted means
    "train/ppl",
    "train/tokens_per_sec",
    "time/train_epoch_s",
    "val/loss",
    "val/ppl",
    "val/tokens_per_sec",
    "hp_metric",
    "test/loss",
    "test/ppl",
    "test/tokens_per_sec",
}


@pytest.fixture(scope="module")
def fitted_and_tested(tmp_path_factory, ptb_path):
    logs = tmp_path_factory.mktemp("logs")
    common = [*TINY, "--data.init_args.path", ptb_path,
              "--trainer.logger.init_args.save_dir", str(logs)]  # fmt: skip
    fit = main(["fit", *common, "--trainer.max_epochs", "2"])
    ckpt = logs / "ptb" / "version_0" / "checkpoints" / "last.ckpt"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        test = main(["test", *common, "--ckpt_path", str(ckpt)])
    return fit, test, logs, [str(w.message) for w in caught]


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run))
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def hparams(run: Path) -> tuple[dict[str, object], list[str]]:
    """The HPARAMS tab's hyper-parameters of the run and the names of its metrics."""
    events = EventAccumulator(str(run))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"])
    values = {}
    for name, value in start.session_start_info.hparams.items():
        kind = value.WhichOneof("kind")
        values[name] = getattr(value, kind)
    metrics = [m.name.tag for m in experiment.experiment.metric_infos]
    return values, metrics


def test_fit_and_test_of_its_checkpoint_are_one_run_folder(fitted_and_tested):
    fit, test, logs, caught = fitted_and_tested
    runs = sorted(p.name for p in (logs / "ptb").iterdir())
    assert runs == ["version_0"]
    assert test.trainer.log_dir == fit.trainer.log_dir
    assert not [m for m in caught if "dirpath has changed" in m]
    run = logs / "ptb" / "version_0"
    # the run's config stays the fit's; the test's is beside it
    assert "ckpt_path" not in yaml.safe_load((run / "config.yaml").read_text()) or (
        yaml.safe_load((run / "config.yaml").read_text())["ckpt_path"] is None
    )
    assert (run / "test_config.yaml").is_file()


def test_tags_have_one_meaning_on_the_training_step_axis(fitted_and_tested):
    fit, _, logs, _ = fitted_and_tested
    logged = scalars(logs / "ptb" / "version_0")
    # (data/*: the corpus's figures, such as its share of unknown words, logged once)
    assert {tag for tag in logged if not tag.startswith("data/")} == EXPECTED_TAGS
    for tag, points in logged.items():
        steps = [step for step, _ in points]
        assert steps == sorted(steps), (tag, steps)
    last = fit.trainer.global_step - 1  # Lightning logs a batch at the steps done before it
    assert last == 23
    assert [s for s, _ in logged["val/ppl"]] == [11, last]
    for tag in ("test/loss", "test/ppl", "test/tokens_per_sec"):
        assert [s for s, _ in logged[tag]] == [last], tag
    # per batch and per epoch apart: one point per logged step, one per epoch
    assert [s for s, _ in logged["train/loss"]] == list(range(1, 24, 2))
    assert [s for s, _ in logged["train/loss_epoch"]] == [11, 23]


def test_hparams_name_the_head_and_hp_metric_is_the_best_validation_perplexity(
    fitted_and_tested,
):
    _, _, logs, _ = fitted_and_tested
    run = logs / "ptb" / "version_0"
    values, metrics = hparams(run)
    assert metrics == ["hp_metric"]
    assert values["head/class"] == "SoftmaxHead"
    assert values["head/zipf_bias_init"] == 1 and values["head/hidden_size"] == 16  # (bools as 1)
    assert values["backbone/class"] == "LSTMBackbone" and values["backbone/hidden_size"] == 16
    assert values["optimizer/class"] == "Adam" and values["optimizer/lr"] == pytest.approx(0.002)
    assert values["vocab"] == "word" and values["vocab_size"] == 10_000
    assert values["batch_size"] == 4 and values["bptt"] == 35
    logged = scalars(run)
    best = min(value for _, value in logged["val/ppl"])
    assert logged["hp_metric"][-1][1] == pytest.approx(best)
    assert all(value != -1 for _, value in logged["hp_metric"])
    saved = yaml.safe_load((run / "hparams.yaml").read_text())
    assert saved["head"]["class"] == "SoftmaxHead" and saved["vocab_size"] == 10_000


def test_tensorboard_flushes_within_30_seconds(fitted_and_tested):
    fit, *_ = fitted_and_tested
    assert fit.trainer.logger.experiment.flush_secs == FLUSH_SECS <= 30


def test_a_checkpoint_from_elsewhere_gets_an_eval_folder(fitted_and_tested, ptb_path, tmp_path):
    _, _, logs, _ = fitted_and_tested
    foreign = tmp_path / "downloaded" / "model.ckpt"
    foreign.parent.mkdir()
    foreign.write_bytes((logs / "ptb/version_0/checkpoints/last.ckpt").read_bytes())
    assert checkpoint_run_dir(str(foreign)) is None
    eval_logs = tmp_path / "logs"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = main(["validate", *TINY, "--data.init_args.path", ptb_path,
                    "--trainer.logger.init_args.save_dir", str(eval_logs),
                    "--ckpt_path", str(foreign)])  # fmt: skip
    assert Path(cli.trainer.log_dir) == eval_logs / "ptb" / "eval-model"
    assert not [w for w in caught if "dirpath has changed" in str(w.message)]
    logged = scalars(eval_logs / "ptb" / "eval-model")
    assert [s for s, _ in logged["val/ppl"]] == [23]


def test_an_evaluation_without_a_logger_leaves_the_working_folder_as_it_was(
    fitted_and_tested, ptb_path, tmp_path, monkeypatch
):
    _, _, logs, _ = fitted_and_tested
    config = str(Path(__file__).parents[3] / "configs/lm/ptb.yaml")
    monkeypatch.chdir(tmp_path)  # Lightning's log_dir without a logger: the working folder
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # e.g. self.log(..., logger=True) unheard
        main(["validate", *[config if a == "configs/lm/ptb.yaml" else a for a in TINY],
              "--data.init_args.path", ptb_path, "--trainer.logger", "false",
              "--ckpt_path", str(logs / "ptb/version_0/checkpoints/last.ckpt")])  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_ckpt_path_last_and_best_name_the_newest_runs_checkpoints(
    fitted_and_tested, ptb_path, tmp_path
):
    _, _, logs, _ = fitted_and_tested
    run = logs / "ptb" / "version_0"
    common = [*TINY, "--data.init_args.path", ptb_path,
              "--trainer.logger.init_args.save_dir", str(logs)]  # fmt: skip
    cli = main(["validate", *common, "--ckpt_path", "last"])
    assert cli.trainer.ckpt_path == str(run / "checkpoints" / "last.ckpt")
    assert Path(cli.trainer.log_dir) == run  # evaluated into the run's own folder
    best = main(["validate", *common, "--ckpt_path", "best"]).trainer.ckpt_path
    assert Path(best).parent == run / "checkpoints" and Path(best).name != "last.ckpt"
    # in a copy of the logs: a newer run without checkpoints is passed over, one with them taken
    copied = tmp_path / "ptb" / "version_0" / "checkpoints"
    shutil.copytree(run / "checkpoints", copied)
    (tmp_path / "ptb" / "version_7").mkdir()
    trainer = Namespace(logger=Namespace(
        class_path="lightning.pytorch.loggers.TensorBoardLogger",
        init_args=Namespace(save_dir=str(tmp_path), name="ptb", version=None)))  # fmt: skip
    assert run_checkpoint("last", trainer) == copied / "last.ckpt"
    newer = tmp_path / "ptb" / "version_10" / "checkpoints"
    shutil.copytree(copied, newer)
    assert run_checkpoint("last", trainer) == newer / "last.ckpt"  # 10 after 7 and 0
    trainer.logger.init_args.version = 0  # a logger's version, when set, is the run
    assert run_checkpoint("last", trainer) == copied / "last.ckpt"
    # best in a copy: the recorded path is the original's; the copy's own file is taken, and
    # without either the line names both
    assert run_checkpoint("best", trainer) == copied / Path(best).name
    shutil.move(run / "checkpoints" / Path(best).name, tmp_path / "kept.ckpt")
    try:
        (copied / Path(best).name).unlink()
        with pytest.raises(CheckpointPathError, match=r"recorded '.*' as its best checkpoint"):
            run_checkpoint("best", trainer)
    finally:
        shutil.move(tmp_path / "kept.ckpt", run / "checkpoints" / Path(best).name)


def test_ckpt_path_last_without_a_run_is_one_line(tmp_path):
    trainer = Namespace(logger=Namespace(
        class_path="lightning.pytorch.loggers.TensorBoardLogger",
        init_args=Namespace(save_dir=str(tmp_path), name="ptb", version=None)))  # fmt: skip
    with pytest.raises(CheckpointPathError, match="no run in .*ptb has checkpoints/last.ckpt"):
        run_checkpoint("last", trainer)
    assert run_checkpoint("last", trainer, missing_ok=True) is None
    with pytest.raises(CheckpointPathError, match="this run has no logger"):
        run_checkpoint("best", Namespace(logger=False))


def test_runs_that_keep_no_last_ckpt_are_named_with_their_newest_checkpoint(tmp_path):
    """A config whose ModelCheckpoint has no ``save_last`` writes ``epoch=0-step=2.ckpt`` and
    never a ``last.ckpt``: ``last`` names the newest file there, and a job's ``fit --ckpt_path
    last`` is refused too (it would otherwise start afresh on every requeue)."""
    trainer = Namespace(logger=Namespace(
        class_path="lightning.pytorch.loggers.TensorBoardLogger",
        init_args=Namespace(save_dir=str(tmp_path), name="ds", version=None)))  # fmt: skip
    older = tmp_path / "ds/version_0/checkpoints/epoch=0-step=2.ckpt"
    newer = tmp_path / "ds/version_1/checkpoints/epoch=3-step=8.ckpt"
    for age, path in ((100, older), (0, newer)):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
        os.utime(path, (time.time() - age, time.time() - age))
    (tmp_path / "ds/version_2/checkpoints").mkdir(parents=True)  # a run stopped before any
    for missing_ok in (False, True):
        with pytest.raises(CheckpointPathError) as error:
            run_checkpoint("last", trainer, missing_ok=missing_ok)
        assert str(error.value) == (
            f"ckpt_path 'last': no run in {tmp_path / 'ds'} has checkpoints/last.ckpt, but "
            f"{newer} is there (the run's ModelCheckpoint keeps no last.ckpt: save_last: true "
            f"does); give that file as --ckpt_path"
        )
    trainer.logger.init_args.version = 0  # a given version looks in that run alone
    with pytest.raises(CheckpointPathError, match=f"but {re.escape(str(older))} is there"):
        run_checkpoint("best", trainer)


def test_fit_ckpt_path_last_before_any_run_starts_from_scratch(ptb_path, tmp_path, capsys):
    """A job script passes ``--ckpt_path last`` on every start: the first one trains from
    scratch, saying where it looked (Lightning's meaning of "last" in fit); the next resumes."""
    common = [*TINY, "--data.init_args.path", ptb_path, "--trainer.limit_train_batches", "2",
              "--trainer.limit_val_batches", "1", "--trainer.logger.init_args.save_dir",
              str(tmp_path), "--ckpt_path", "last"]  # fmt: skip
    first = main(["fit", *common, "--trainer.max_epochs", "1"])
    assert first.trainer.global_step == 2 and first.trainer.ckpt_path is None
    err = capsys.readouterr().err
    assert f"warning: fit --ckpt_path last: no run in {tmp_path / 'ptb'} has a last.ckpt" in err
    second = main(["fit", *common, "--trainer.max_epochs", "2"])
    assert second.trainer.global_step == 4
    assert Path(second.trainer.ckpt_path) == tmp_path / "ptb/version_0/checkpoints/last.ckpt"


def test_a_fit_resumed_from_a_runs_checkpoint_continues_its_folder(tmp_path, monkeypatch):
    """``fit --ckpt_path`` of ``logs/ptb/version_3/checkpoints/x.ckpt`` with loggers in
    ``logs/ptb`` logs and checkpoints in ``version_3`` (it made ``version_4``: ModelCheckpoint,
    in another folder, forgot the run's best checkpoints), under the folder's name as the
    run's ModelCheckpoint recorded it (it compares the text of the path); TensorBoard hides
    what the stopped run logged after the checkpoint's step, and a CSV logger's earlier rows
    (it deletes metrics.csv) are kept."""
    monkeypatch.chdir(tmp_path)
    run = Path("logs/ptb/version_3")
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.csv").write_text("epoch,step,train/loss\n0,10,6.5\n0,11,6.4\n1,12,6.3\n")
    ckpt = run / "checkpoints" / "last.ckpt"
    recorded = {"dirpath": "logs/ptb/version_3/checkpoints", "best_model_path": "x"}
    callbacks = {"ModelCheckpoint{'monitor': 'val/loss'}": recorded}
    torch.save({"global_step": 12, "callbacks": callbacks}, ckpt)

    def loggers() -> Namespace:
        absolute = str(tmp_path / "logs")  # the run's ModelCheckpoint recorded logs/...
        return Namespace(logger=[
            Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                      init_args=Namespace(save_dir=absolute, name="ptb", version=None)),
            Namespace(class_path="lightning.pytorch.loggers.CSVLogger",
                      init_args=Namespace(save_dir="logs", name="ptb", version=None)),
        ])  # fmt: skip

    trainer = loggers()
    configure_loggers(trainer, "fit", str(ckpt))
    board, table = (logger.init_args for logger in trainer.logger)
    assert (board.save_dir, board.name, board.version) == ("logs", "ptb", "version_3")
    assert board.purge_step == 12
    assert (table.save_dir, table.name, table.version) == ("logs", "ptb", "version_3")
    assert not (run / "metrics.csv").exists()
    kept = ["epoch,step,train/loss", "0,10,6.5", "0,11,6.4"]
    assert (run / "metrics.before_step_12.csv").read_text().splitlines() == kept
    # stopped again before its next checkpoint and resumed from the same one: nothing lost
    (run / "metrics.csv").write_text("epoch,step,train/loss\n1,12,6.3\n1,13,6.2\n")
    configure_loggers(loggers(), "fit", str(ckpt))
    assert (run / "metrics.before_step_12.csv").read_text().splitlines() == kept
    # a logger's version, when set, is kept; a logger set to log elsewhere, a fresh fit, or
    # a checkpoint outside a run folder starts a new version
    trainer = loggers()
    trainer.logger[0].init_args.version = 7
    configure_loggers(trainer, "fit", str(ckpt))
    assert trainer.logger[0].init_args.version == 7
    assert trainer.logger[1].init_args.version == "version_3"
    trainer = loggers()
    trainer.logger[0].init_args.save_dir = str(tmp_path / "elsewhere")
    configure_loggers(trainer, "fit", str(ckpt))
    assert [logger.init_args.version for logger in trainer.logger] == [None, "version_3"]
    foreign = tmp_path / "model.ckpt"
    foreign.write_bytes(ckpt.read_bytes())
    for given in (None, str(foreign)):
        trainer = loggers()
        configure_loggers(trainer, "fit", given)
        assert [logger.init_args.version for logger in trainer.logger] == [None, None]


def test_a_log_folder_the_run_cannot_create_is_refused_before_anything_is_built(
    tmp_path, monkeypatch
):
    """Lightning met it at setup, after the data was prepared: an OSError traceback."""
    import errno
    import tempfile

    from app.cli.errors import CommandLineError
    from app.cli.run_folder import check_log_folders

    def trainer(save_dir: str) -> Namespace:
        logger = Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger",
                           init_args=Namespace(save_dir=save_dir, name="ptb"))  # fmt: skip
        return Namespace(logger=logger)

    fresh = tmp_path / "new" / "logs"
    check_log_folders(trainer(str(fresh)))  # a folder still to be made is fine...
    assert list(tmp_path.iterdir()) == []  # ...and nothing is left behind by the check
    (tmp_path / "file").write_text("")
    with pytest.raises(CommandLineError) as under_a_file:
        check_log_folders(trainer(str(tmp_path / "file" / "logs")))
    assert str(under_a_file.value) == (
        f"trainer.logger.init_args.save_dir '{tmp_path}/file/logs': '{tmp_path}/file' is a "
        f"file, not a folder; give a folder the run can write its logs and checkpoints in"
    )

    def read_only(**kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), kwargs.get("dir"))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(CommandLineError, match=re.escape(
        f"'{fresh}': cannot create a folder in '{tmp_path}' (Read-only file system)"
    )):  # fmt: skip
        check_log_folders(trainer(str(fresh)))
    no_logger = Namespace(logger=False, default_root_dir=str(fresh))
    with pytest.raises(CommandLineError, match=r"^trainer\.default_root_dir "):
        check_log_folders(no_logger)
