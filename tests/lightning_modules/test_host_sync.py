"""No host sync in a training or validation step (issue 28, point 2).

A host sync stalls the GPU until everything queued has run: ``.item()``, ``float(t)``,
``bool(t)`` / ``if t:``, ``.tolist()``, ``.cpu()``, ``.numpy()``, ``.nonzero()``, boolean-mask
indexing, a Python list copied to the device (``torch.tensor(list, device=...)``), and the ops
whose output size depends on the data (``repeat_interleave`` without ``output_size``,
``unique``, ``bincount``, ``masked_select``). The sentinel below records every such call made
from Python while a step runs, in a real ``Trainer.fit`` of every head in both tasks: the
window is ``training_step`` through ``backward``, and ``validation_step``. Lightning's own work
between the hooks (logging, the finite-loss read-back at the logging interval) is outside it;
that the progress bar reads nothing back per batch either is
``tests/app/callbacks/training/test_progress.py``'s.

One read-back per step is allowed to heads whose work has a data-dependent shape (adaptive
clusters, DS experts): all group sizes in one ``tolist`` (``heads.base.sort_into_groups``).

On a CPU these calls cost nothing, so the test looks at the calls, not at timings; the GPU test
under ``torch.cuda.set_sync_debug_mode("error")`` also sees syncs made inside C++ ops.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from datamodules import TranslationDataModule
from datamodules.bptt import BPTTBatches
from heads import AdaptiveSoftmaxHead, DSSoftmaxHead, MixtapeHead, MoSHead, SoftmaxHead
from heads.fused_cross_entropy import LossOptions
from heads.kernels import chunks
from lightning_modules import LanguageModel, Translation
from lightning_modules.backbones import LSTMBackbone, Seq2SeqTransformer
from lightning_modules.decoding import DecodeConfig
from lightning_modules.errors import NonFiniteLossError
from tests.datamodules.test_translation import TINY, write_corpus

REPO = Path(__file__).resolve().parents[2]
D = 16

pytestmark = pytest.mark.usefixtures("one_thread")

# Tensor methods that read a value back to the host (or whose output size depends on the data)
READ_BACK = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
             "nonzero", "masked_select", "unique", "unique_consecutive", "bincount")  # fmt: skip
# torch functions of the same kind
FUNCTIONS = ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount")


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _has_tensor_repeats(args, kwargs) -> bool:
    repeats = kwargs.get("repeats", args[0] if args else None)
    return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None


class SyncSentinel:
    """Records, while :attr:`active`, every host read-back made from Python, with the line of
    project code (or, failing that, the innermost line) that made it."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[tuple[str, str]] = []

    def record(self, name: str) -> None:
        self.active = False  # the stack walk below must not record itself
        try:
            frames = traceback.extract_stack()[:-3]
            ours = [
                f for f in frames
                if f.filename.startswith(str(REPO)) and "/tests/" not in f.filename
            ]  # fmt: skip
            frame = (ours or frames)[-1]
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            if ours:
                where = f"{Path(frame.filename).relative_to(REPO)}:{frame.lineno}"
            self.calls.append((name, where))
        finally:
            self.active = True

    def _wrap(self, name: str, original, when=None):
        sentinel = self

        @functools.wraps(original)
        def patched(*args, **kwargs):
            if sentinel.active and (when is None or when(args, kwargs)):
                sentinel.record(name)
            return original(*args, **kwargs)

        return patched

    @contextlib.contextmanager
    def installed(self, monkeypatch: pytest.MonkeyPatch):
        for name in READ_BACK:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))
        for name in FUNCTIONS:
            monkeypatch.setattr(torch, name, self._wrap(f"torch.{name}", getattr(torch, name)))
        monkeypatch.setattr(
            torch.Tensor, "repeat_interleave",
            self._wrap("repeat_interleave", torch.Tensor.repeat_interleave,
                       lambda a, k: _has_tensor_repeats(a[1:], k)),
        )  # fmt: skip
        monkeypatch.setattr(
            torch, "repeat_interleave",
            self._wrap("torch.repeat_interleave", torch.repeat_interleave,
                       lambda a, k: _has_tensor_repeats(a[1:], k)),
        )  # fmt: skip
        # a Python value copied to the device: a blocking host-to-device copy on a GPU
        for name in ("tensor", "as_tensor"):
            monkeypatch.setattr(
                torch, name,
                self._wrap(f"torch.{name}(..., device=)", getattr(torch, name),
                           lambda a, k: k.get("device") is not None),
            )  # fmt: skip
        monkeypatch.setattr(torch.Tensor, "new_tensor",
                            self._wrap("new_tensor", torch.Tensor.new_tensor))  # fmt: skip
        # boolean-mask indexing seen through a torch-function mode: patching the class's
        # __getitem__ leaves CPython's sequence slot on torch.Tensor once it is removed, and
        # every later torch.tensor([0-d tensors, ...]) then fails ("len() of a 0-d tensor")
        with _BoolMaskIndexing(self):
            yield self


