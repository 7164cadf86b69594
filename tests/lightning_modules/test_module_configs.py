"""A checkpoint written by the CLI loads in Python by its path alone; one of a model built in
Python says what to pass."""

import io

import lightning as L
import pytest
import torch

from app.cli.lightning_cli import build
from datamodules import SyntheticHierarchyDataModule
from heads import DSSoftmaxHead, SoftmaxHead
from lightning_modules import Classifier
from lightning_modules.backbones import MLPBackbone
from lightning_modules.errors import ModelConfigError
from lightning_modules.module_configs import MODULE_CONFIGS_KEY


def test_a_pruned_and_split_ds_head_comes_back_with_its_structure(tmp_path):
    """The DS recipe through the CLI's objects (Mitosis splits 10 -> 20 experts, pruning on):
    the rebuilt head starts at the configured 10 experts and takes the checkpoint's structure."""
    cli = build(
        ["configs/ds/synthetic_hierarchy.yaml"],
        ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "3",
         "--trainer.limit_val_batches", "1", "--trainer.logger", "false",
         "--trainer.default_root_dir", str(tmp_path),  # its config.yaml: not in the cwd
         "--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false",
         "--trainer.callbacks+=app.callbacks.Mitosis",
         "--trainer.callbacks.max_experts", "20", "--trainer.callbacks.every_n_epochs", "1"],
    )  # fmt: skip
    cli.trainer.fit(cli.model, cli.datamodule)
    path = tmp_path / "ds.ckpt"
    cli.trainer.save_checkpoint(path)
    assert (
        torch.load(path, weights_only=False)[MODULE_CONFIGS_KEY]["head"]["init_args"]["num_experts"]
        == 10
    )
    loaded = Classifier.load_from_checkpoint(str(path))
    assert type(loaded.head) is DSSoftmaxHead and loaded.head.num_experts == 20
    state = cli.model.state_dict()
    assert loaded.state_dict().keys() == state.keys()
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, state[name], msg=name)
    from_file = Classifier.load_from_checkpoint(io.BytesIO(path.read_bytes()))  # an open file
    assert from_file.head.num_experts == 20


def test_a_model_built_in_python_needs_its_modules_given(tmp_path):
    dm = SyntheticHierarchyDataModule(num_super=2, num_sub=2, train_per_sub=8, batch_size=8)

    def modules() -> dict:
        torch.manual_seed(0)
        return dict(backbone=MLPBackbone(dm.input_size, 8), head=SoftmaxHead(8, dm.vocab_size))

    model = Classifier(**modules(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, dm)
    path = tmp_path / "python.ckpt"
    trainer.save_checkpoint(path)
    with pytest.raises(ModelConfigError, match=r"no backbone and head configs .* backbone=\.\.\."):
        Classifier.load_from_checkpoint(str(path))
    loaded = Classifier.load_from_checkpoint(str(path), **modules())
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[name], msg=name)
