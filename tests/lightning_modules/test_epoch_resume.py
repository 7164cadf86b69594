"""``lightning_modules/epoch_resume.py``: what a mid-epoch checkpoint keeps of the epoch and how
a rank reads its own share back; a task resumed at an epoch's end (its dropout generators, its
plateau step) and a translation resumed mid-epoch (its plateau step). The whole resume (every
task, DDP) is ``tests/test_resume.py``."""

import random
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.optim.lr_scheduler import ReduceLROnPlateau

from app.callbacks import ModelCheckpoint as AppModelCheckpoint
from datamodules import LanguageModelingDataModule, TranslationDataModule
from heads import SoftmaxHead
from lightning_modules import LanguageModel, Translation
from lightning_modules.backbones import LSTMBackbone, Seq2SeqTransformer
from lightning_modules.epoch_resume import read_epoch_state, rng_states, set_rng_states
from tests.datamodules.test_translation import TINY, write_corpus


def test_the_generators_given_back_draw_the_same_numbers_again():
    torch.manual_seed(3)
    saved = rng_states(torch.device("cpu"))
    first = torch.rand(5)
    torch.rand(100)  # the generator moves on
    set_rng_states(saved, torch.device("cpu"))
    assert torch.equal(torch.rand(5), first)


def test_a_ranks_row_of_gathered_states_is_given_back_whole():
    """Under DDP the states are stacked, one row a rank; row 1 is a view at an offset, which
    torch.set_rng_state would read from its storage's start."""
    states = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        states.append(rng_states(torch.device("cpu"))["cpu"])
    torch.manual_seed(2)
    expected = torch.rand(5)
    gathered = torch.stack(states)
    set_rng_states({"cpu": gathered[1]}, torch.device("cpu"))
    assert torch.equal(torch.rand(5), expected)


def test_on_cuda_the_devices_generator_is_kept_and_given_back(monkeypatch):
    """The CUDA branch, run without a GPU: the device's state is saved beside the CPU's and
    given back to that device from a contiguous CPU copy (as torch.cuda.set_rng_state wants)."""
    device = torch.device("cuda", 1)
    cuda_state = torch.arange(16, dtype=torch.uint8)
    calls = []
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda d: calls.append(("get", d)) or cuda_state
    )
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: calls.append(("set", s, d)))
    saved = rng_states(device)
    assert set(saved) == {"cpu", "cuda"} and torch.equal(saved["cuda"], cuda_state)
    gathered = torch.stack([torch.zeros(16, dtype=torch.uint8), saved["cuda"]])
    set_rng_states({"cpu": saved["cpu"], "cuda": gathered[1]}, device)
    (_, got), (_, given, to) = calls
    assert got == device and to == device
    assert torch.equal(given, cuda_state) and given.is_contiguous()
    assert given.storage_offset() == 0 and given.device.type == "cpu"
    calls.clear()
    set_rng_states(saved, torch.device("cpu"))  # a CUDA checkpoint resumed on a CPU: CPU only
    assert calls == []


def _trainer(world_size, rank=0):
    return SimpleNamespace(world_size=world_size, global_rank=rank)


def test_each_rank_reads_its_own_row_and_another_world_size_reads_nothing():
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    checkpoint = {
        "train_epoch_state": {
            "world_size": 2,
            "state": (rows, rows + 10),
            "metrics": {"train": {"total": torch.tensor([5.0, 6.0])}},
            "rng": {"cpu": torch.tensor([[7], [8]], dtype=torch.uint8)},
        }
    }
    mine = read_epoch_state(checkpoint, _trainer(2, rank=1))
    assert torch.equal(mine["state"][0], rows[1]) and torch.equal(mine["state"][1], rows[1] + 10)
    assert mine["metrics"]["train"]["total"].item() == 6.0
    assert mine["rng"]["cpu"].tolist() == [8]
    assert read_epoch_state(checkpoint, _trainer(1)) is None  # fewer ranks: the sums start anew
    assert read_epoch_state({}, _trainer(2)) is None
    del checkpoint["train_epoch_state"]["rng"]  # written before the generators were saved
    assert read_epoch_state(checkpoint, _trainer(2, rank=0))["rng"] is None
    one = {"language_model_train_state": {"world_size": 1, "state": None, "metrics": {}}}
    assert read_epoch_state(one, _trainer(1)) == {"rng": None, **one["language_model_train_state"]}


# -- whole fits: a resumed run ends with the uninterrupted run's weights and schedule ---------
def plateau(optimizer: torch.optim.Optimizer) -> ReduceLROnPlateau:
    # patience 0, and an improvement must halve the loss: every step after the first halves
    # the rate (a lost step shows in the rate too)
    return ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)


def plateau_language_model(path: str) -> tuple[LanguageModelingDataModule, LanguageModel]:
    """The resume tests' model: a small LSTM LM with dropout (the resumed run must draw the
    masks the uninterrupted one drew) and the ``plateau`` schedule, over the corpus at ``path``
    in windows of 4 x 8, its weights from seed 0."""
    data = LanguageModelingDataModule(path=path, batch_size=4, bptt=8)
    torch.manual_seed(0)
    backbone = LSTMBackbone(data.vocab_size, 16, 16, num_layers=1, input_dropout=0.3,
                            hidden_dropout=0.3, output_dropout=0.3)  # fmt: skip
    model = LanguageModel(backbone, SoftmaxHead(16, data.vocab_size),
                          optimizer=lambda p: torch.optim.Adam(p, 0.05),
                          scheduler=plateau)  # fmt: skip
    return data, model