class _BoolMaskIndexing(torch.overrides.TorchFunctionMode):
    """Records ``t[mask]`` and ``t[mask] = v`` with a boolean mask on ``sentinel``."""

    NAMES = {torch.Tensor.__getitem__: "bool-mask []", torch.Tensor.__setitem__: "bool-mask []="}

    def __init__(self, sentinel: SyncSentinel) -> None:
        super().__init__()
        self.sentinel = sentinel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = self.NAMES.get(func)
        if name is not None and self.sentinel.active and _is_bool_index(args[1]):
            self.sentinel.record(name)
        # a patched read-back (``SyncSentinel._wrap``) comes here as itself: its call was
        # recorded already, so the original runs
        return getattr(func, "__wrapped__", func)(*args, **(kwargs or {}))


class StepWindows:
    """Wraps a module's ``training_step`` + ``backward`` and ``validation_step``: each is one
    window, whose recorded calls are kept per window."""

    def __init__(self, model: L.LightningModule, sentinel: SyncSentinel) -> None:
        self.sentinel = sentinel
        self.windows: list[tuple[str, list[tuple[str, str]]]] = []
        training_step, backward = model.training_step, model.backward
        validation_step = model.validation_step

        def open_window(stage: str) -> None:
            sentinel.calls = []
            sentinel.active = True
            self.windows.append((stage, sentinel.calls))

        def close_window() -> None:
            sentinel.active = False

        def wrapped_training_step(*args, **kwargs):
            open_window("train")
            try:
                return training_step(*args, **kwargs)
            finally:
                sentinel.active = False

        def wrapped_backward(*args, **kwargs):
            sentinel.active = True  # the same window as the step that made the loss
            try:
                return backward(*args, **kwargs)
            finally:
                close_window()

        def wrapped_validation_step(*args, **kwargs):
            open_window("val")
            try:
                return validation_step(*args, **kwargs)
            finally:
                close_window()

        model.training_step = wrapped_training_step
        model.backward = wrapped_backward
        model.validation_step = wrapped_validation_step


def trainer() -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, limit_train_batches=2, limit_val_batches=2,
        num_sanity_val_steps=0, log_every_n_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip


def ds_head(hidden_size: int, vocab_size: int) -> DSSoftmaxHead:
    """DS-Softmax with every loss term on (both lassos, load balance, bias) and some rows
    pruned, so the pruned classes' constant enters the normaliser."""
    head = DSSoftmaxHead(hidden_size, vocab_size, num_experts=3, lambda_lasso=1e-3,
                         lambda_expert=1e-3, lambda_load=10.0, bias=True)  # fmt: skip
    norms = torch.linalg.vector_norm(head.weight.detach(), dim=1)
    assert head.prune(float(norms.median())) is not None
    return head


def plain(head, plan: str = "plain"):
    """``head`` with its classifiers as plain maths (CUDA's ``auto`` for small ones), or
    another ``plan``."""
    head.loss_options = LossOptions(plan=plan)
    return head


