"""A resumed fit keeps its run folder's ``config.yaml`` (how the run started) and writes its own
invocation beside it, as ``config.resumed_at_step_<N>.yaml`` (``app/cli/run_folder.py``)."""

import yaml

from tests.lightning_modules import test_epoch_resume

markov = test_epoch_resume.markov  # the fixture: a small corpus (a Markov chain over 30 words)

EPOCH = 4  # training batches per epoch
TINY_LM = [
    "--data.init_args.batch_size", "4", "--data.init_args.eval_batch_size", "4",
    "--data.init_args.bptt", "10",
    "--model.init_args.backbone.init_args.embedding_size", "16",
    "--model.init_args.backbone.init_args.hidden_size", "16",
    "--trainer.limit_train_batches", str(EPOCH), "--trainer.limit_val_batches", "1",
    "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
]  # fmt: skip


def test_a_resumed_fit_keeps_the_runs_config_and_writes_its_own_beside_it(
    cli_run, tmp_path, markov
):
    common = [*TINY_LM, "--data.init_args.path", markov,
              "--trainer.logger.init_args.save_dir", str(tmp_path)]  # fmt: skip
    cli_run("fit", *common, "--trainer.max_epochs", "1", experiment="ptb_softmax")
    run = tmp_path / "ptb" / "version_0"
    started = (run / "config.yaml").read_text()
    assert yaml.safe_load(started)["trainer"]["max_epochs"] == 1

    # more epochs, from the run's last.ckpt (the first epoch's end: step 4)
    cli_run("fit", *common, "--trainer.max_epochs", "3", "--ckpt_path", "last",
            experiment="ptb_softmax")  # fmt: skip
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]  # the same run
    assert (run / "config.yaml").read_text() == started  # Lightning's callback rewrote it
    resumed = yaml.safe_load((run / f"config.resumed_at_step_{EPOCH}.yaml").read_text())
    assert resumed["trainer"]["max_epochs"] == 3
    assert resumed["ckpt_path"] == str(run / "checkpoints" / "last.ckpt")
    assert yaml.safe_load(started)["ckpt_path"] is None
    assert sorted(p.name for p in run.glob("config*.yaml")) == [
        "config.resumed_at_step_4.yaml",
        "config.yaml",
    ]

    # the run's config reproduces it as it started: a new run, from scratch, its config.yaml
    again = cli_run("fit", "--config", str(run / "config.yaml"),
                    "--trainer.logger.init_args.version", "again")  # fmt: skip
    assert again.trainer.global_step == EPOCH
    assert (tmp_path / "ptb" / "again" / "config.yaml").is_file()
    assert not list((tmp_path / "ptb" / "again").glob("config.resumed*"))
