"""A pretrained checkpoint against the run that starts from it: sizes when the weights load,
the vocabulary itself at setup, each mismatch one line naming the option."""

from types import SimpleNamespace

import pytest
import torch

from datamodules import LanguageModelingDataModule
from datamodules.errors import VocabularyMismatchError
from heads import MoSHead, SoftmaxHead
from lightning_modules import LanguageModel
from lightning_modules.backbones import LSTMBackbone
from lightning_modules.epoch_resume import TRAIN_STATE_KEY
from lightning_modules.errors import ModelConfigError
from lightning_modules.head_task import warn_once
from lightning_modules.pretrained import Pretrained
from tests.datamodules.test_cache import write_corpus


def data(folder) -> LanguageModelingDataModule:
    return LanguageModelingDataModule(path=str(folder), batch_size=2, bptt=3)


def language_model(vocab_size: int, head=None, **options) -> LanguageModel:
    torch.manual_seed(0)
    backbone = LSTMBackbone(vocab_size, embedding_size=8, hidden_size=8)
    return LanguageModel(backbone, head or SoftmaxHead(8, vocab_size), **options)


def save_trained(tmp_path, datamodule) -> tuple[str, LanguageModel]:
    """A checkpoint as fit writes one: weights, head class, the data module's state and
    hyperparameters."""
    trained = language_model(datamodule.vocab_size)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)  # not the fresh model's weights
    checkpoint = {
        "state_dict": trained.state_dict(),
        "head_class": "heads.softmax.SoftmaxHead",
        "datamodule_hyper_parameters": dict(datamodule.hparams),
        type(datamodule).__qualname__: datamodule.state_dict(),
        TRAIN_STATE_KEY: {"state": [torch.zeros(2, 8)]},
    }
    path = tmp_path / "trained.ckpt"
    torch.save(checkpoint, path)
    return str(path), trained


def set_up(model: LanguageModel, datamodule) -> None:
    model._trainer = SimpleNamespace(datamodule=datamodule)
    model._pretrained.check_data(datamodule)


def test_the_same_data_starts_from_the_trained_weights(tmp_path):
    corpus = data(write_corpus(tmp_path / "a"))
    path, trained = save_trained(tmp_path, corpus)
    model = language_model(corpus.vocab_size, pretrained_checkpoint=path)
    for name, value in trained.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value)
    set_up(model, data(tmp_path / "a"))  # its vocabulary: accepted
    kept = model._pretrained.entries  # what it was trained on, not its weights or state
    assert "state_dict" not in kept and TRAIN_STATE_KEY not in kept


def test_another_backbone_is_one_line_naming_a_missing_weight(tmp_path):
    corpus = data(write_corpus(tmp_path / "a"))
    path, _ = save_trained(tmp_path, corpus)
    backbone = LSTMBackbone(corpus.vocab_size, embedding_size=8, hidden_size=8, num_layers=3)
    with pytest.raises(ModelConfigError) as raised:
        LanguageModel(backbone, SoftmaxHead(8, corpus.vocab_size), pretrained_checkpoint=path)
    message = str(raised.value)
    assert "does not fit this model's backbone: Missing key(s) in state_dict" in message
    assert "\n" not in message and len(message) < 600


def test_another_vocabulary_size_is_one_line_naming_the_data_it_was_trained_on(tmp_path):
    corpus = data(write_corpus(tmp_path / "a"))
    path, _ = save_trained(tmp_path, corpus)
    with pytest.raises(ModelConfigError) as raised:
        language_model(corpus.vocab_size + 1, pretrained_checkpoint=path)
    message = str(raised.value)
    assert message.startswith(f"model.pretrained_checkpoint {path!r} does not fit this model's "
                              f"backbone: size mismatch for embedding.weight")  # fmt: skip
    assert f"trained on data.path {str(tmp_path / 'a')!r} (data.vocab 'word')" in message
    assert "\n" not in message


def test_another_vocabulary_of_the_same_size_is_refused_at_setup(tmp_path):
    corpus = data(write_corpus(tmp_path / "a"))
    path, _ = save_trained(tmp_path, corpus)
    other = data(write_corpus(tmp_path / "b", train="x y z\ny z\nz\n", valid="x z\n", test="y\n"))
    assert other.vocab_size == corpus.vocab_size  # the weights load: shapes cannot tell
    model = language_model(other.vocab_size, pretrained_checkpoint=path)
    with pytest.raises(VocabularyMismatchError, match=f"^model.pretrained_checkpoint {path!r}: "
                       "the checkpoint was trained with another vocabulary"):  # fmt: skip
        set_up(model, other)
    model._trainer = SimpleNamespace(datamodule=other)
    with pytest.raises(VocabularyMismatchError):  # the task's own setup runs the check
        model.setup("validate")