HEADS = {
    "softmax": (SoftmaxHead, 0),
    "mos": (functools.partial(MoSHead, num_components=3), 0),
    "mixtape": (functools.partial(MixtapeHead, num_components=4, frequent_ratio=0.5), 0),
    # CUDA's auto for large steps: the whole vocabulary by row tiles, gate noise drawn there
    "mixtape_rows": (
        lambda d, v: plain(MixtapeHead(d, v, frequent_ratio=0.5, gate_noise=0.1), "rows"),
        0,
    ),  # fmt: skip
    # the cluster sizes counted on the host from the batch (Head.expect_targets): none read back
    "adaptive": (lambda d, v: AdaptiveSoftmaxHead(d, v, cutoffs=[v // 4, v // 2]), 0),
    "adaptive_plain": (lambda d, v: plain(AdaptiveSoftmaxHead(d, v, cutoffs=[v // 4, v // 2])), 0),
    "ds": (ds_head, 1),
}


def assert_no_sync(windows: StepWindows, allowed_tolist: int) -> None:
    stages = [stage for stage, _ in windows.windows]
    assert stages.count("train") == 2 and stages.count("val") >= 1, stages
    for stage, calls in windows.windows:
        reads = [c for c in calls if c[0] == "tolist"]
        others = [c for c in calls if c[0] != "tolist"]
        assert not others, f"host syncs in a {stage} step: {others}"
        # adaptive and DS: all group sizes in exactly one read-back per step; others: none
        assert len(reads) == allowed_tolist, f"group sizes read back {len(reads)}x: {reads}"


def fit_language_model(make_head, monkeypatch) -> StepWindows:
    vocab = 40
    torch.manual_seed(0)
    backbone = LSTMBackbone(vocab, embedding_size=D, hidden_size=D)
    model = LanguageModel(backbone, make_head(D, vocab))
    loader = DataLoader(BPTTBatches(torch.randint(0, vocab, (400,)), batch_size=4, bptt=6),
                        batch_size=None)  # fmt: skip
    sentinel = SyncSentinel()
    windows = StepWindows(model, sentinel)
    with sentinel.installed(monkeypatch):
        trainer().fit(model, loader, loader)
    return windows


def fit_translation(make_head, tmp_path, monkeypatch) -> StepWindows:
    path = write_corpus(tmp_path, {"train": TINY, "val": TINY[:6], "test_2016_flickr": TINY[:2]})
    data = TranslationDataModule(path=path, max_tokens=12)
    torch.manual_seed(0)
    backbone = Seq2SeqTransformer(data.src_vocab_size, data.vocab_size, model_size=D,
                                  num_heads=2, encoder_layers=1, decoder_layers=1,
                                  feedforward_size=32)  # fmt: skip
    # label smoothing on: every head's smoothed loss runs; validation without decoding (a
    # search loop for BLEU, not the step's loss)
    model = Translation(backbone, make_head(D, data.vocab_size), label_smoothing=0.1,
                        decode=DecodeConfig(val_beam_size=0))  # fmt: skip
    sentinel = SyncSentinel()
    windows = StepWindows(model, sentinel)
    with sentinel.installed(monkeypatch):
        trainer().fit(model, datamodule=data)
    return windows


@pytest.mark.parametrize("head", sorted(HEADS))
def test_language_model_steps_make_no_host_sync(head, monkeypatch):
    make_head, allowed = HEADS[head]
    assert_no_sync(fit_language_model(make_head, monkeypatch), allowed)


@pytest.mark.parametrize("head", sorted(HEADS))
def test_translation_steps_make_no_host_sync(head, tmp_path, monkeypatch):
    make_head, allowed = HEADS[head]
    assert_no_sync(fit_translation(make_head, tmp_path, monkeypatch), allowed)


@pytest.mark.parametrize("task", ["language_model", "translation"])
def test_small_adaptive_steps_on_cudas_plans_read_nothing_back(task, tmp_path, monkeypatch):
    """Within the saved budget CUDA's plans run every classifier of the adaptive softmax on
    every row (``heads.fused_cross_entropy.dense_loss_fits``): no sort into clusters, nothing
    read back."""
    from heads import adaptive

    def no_sort(*args):
        raise AssertionError("a dense step sorts nothing")

    monkeypatch.setattr(chunks, "GPU_PLAN_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(adaptive, "sort_into_groups", no_sort)
    make_head = HEADS["adaptive"][0]
    if task == "language_model":
        windows = fit_language_model(make_head, monkeypatch)
    else:
        windows = fit_translation(make_head, tmp_path, monkeypatch)
    assert_no_sync(windows, 0)


def test_the_adaptive_rows_plan_on_cudas_plans_reads_nothing_back(monkeypatch):
    """Plan ``rows`` on CUDA's plans: the whole adaptive loss in one function
    (``heads/kernels/adaptive_rows.py``), its cluster sizes counted on the host."""
    from heads import adaptive

    ran = []
    whole = adaptive.adaptive_rows_loss
    monkeypatch.setattr(adaptive, "adaptive_rows_loss", lambda *a: ran.append(1) or whole(*a))
    monkeypatch.setattr(chunks, "GPU_PLAN_DEVICES", {"cuda", "cpu"})
    make_head = HEADS["adaptive"][0]
    windows = fit_language_model(lambda d, v: plain(make_head(d, v), "rows"), monkeypatch)
    assert_no_sync(windows, 0)
    assert ran


def test_the_sentinel_sees_each_kind_of_read_back(monkeypatch):
    """Each pattern the step code must not use is recorded (and the allowed ones are not)."""
    sentinel = SyncSentinel()
    x, mask = torch.ones(3), torch.tensor([True, False, True])
    with sentinel.installed(monkeypatch):
        sentinel.active = True
        x[0].item(), x.tolist(), bool(x[0]), int(x[0]), float(x[0]), x.cpu(), x.numpy()
        x.nonzero(), x[mask], torch.tensor([1.0], device="cpu")
        x.repeat_interleave(torch.tensor([1, 2, 0])), torch.unique(x)
        x[0], x[torch.tensor([0, 2])], x.repeat_interleave(2), x.to("cpu")  # allowed
        sentinel.active = False
    names = [name for name, _ in sentinel.calls]
    assert names == ["item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy",
                     "nonzero", "bool-mask []", "torch.tensor(..., device=)",
                     "repeat_interleave", "torch.unique"]  # fmt: skip


# -- the finite-loss check: on the device per step, read back at the logging interval ---------
class NaNFrom(L.Callback):
    """Makes the head's output NaN from training batch ``start`` on; records the batches run."""

    def __init__(self, start: int) -> None:
        self.start, self.batches = start, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch_idx)
        if batch_idx == self.start:
            with torch.no_grad():
                pl_module.head.bias[0] = float("nan")


def small_lm() -> tuple[LanguageModel, DataLoader]:
    torch.manual_seed(0)
    model = LanguageModel(LSTMBackbone(40, embedding_size=D, hidden_size=D), SoftmaxHead(D, 40))
    tokens = torch.randint(0, 40, (400,))
    return model, DataLoader(BPTTBatches(tokens, batch_size=4, bptt=5), batch_size=None)


def test_a_non_finite_training_loss_is_read_back_at_the_logging_interval():
    """The first non-finite loss is named (step, stage, head) when the check reads back, every
    ``log_every_n_steps`` batches: here NaN from step 4, found after batch 5 (the 6th)."""
    model, loader = small_lm()
    nan = NaNFrom(start=4)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, limit_train_batches=12,
                        log_every_n_steps=3, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=[nan])  # fmt: skip
    with pytest.raises(NonFiniteLossError) as error:
        trainer.fit(model, loader)
    assert str(error.value) == (
        "non-finite train loss (nan) at step 4 with SoftmaxHead: lower the learning rate or "
        "check the precision"
    )
    assert nan.batches == [0, 1, 2, 3, 4, 5]


def test_a_non_finite_validation_loss_stops_at_the_end_of_validation():
    model, loader = small_lm()
    with torch.no_grad():
        model.head.bias[0] = float("nan")
    trainer = L.Trainer(accelerator="cpu", limit_val_batches=3, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with pytest.raises(NonFiniteLossError, match=r"non-finite val loss \(nan\) at step 0 with "):
        trainer.validate(model, loader)
