"""Recompilations under ``model.compile`` where batches change shape: a translation batch's
``B x S`` and ``B x T`` change nearly every step (token-budget batching), and each
recompilation costs a GPU user seconds to minutes."""

from __future__ import annotations

import random

import lightning as L
import pytest
import torch

from heads import SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import NGramBackbone
from lightning_modules.backbones.seq2seq import Seq2SeqTransformer


@pytest.fixture
def dynamo_counters():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


def _batch(batch: int, source: int, target: int) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(1, 40, (batch, source))
    padding = torch.zeros(batch, source, dtype=torch.bool)
    padding[0, source - 2 :] = True  # one shorter sentence, as a length bucket has
    return ids, padding, torch.randint(1, 40, (batch, target))


@pytest.mark.slow  # about 60 s on 2 CPU cores: Inductor compiles three graphs
def test_the_compiled_translation_backbone_compiles_twice_for_any_batch_shapes(dynamo_counters):
    """Training: the first shape, then one graph symbolic in B, S and T (Dynamo's automatic
    dynamic shapes), whatever shapes follow, S equal to T included (one symbol for both
    would recompile at the next S != T); evaluation (no_grad) one graph more, also over
    shapes of its own, giving the eager forward's results. Not one compilation per shape."""
    torch.manual_seed(0)
    rng = random.Random(0)
    model = Seq2SeqTransformer(40, 40, model_size=8, num_heads=2, encoder_layers=1,
                               decoder_layers=1, feedforward_size=16, dropout=0.0)  # fmt: skip
    model.compile()
    shapes = [(30, 12, 15), (7, 9, 9)]  # the second, where shapes turn symbolic: S == T
    shapes += [(rng.randint(2, 40), rng.randint(3, 30), rng.randint(3, 30)) for _ in range(8)]
    for shape in shapes:
        model(*_batch(*shape)).sum().backward()
    assert dynamo_counters["stats"]["unique_graphs"] == 2, dict(dynamo_counters["stats"])
    model.eval()
    with torch.no_grad():
        for shape in [(5, 20, 11), (9, 4, 4), *shapes[:3]]:
            batch = _batch(*shape)  # the compiled forward against the module's own, eager
            torch.testing.assert_close(model(*batch), Seq2SeqTransformer.forward(model, *batch))
    assert dynamo_counters["stats"]["unique_graphs"] == 3, dict(dynamo_counters["stats"])
    assert not dynamo_counters["graph_break"], dict(dynamo_counters["graph_break"])


@pytest.mark.slow  # about 22 s on 2 CPU cores: Inductor compiles four graphs
def test_test_after_fit_reuses_the_compiled_evaluation_graphs(dynamo_counters, tmp_path):
    """Regression: ``trainer.test`` after ``trainer.fit`` in one process (the Python API, a
    notebook) recompiled the backbone and the head: fit's validation runs under no_grad,
    Lightning's test under inference_mode, and Dynamo guards on the inputs' dispatch keys.
    Compiled, the task evaluates under no_grad: test adds no graph, and its loss is the eager
    forward's."""
    from datamodules import LanguageModelingDataModule

    for split in ("train", "valid", "test"):
        (tmp_path / f"c.{split}.txt").write_text("a b c d e f g h i j\n" * 30)
    data = LanguageModelingDataModule(path=str(tmp_path), batch_size=3, bptt=5,
                                      cache_dir=str(tmp_path / "cache"))  # fmt: skip
    torch.manual_seed(0)
    model = LanguageModel(NGramBackbone(data.vocab_size, output_size=8),
                          SoftmaxHead(8, data.vocab_size), compile=True)  # fmt: skip
    trainer = L.Trainer(max_steps=2, limit_val_batches=1, limit_test_batches=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, datamodule=data)
    graphs = dynamo_counters["stats"]["unique_graphs"]
    assert graphs == 4, dict(dynamo_counters["stats"])  # backbone, head: training, evaluation
    (result,) = trainer.test(model, datamodule=data, verbose=False)
    assert dynamo_counters["stats"]["unique_graphs"] == graphs, dict(dynamo_counters["stats"])
    assert not dynamo_counters["graph_break"], dict(dynamo_counters["graph_break"])
    inputs, targets = next(iter(data.test_dataloader()))
    model.eval()
    with torch.no_grad():  # the modules' own forward: eager
        hidden, _ = type(model.backbone).forward(model.backbone, inputs)
        output = type(model.head).forward(model.head, hidden.reshape(-1, 8), targets.reshape(-1))
    assert result["test/loss"] == pytest.approx(output.loss.item(), rel=1e-5)