class Recorder:
    """A data module's stand-in, under the class name the checkpoint keeps the state by."""

    def __init__(self) -> None:
        self.loaded = []

    def load_state_dict(self, state) -> None:
        self.loaded.append(state)


Recorder.__qualname__ = LanguageModelingDataModule.__qualname__


def test_the_data_module_takes_the_checkpoints_state(tmp_path):
    """As ``fit --ckpt_path`` restores it (a re-learnt Hybrid-LightRNN table)."""
    corpus = data(write_corpus(tmp_path / "a"))
    path, _ = save_trained(tmp_path, corpus)
    recorder = Recorder()
    model = language_model(corpus.vocab_size, pretrained_checkpoint=path)
    set_up(model, recorder)
    assert recorder.loaded == [corpus.state_dict()]


def test_a_head_that_cannot_start_from_the_trained_one_is_said_to_start_untrained(tmp_path, caplog):
    corpus = data(write_corpus(tmp_path / "a"))
    path, trained = save_trained(tmp_path, corpus)
    head = MoSHead(8, corpus.vocab_size, num_components=2)
    fresh = {k: v.clone() for k, v in head.state_dict().items()}
    with caplog.at_level("INFO"):
        model = language_model(corpus.vocab_size, head=head, pretrained_checkpoint=path)
    assert "MoSHead starts untrained: the pretrained checkpoint's head " in caplog.text
    for name, value in fresh.items():
        torch.testing.assert_close(model.head.state_dict()[name], value)
    torch.testing.assert_close(model.backbone.embedding.weight, trained.backbone.embedding.weight)


def test_the_data_is_named_as_the_options_that_give_it():
    def named(**hp):
        return Pretrained("p.ckpt", {"datamodule_hyper_parameters": {"vocab": "bpe", **hp}}).data()

    assert named(path=None) == "the shipped corpus (no data.path) (data.vocab 'bpe')"
    assert named(path="/c") == "data.path '/c' (data.vocab 'bpe')"
    assert named(path=None, hub="wikitext") == "data.hub 'wikitext' (data.vocab 'bpe')"
    assert Pretrained("p.ckpt", {}).data() == "data it does not record"


def test_a_frozen_backbone_with_nothing_to_start_from_is_warned_of(tmp_path, caplog):
    """``freeze_backbone`` (the DS recipes) without ``pretrained_checkpoint``: a fresh fit
    would train a head over a random backbone; said once. Not where weights come from: the
    pretrained checkpoint, or a checkpoint the fit resumes."""
    corpus = data(write_corpus(tmp_path / "a"))
    path, _ = save_trained(tmp_path, corpus)
    warning = "warning: model.freeze_backbone: no model.pretrained_checkpoint"
    warn_once.cache_clear()
    for options, ckpt_path, warned in (
        ({}, None, True),
        ({"pretrained_checkpoint": path}, None, False),
        ({}, "resumed.ckpt", False),
        ({"freeze_backbone": False}, None, False),
    ):
        model = language_model(corpus.vocab_size, **{"freeze_backbone": True, **options})
        model._trainer = SimpleNamespace(ckpt_path=ckpt_path)
        caplog.clear()
        with caplog.at_level("WARNING"):
            model.on_fit_start()
        assert (warning in caplog.text) is warned, (options, ckpt_path)
        warn_once.cache_clear()


def test_a_tied_model_from_an_untied_checkpoint_says_which_matrix_it_starts_from(tmp_path, caplog):
    """Tied, the embedding and the output weights are one tensor: from an untied checkpoint
    it takes the output weights (loaded after the backbone), which is said."""
    corpus = data(write_corpus(tmp_path / "a"))
    path, trained = save_trained(tmp_path, corpus)  # untied: every weight + 1, apart
    with caplog.at_level("INFO"):
        model = language_model(corpus.vocab_size, tie_weights=True, pretrained_checkpoint=path)
    assert "the tied embedding starts from its output weights (head.weight)" in caplog.text
    torch.testing.assert_close(model.backbone.embedding.weight, trained.head.weight)


def test_a_checkpoint_of_another_task_is_one_line_naming_both(tmp_path):
    """A translation model's checkpoint given to a language model: its task named, not its
    weights' shapes reported as other data options."""
    corpus = data(write_corpus(tmp_path / "a"))
    path, _ = save_trained(tmp_path, corpus)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["hyper_parameters"] = {"_class_path": "lightning_modules.translation.Translation"}
    torch.save(checkpoint, path)
    with pytest.raises(ModelConfigError, match="is a Translation checkpoint .* LanguageModel"):
        language_model(corpus.vocab_size, pretrained_checkpoint=path)
    checkpoint["hyper_parameters"] = {"_class_path": "lightning_modules.LanguageModel"}
    torch.save(checkpoint, path)
    language_model(corpus.vocab_size, pretrained_checkpoint=path)  # its own task: loads