def fit_trainer(epochs: int, folder, **options) -> L.Trainer:
    """A trainer that writes ``folder/last.ckpt`` at each epoch's end (the app's
    ModelCheckpoint, as the CLI's configs do; Lightning's writes it at the fit's end), and
    ``folder/step=N.ckpt`` every ``every_n_train_steps``."""
    every = options.pop("every_n_train_steps", None)
    checkpoints = [AppModelCheckpoint(dirpath=folder, save_last=True, save_top_k=0)]
    if every:
        checkpoints.append(ModelCheckpoint(dirpath=folder, every_n_train_steps=every,
                                           save_top_k=-1, filename="{step}"))  # fmt: skip
    defaults = dict(accelerator="cpu", logger=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0,
                    callbacks=checkpoints)  # fmt: skip
    return L.Trainer(max_epochs=epochs, **(defaults | options))


def schedule(trainer: L.Trainer) -> tuple[dict, float]:
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    return scheduler.state_dict(), trainer.optimizers[0].param_groups[0]["lr"]


def assert_same_weights(got: L.LightningModule, expected: L.LightningModule) -> None:
    for (name, value), other in zip(expected.state_dict().items(), got.state_dict().values(),
                                    strict=True):  # fmt: skip
        torch.testing.assert_close(other, value, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def markov(tmp_path_factory) -> str:
    """A Markov chain over 30 words (each word has a likely successor)."""
    rng = random.Random(0)
    folder = tmp_path_factory.mktemp("markov")
    for split, lines in (("train", 200), ("valid", 30), ("test", 30)):
        text = []
        for _ in range(lines):
            w, words = rng.randrange(30), []
            for _ in range(rng.randint(4, 10)):
                words.append(f"w{w}")
                w = (7 * w + 3) % 30 if rng.random() < 0.8 else rng.randrange(30)
            text.append(" ".join(words))
        (folder / f"m.{split}.txt").write_text("\n".join(text) + "\n")
    return str(folder)


def test_a_fit_resumed_at_an_epoch_end_draws_the_same_dropout_and_takes_its_plateau_step(
    markov, tmp_path, one_thread
):
    """``last.ckpt``, written at an epoch's end: the resumed run's dropout draws the masks the
    uninterrupted run drew (the generators were given back only mid-epoch), and the plateau
    step of that epoch is in the checkpoint (Lightning takes it after the checkpoint is
    written, and a resumed fit counts the epoch finished: the step was lost)."""

    def fit(epochs: int, folder, ckpt_path=None) -> tuple[LanguageModel, L.Trainer]:
        data, model = plateau_language_model(markov)
        trainer = fit_trainer(epochs, folder, limit_train_batches=5, limit_val_batches=2)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return model, trainer

    whole, whole_trainer = fit(4, tmp_path / "whole")
    fit(2, tmp_path / "first")
    resumed, resumed_trainer = fit(4, tmp_path / "resumed", str(tmp_path / "first/last.ckpt"))
    assert resumed_trainer.global_step == whole_trainer.global_step == 20
    state, lr = schedule(whole_trainer)
    assert state["last_epoch"] == 4 and lr == 0.05 / 8  # a step an epoch
    assert schedule(resumed_trainer) == (state, lr)
    assert_same_weights(resumed, whole)


def test_a_translation_resumed_mid_epoch_takes_the_epochs_plateau_step(tmp_path, one_thread):
    """Lightning takes no plateau step at the end of the epoch a fit resumed inside; the
    language model made it up in its on_train_epoch_end, the translation did not."""
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY[:5], "test_2016_flickr": TINY[:4]})

    def fit(folder, ckpt_path=None) -> tuple[Translation, L.Trainer]:
        data = TranslationDataModule(path=path, max_tokens=8)  # 6 batches an epoch
        torch.manual_seed(0)
        backbone = Seq2SeqTransformer(data.src_vocab_size, data.vocab_size, model_size=16,
                                      num_heads=2, encoder_layers=1, decoder_layers=1,
                                      feedforward_size=32, dropout=0.0)  # fmt: skip
        model = Translation(backbone, SoftmaxHead(16, data.vocab_size),
                            optimizer=lambda p: torch.optim.Adam(p, 0.05),
                            scheduler=plateau)  # fmt: skip
        trainer = fit_trainer(3, folder, every_n_train_steps=8, limit_val_batches=1)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
        return model, trainer

    whole, whole_trainer = fit(tmp_path / "whole")
    middle = tmp_path / "whole" / "step=8.ckpt"  # the 2nd batch of the second epoch
    resumed, resumed_trainer = fit(tmp_path / "resumed", str(middle))
    assert resumed_trainer.global_step == whole_trainer.global_step == 18
    state, lr = schedule(whole_trainer)
    assert state["last_epoch"] == 3 and lr < 0.05
    assert schedule(resumed_trainer) == (state, lr)
    assert_same_weights(resumed, whole)
