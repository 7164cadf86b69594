"""A fit stopped inside an epoch and resumed with another ``--trainer.precision``
(``cli.py fit --ckpt_path last.ckpt --trainer.precision ...``).

The checkpoint carries the LSTM's recurrent state between windows in the dtype the run had
(``lightning_modules/epoch_resume.py``). Resumed at another true precision, that state went
into the LSTM beside weights of another dtype: ``bf16-true`` resumed under ``32-true`` stopped
with "could not create a primitive descriptor for the LSTM forward propagation primitive",
``32-true`` under ``bf16-true`` or ``64-true`` with "mat1 and mat2 must have the same dtype".
The state now takes the backbone's dtype (``LanguageModel.continue_epoch_state``)."""

from __future__ import annotations

import pytest
import torch

from heads import SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone
from tests.test_bad_input import tiny_lm, write_lm_corpus

pytestmark = pytest.mark.usefixtures("cli_argv")

WORDS = "one two three four five six seven eight nine ten red blue green".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_lm_corpus(tmp_path_factory.mktemp("precision-corpus"), WORDS)


def _fit(cli_run, corpus: str, folder, precision: str, steps: int, *options: str):
    return cli_run("fit", *tiny_lm(corpus), "--trainer.precision", precision,
                   "--trainer.max_steps", str(steps), "--trainer.enable_checkpointing", "true",
                   "--trainer.callbacks", "app.callbacks.ModelCheckpoint",
                   "--trainer.callbacks.dirpath", str(folder),
                   "--trainer.callbacks.save_last", "true", *options)  # fmt: skip


@pytest.mark.parametrize(
    ("trained", "resumed", "dtype"),
    [("bf16-true", "32-true", torch.float32), ("32-true", "bf16-true", torch.bfloat16),
     ("32-true", "64-true", torch.float64)],
)  # fmt: skip
def test_a_fit_stopped_mid_epoch_resumes_at_another_precision(
    cli_run, corpus, tmp_path, trained, resumed, dtype
):
    _fit(cli_run, corpus, tmp_path, trained, 1)  # 1 of the epoch's 2 batches: mid-epoch
    last = tmp_path / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=False)
    state = saved["train_epoch_state"]["state"]
    assert state is not None  # a recurrent state to carry
    cli = _fit(cli_run, corpus, tmp_path, resumed, 2, "--ckpt_path", str(last))
    assert cli.trainer.global_step == 2
    assert cli.model.backbone.embedding.weight.dtype == dtype
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_the_carried_state_takes_the_backbones_dtype_exactly():
    """bfloat16 values are exact in float64: the state given back is the saved one, upcast."""
    model = LanguageModel(LSTMBackbone(20, 8, 8, num_layers=1), SoftmaxHead(8, 20)).double()
    generator = torch.Generator().manual_seed(0)
    saved = [tuple(torch.randn(1, 3, 8, generator=generator).bfloat16() for _ in range(2))]
    model.continue_epoch_state(saved)
    carried = model.epoch_state()
    for got, want in zip(carried[0], saved[0], strict=True):
        assert got.dtype == torch.float64
        assert torch.equal(got, want.double())
    hidden, _ = model.backbone(torch.zeros(3, 4, dtype=torch.long), carried)
    assert hidden.dtype == torch.float64


@pytest.fixture(scope="module")
def float32_checkpoint(cli_run, corpus, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("precision-f32")
    _fit(cli_run, corpus, folder, "32-true", 1)
    return str(folder / "last.ckpt")


def _warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]


def test_a_fit_resumed_at_another_precision_says_it_is_not_exact(
    cli_run, corpus, float32_checkpoint, tmp_path, capsys
):
    capsys.readouterr()
    _fit(cli_run, corpus, tmp_path, "bf16-true", 2, "--ckpt_path", float32_checkpoint)
    assert (
        f"warning: trainer.precision bf16-true: the checkpoint's weights are float32, and this "
        f"fit goes on in bfloat16 (its optimizer's state too): it does not resume exactly "
        f"where the run stopped (--ckpt_path {float32_checkpoint})"
    ) in _warnings(capsys)


@pytest.mark.parametrize(
    ("precision", "said"),
    [("bf16-true", True), ("64-true", False), ("bf16-mixed", False), ("32-true", False)],
)
def test_an_evaluation_says_where_it_rounds_the_weights(
    cli_run, corpus, float32_checkpoint, capsys, precision, said
):
    capsys.readouterr()
    cli_run("validate", *tiny_lm(corpus), "--ckpt_path", float32_checkpoint,
            "--trainer.precision", precision)  # fmt: skip
    line = (
        f"warning: trainer.precision {precision}: the checkpoint's float32 weights are rounded "
        f"to bfloat16 for this validate (--ckpt_path {float32_checkpoint})"
    )
    assert _warnings(capsys) == ([line] if said else [])
