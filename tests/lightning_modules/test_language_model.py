import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from datamodules.bptt import BPTTBatches
from heads import AdaptiveSoftmaxHead, SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone
from lightning_modules.errors import ModelConfigError

VOCAB = 40


def make_model(**kwargs) -> LanguageModel:
    torch.manual_seed(0)
    backbone = LSTMBackbone(VOCAB, embedding_size=8, hidden_size=8, input_dropout=0.0,
                            hidden_dropout=0.0, output_dropout=0.0)  # fmt: skip
    return LanguageModel(backbone, SoftmaxHead(8, VOCAB), **kwargs)


def test_perplexity_is_token_weighted_over_the_split():
    """exp(total NLL / total tokens), with an uneven last window, recomputed by hand."""
    model = make_model().eval()
    tokens = torch.randint(0, VOCAB, (203,))
    loader = DataLoader(BPTTBatches(tokens, batch_size=4, bptt=7), batch_size=None)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    (result,) = trainer.validate(model, loader)

    total_nll, total_tokens, state = 0.0, 0, None
    with torch.no_grad():
        for x, y in BPTTBatches(tokens, batch_size=4, bptt=7):
            hidden, state = model.backbone(x, state)  # state carried across windows
            log_probs = model.head.log_prob(hidden.reshape(-1, 8))
            total_nll -= log_probs.gather(1, y.reshape(-1, 1)).sum().item()
            total_tokens += y.numel()
    assert total_tokens == 4 * (203 // 4 - 1)
    assert result["val/ppl"] == pytest.approx(math.exp(total_nll / total_tokens), rel=1e-5)


def test_state_is_carried_and_detached_in_training():
    model = make_model()
    batches = list(BPTTBatches(torch.randint(0, VOCAB, (200,)), batch_size=2, bptt=5))
    model._step(batches[0], "train")
    carried = model._state["train"]
    assert carried is not None and not carried[0][0].requires_grad
    loss = model._step(batches[1], "train")
    loss.backward()  # would fail if the graph of window 0 were still attached and freed
    model.on_train_epoch_start()
    assert "train" not in model._state


def test_tying_and_size_checks():
    model = make_model(tie_weights=True)
    assert model.head.weight is model.backbone.embedding.weight
    with pytest.raises(ValueError, match="must equal the backbone's output size"):
        LanguageModel(LSTMBackbone(VOCAB, hidden_size=8), SoftmaxHead(9, VOCAB))


def test_a_head_that_cannot_be_tied_names_the_option_that_unties_it():
    backbone = LSTMBackbone(VOCAB, embedding_size=8, hidden_size=8)
    head = AdaptiveSoftmaxHead(8, VOCAB, cutoffs=[5])
    with pytest.raises(ModelConfigError, match="AdaptiveSoftmaxHead does not support weight "
                       "tying: set model.tie_weights false"):  # fmt: skip
        LanguageModel(backbone, head, tie_weights=True)
    assert LanguageModel(backbone, head, tie_weights=False).head is head


def test_non_finite_loss_stops_with_the_head_named():
    model = make_model()
    with torch.no_grad():
        model.head.bias[0] = float("nan")
    batch = next(iter(BPTTBatches(torch.randint(0, VOCAB, (100,)), 2, 5)))
    with pytest.raises(FloatingPointError, match="SoftmaxHead"):
        model._step(batch, "train")


def test_model_summary_counts_the_flops_of_a_training_batch(tmp_path):
    """The summary's FLOPs column (Lightning fills it from ``example_input_array``, which
    ``setup("fit")`` builds from this rank's first training batch): the LSTM's and the
    softmax's matrix products, not zeros."""
    from lightning.pytorch.utilities.model_summary import ModelSummary

    from datamodules import LanguageModelingDataModule

    for split in ("train", "valid", "test"):
        (tmp_path / f"c.{split}.txt").write_text("a b c d e f g h i j\n" * 30)
    data = LanguageModelingDataModule(path=str(tmp_path), batch_size=3, bptt=5,
                                      cache_dir=str(tmp_path / "cache"))  # fmt: skip
    vocab, d = data.vocab_size, 8
    model = LanguageModel(LSTMBackbone(vocab, embedding_size=d, hidden_size=d, num_layers=2),
                          SoftmaxHead(d, vocab))  # fmt: skip
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, datamodule=data)
    inputs, targets = model.example_input_array
    assert inputs.shape == targets.shape == (3, 5)
    tokens = 3 * 5
    lstm = 2 * 2 * tokens * 4 * d * (d + d)  # two layers, W_ih and W_hh at every step
    softmax = 2 * tokens * d * vocab  # the logits (the fused loss's product)
    summary = ModelSummary(model, max_depth=1)
    flops = dict(zip(summary.layer_names, (sum(c.values()) for c in summary.flop_counts.values()),
                     strict=True))  # fmt: skip
    assert flops["backbone"] == lstm
    assert (flops["backbone"], flops["head"]) == (lstm, softmax)
    assert summary.total_flops == lstm + softmax
