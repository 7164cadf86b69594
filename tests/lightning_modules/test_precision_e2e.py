"""The tasks' epoch metrics under Lightning's precisions: their sums stay float32 where the
model is made bfloat16 (``bf16-true``: ``module.to(dtype=...)``, which torchmetrics applies to
its states) and become float64 where it is made float64 (``64-true``: ``module.double()``,
which torchmetrics ignores). References: the per-batch losses summed in Python floats."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from datamodules.bptt import BPTTBatches
from heads import SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone
from lightning_modules.weighted_mean import WeightedMean
from lightning_modules.word_perplexity import update_word_sums, word_perplexity, word_sums

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, D = 40, 8


def _model() -> LanguageModel:
    torch.manual_seed(0)
    backbone = LSTMBackbone(VOCAB, embedding_size=D, hidden_size=D, input_dropout=0.0,
                            hidden_dropout=0.0, output_dropout=0.0)  # fmt: skip
    return LanguageModel(backbone, SoftmaxHead(D, VOCAB))


def _reference(model: LanguageModel, batches: list) -> float:
    """The token-weighted mean NLL of the split: each window's loss as the model computes it
    (in its own dtype), weighted and summed in Python floats (float64)."""
    total, tokens, state = 0.0, 0, None
    with torch.no_grad():
        for x, y in batches:
            hidden, state = model.backbone(x, state)
            loss = model.head(hidden.reshape(-1, D), y.reshape(-1)).loss
            total += float(loss) * y.numel()
            tokens += y.numel()
    return total / tokens


def _validate(model: LanguageModel, batches: list, precision: str) -> dict[str, torch.Tensor]:
    trainer = L.Trainer(precision=precision, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.validate(model, DataLoader(batches, batch_size=None), verbose=False)
    return dict(trainer.callback_metrics)


def _batches(length: int) -> list:
    tokens = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(0))
    return list(BPTTBatches(tokens, batch_size=4, bptt=7))


def test_bf16_true_validation_loss_is_summed_in_float32():
    """72 windows of 28 tokens: bfloat16 sums (8 bits) of about 100 per window and of the
    token counts (2,016, not a bfloat16 number) were off by percents."""
    batches = _batches(2020)
    model = _model()
    metrics = _validate(model, batches, "bf16-true")
    # the model Lightning validated, bfloat16 weights: its own window losses are the reference
    expected = _reference(model.to(torch.bfloat16), batches)
    assert metrics["val/loss"].dtype == torch.float32
    assert float(metrics["val/loss"]) == pytest.approx(expected, rel=1e-6)


def test_64_true_validation_loss_is_float64():
    """The float64 run's mean is float64 to float64 accuracy, not rounded to float32 (where
    its difference from a float32 run, about 1e-7 of it, vanished)."""
    batches = _batches(400)
    model = _model()
    metrics = _validate(model, batches, "64-true")
    expected = _reference(model.double(), batches)
    assert metrics["val/loss"].dtype == torch.float64
    assert float(metrics["val/loss"]) == pytest.approx(expected, rel=1e-13)
    assert float(metrics["val/ppl"]) == pytest.approx(math.exp(expected), rel=1e-13)


def test_weighted_mean_in_a_bfloat16_module_sums_in_float32():
    metrics = torch.nn.ModuleDict({"m": WeightedMean()}).to(dtype=torch.bfloat16)
    values = [5.3 + 0.01 * i for i in range(1000)]
    for v in values:
        metrics["m"].update(torch.tensor(v), weight=torch.tensor(700))
    mean = metrics["m"].compute()
    assert mean.dtype == torch.float32 and metrics["m"].weight.item() == 700_000
    assert mean.item() == pytest.approx(sum(values) / len(values), rel=1e-6)
    metrics["m"].reset()  # the defaults reset restores are float32 too
    assert metrics["m"].weighted_sum.dtype == torch.float32


def test_weighted_mean_in_a_float64_module_sums_in_float64():
    metrics = torch.nn.ModuleDict({"m": WeightedMean()}).double()
    values = [1.0 + 1e-9 * i for i in range(100)]  # differences float32 cannot hold
    for v in values:
        metrics["m"].update(torch.tensor(v, dtype=torch.float64), weight=3)
    mean = metrics["m"].compute()
    assert mean.dtype == torch.float64
    assert mean.item() == pytest.approx(sum(values) / len(values), rel=1e-15, abs=0)
    assert metrics["m"].to("cpu").weighted_sum.dtype == torch.float64  # a move keeps it


def test_word_sums_follow_the_same_rule():
    starts = torch.ones(VOCAB, dtype=torch.bool)
    sums = word_sums(["val"]).to(dtype=torch.bfloat16)
    for _ in range(300):  # 300 x 700 words: 210,000, past bfloat16's exact integers
        update_word_sums(sums, "val", starts, torch.full((700,), 4.3), torch.zeros(700).long())
    assert word_perplexity(sums, "val").item() == pytest.approx(math.exp(4.3), rel=1e-5)
    sums = word_sums(["val"]).double()
    nll = torch.tensor([1.0 + 1e-9, 2.0 - 3e-9], dtype=torch.float64)
    update_word_sums(sums, "val", starts, nll, torch.zeros(2).long())
    ppl = word_perplexity(sums, "val")
    assert ppl.dtype == torch.float64
    assert ppl.item() == pytest.approx(math.exp(1.5 - 1e-9), rel=1e-15)
