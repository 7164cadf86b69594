"""Issue 33, "the first hour with one's own corpus", end to end through ``cli.main``: training
without validation, and the classic PTB recipe's config."""

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")
SMALL = [
    "--model.init_args.backbone.init_args.embedding_size", "16",
    "--model.init_args.backbone.init_args.hidden_size", "16",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--data.init_args.batch_size", "4",
]  # fmt: skip


def on_ptb(config: str, ptb_path: str, logs) -> list[str]:
    """The options of a small model of ``config`` on PTB, logging under ``logs``."""
    return ["--config", config, "--data.init_args.path", ptb_path,
            "--trainer.logger.init_args.save_dir", str(logs), *SMALL]  # fmt: skip


def test_fit_without_validation_completes(cli_run, ptb_path, tmp_path):
    # ReduceLROnPlateau on val/loss and ModelCheckpoint on val/loss, yet no validation at all
    cli = cli_run("fit", *on_ptb("configs/lm/ptb.yaml", ptb_path, tmp_path),
                  "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3",
                  "--trainer.limit_val_batches", "0")  # fmt: skip
    trainer = cli.trainer
    assert trainer.current_epoch == 2 and trainer.global_step == 6
    assert "val/loss" not in trainer.callback_metrics
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.002)  # never stepped
    assert list(tmp_path.rglob("last.ckpt"))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


def test_plateau_steps_only_after_a_validation(cli_run, ptb_path, tmp_path):
    # validation every 2nd epoch: on the others val/loss is missing (epoch 0) or stale
    # (epoch 2), and stepping on a stale value with patience 0 would halve the rate
    cli = cli_run("fit", *on_ptb("configs/lm/ptb.yaml", ptb_path, tmp_path),
                  "--trainer.max_epochs", "4", "--trainer.limit_train_batches", "2",
                  "--trainer.limit_val_batches", "1", "--trainer.check_val_every_n_epoch", "2",
                  "--trainer.callbacks", "null")  # fmt: skip
    scheduler = cli.trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 2  # after the validations of epochs 1 and 3 only


def test_classic_ptb_recipe_resolves_and_trains_one_step(cli_run, ptb_path, tmp_path):
    cli = cli_run("fit", *on_ptb("configs/lm/ptb_classic.yaml", ptb_path, tmp_path),
                  "--trainer.fast_dev_run", "1")  # fmt: skip
    model, trainer = cli.model, cli.trainer
    assert trainer.global_step == 1
    backbone = model.backbone
    assert isinstance(backbone.hidden_dropout, torch.nn.Dropout)  # standard, not locked
    assert backbone.hidden_dropout.p == 0.5 and len(backbone.layers) == 2
    assert model.head.weight is not backbone.embedding.weight  # untied
    optimizer = trainer.optimizers[0]
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["lr"] == 20.0
    plateau = trainer.lr_scheduler_configs[0].scheduler
    assert (plateau.factor, plateau.patience) == (0.25, 0)
    assert trainer.gradient_clip_val == 0.25 and cli.datamodule.hparams.bptt == 35
