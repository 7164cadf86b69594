"""What every task module shares: a backbone and a pluggable head, set up, checked and saved
the same way. Everything head-specific is asked of the head (``heads/base.py``)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from datamodules.pair_batches import InputOrder
from heads import Head, HeadOutput, HeadSetup
from heads.fused_cross_entropy import (
    EXTERNAL_PACKAGES,
    FUSED,
    check_backend_device,
    check_loss_choice,
    external_loss_function,
    fastest_backend,
    fused_products_missing,
    measured_options,
)
from heads.graphs import GraphedTrainingLoss, check_capturable
from lightning_modules.checks import (
    HEAD_KEY,
    FiniteLossCheck,
    check_checkpoint_head,
    check_hidden_sizes,
    head_class_name,
    restore_data_state,
)
from lightning_modules.epoch_resume import (
    mark_position,
    read_epoch_state,
    restore_accumulated_gradients,
    restore_metrics,
    resumable_loader,
    save_epoch_state,
    set_rng_states,
)
from lightning_modules.errors import ModelConfigError, warn_once
from lightning_modules.module_configs import (
    MODULE_CONFIGS_KEY,
    build_modules,
    cli_module_configs,
)
from lightning_modules.optimization import (
    SchedulerInterval,
    check_resumed_sizes,
    check_scheduler_interval,
    configure_optimizers,
    plateau_monitors,
    step_plateau_schedulers,
)
from lightning_modules.predict_stop import stop_if_terminated
from lightning_modules.static_rows import pad_rows, pad_target, padded_rows
from lightning_modules.unknown_input import UnknownInput

log = logging.getLogger(__name__)

# row counts a compiled head's loss may be specialised to before Dynamo runs it eagerly
COMPILED_ROW_COUNTS = 32

# the plateau schedule's bookkeeping a checkpoint keeps (HeadTask.on_save_checkpoint)
PLATEAU_KEY = "plateau_state"


def _products(precision: str | None) -> torch.dtype:
    """The head's products' dtype under Lightning's ``precision`` (bf16 where it is not
    known: then only the device is checked)."""
    if precision is None or "bf16" in precision:
        return torch.bfloat16
    if precision.startswith("16"):
        return torch.float16
    return torch.float64 if precision.startswith("64") else torch.float32


# The tasks' on_before_batch_transfer (the head told the targets on the host) is meant to run
# beside a data module; Lightning warns of every such pair, and lets a data module that defines
# the hook itself take precedence (the head then reads its sizes back from the device).
warnings.filterwarnings(
    "ignore", message="You have overridden `on_before_batch_transfer` in `LightningModule` but"
)

# Under DDP Lightning recommends ``sync_dist=True`` for every tensor logged per epoch. The
# tasks' and their callbacks' epoch values are already the whole run's (torchmetrics and the
# callbacks reduce over the ranks themselves; the structure is identical on every rank) or
# deliberately rank 0's (times); a second all-reduce would change nothing but cost a sync.
# ("step": a validate or test run's x-axis, the checkpoint's step, the same on every rank.)
warnings.filterwarnings(
    "ignore",
    message=r"It is recommended to use `self.log\('((train|val|test|time|ds|lightrnn)/|step')",
)

_EXTERNAL_GRAPHS = (
    "model.cuda_graphs captures the torch backend's plans; loss_backend {} is another "
    "library's kernels, not known to be capturable: set loss_backend auto or torch, or "
    "cuda_graphs false"
)

# What tasks take for ``compile``: False, True (torch.compile's defaults) or its keyword arguments
CompileOption = bool | dict[str, Any]


def _checked_compile_options(options: dict[str, Any]) -> dict[str, Any]:
    """``model.compile``'s keyword arguments, checked by ``torch.compile`` on a stand-in
    module (it compiles lazily, so nothing is compiled): a typo in a mode, a backend or a
    keyword is one line now, not a traceback when the model is set up."""
    try:
        torch.compile(torch.nn.Identity(), **options)
    except Exception as error:  # noqa: BLE001 - torch raises RuntimeError, TypeError, its own
        raise ModelConfigError(f"model.compile {options!r}: {error}") from error
    return dict(options)


class HeadTask(L.LightningModule):
    """Base of the task modules: ``self.backbone``, ``self.head`` and the optimizer factories.

    - ``setup("fit")`` sets the head up for the training device (``Head.setup``): what it
      decides from local facts (timings) is decided on rank 0 and broadcast, so every DDP rank
      builds the same head.
    - Loading a checkpoint restores the data module's state (its vocabulary) first and checks
      the head's state, so a mismatch is named before Lightning loads any weight.
    - ``compile`` (every task's option): ``torch.compile`` of the backbone's and the head's
      forward in :meth:`configure_model`, in place (``nn.Module.compile``: parameter names and
      checkpoints stay as they are). The head's training loss traces into one graph (its
      fused loss loops over shapes only; adaptive and DS group sizes are the only
      data-dependent values, captured as such). ``log_prob`` / ``topk`` stay eager.
    - ``loss_backend`` (every task's option): the head's fused-loss backend, or a plan of
      the torch backend (``LossOptions.plan``: ``eager``, ``compiled``, ``rows``, ``plain``,
      ``checkpoint``; ``fused``: ``rows`` with its tiles as fused Triton products),
      ``heads/fused_cross_entropy.py``; ``auto``: measured per device.
    - ``cuda_graphs`` (every task's option): the head's training loss, forward and backward,
      captured as CUDA graphs once per batch shape and replayed (``heads/graphs.py``): a
      launch-bound step (PTB sizes) launches all its kernels at once. CUDA only (elsewhere the
      head runs eagerly); DS-Softmax (its experts sized from the batch) and the external
      backends (cce, liger) refuse it in one line; an adaptive softmax's steps are captured
      where they are dense (every classifier on every row) and, over that budget, by the
      whole-loss rows plan with each tail cluster in fixed row slots (the clusters counted on
      the host in ``on_before_batch_transfer``); with label smoothing they run eagerly. The tasks
      call the head's loss through :meth:`head_loss`.
    - :meth:`check_finite_loss` in a step stops the run on a NaN or infinite loss without a
      host sync per step: the loss is checked on the device and read back at the logging
      interval, at the end of a training epoch and of each validation and test
      (:class:`~lightning_modules.checks.FiniteLossCheck`); subclasses that override
      ``on_validation_epoch_end`` / ``on_test_epoch_end`` call ``super()`` first.
    - ``scheduler_interval`` (every task's option): when the scheduler steps, ``step`` (every
      optimizer step) or ``epoch``; unset, the scheduler's own
      (:func:`~lightning_modules.optimization.default_interval`). Saved with the
      hyper-parameters: a fit resumed without it steps as the checkpoint's did.

    Each task calls ``super().__init__`` first (which checks the head against the backbone's
    ``output_size`` and records the options common to every task), then saves its own
    hyperparameters.
    """

    backbone: torch.nn.Module
    head: Head
    optimizer_factory: OptimizerCallable
    scheduler_factory: LRSchedulerCallable | None
    scheduler_interval: SchedulerInterval | None = None
    compile_options: dict[str, Any] | None = None

    predict_input = "line"  # what a line of predict's input is called (its <unk> count)

    def __init__(
        self,
        backbone: torch.nn.Module,
        head: Head,
        optimizer: OptimizerCallable,
        scheduler: LRSchedulerCallable | None,
        compile: CompileOption,
        loss_backend: str,
        cuda_graphs: bool = False,
        scheduler_interval: SchedulerInterval | None = None,
    ) -> None:
        super().__init__()
        check_hidden_sizes(head, getattr(backbone, "output_size", None))
        # (a plateau schedule per step is refused when it is built, in fit only: a test of a
        # checkpoint trained per step gets its scheduler_interval over the config's plateau)
        check_scheduler_interval(None, scheduler_interval)
        self.backbone = backbone
        self.head = head
        self.configure_training(compile, loss_backend, cuda_graphs)
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.scheduler_interval = scheduler_interval
        # validations ended in fit, and that count at the plateau scheduler's last step
        self._validations = self._plateau_validations = 0
        # the epoch whose plateau step was taken at its last validation's end (-1: none)
        self._plateau_epoch = -1
        self._validating = False  # a validation of this module under way
        self._finite_loss = FiniteLossCheck()
        self._resumed_epoch: dict | None = None  # read_epoch_state's, until the first batch
        self._resumed_monitored: dict[str, torch.Tensor] = {}  # a checkpoint's, until fit starts
        self.head_inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # head_loss's
        # what load_from_checkpoint rebuilds the two modules from (built by the CLI only)
        self._module_configs = cli_module_configs(head.hidden_size)
        # predict: its input read as <unk> (said at its end), and its results held back until
        # every earlier line's are out (the loader sorts each window by length)
        self._unknown = UnknownInput(self.predict_input)
        self._order = InputOrder()

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls,
        checkpoint_path: str,
        map_location: Any = None,
        hparams_file: str | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's, with the backbone and the head rebuilt from the configs a checkpoint
        written by ``cli.py`` holds (``lightning_modules/module_configs.py``), unless given:
        ``LanguageModel.load_from_checkpoint("logs/ptb/version_0/checkpoints/last.ckpt")``."""
        kwargs = build_modules(checkpoint_path, kwargs, cls)
        return super().load_from_checkpoint(
            checkpoint_path, map_location, hparams_file, strict, **kwargs
        )

    def configure_training(
        self, compile: CompileOption, loss_backend: str, cuda_graphs: bool = False
    ) -> None:
        """Record the ``compile``, ``loss_backend`` and ``cuda_graphs`` options (once
        ``self.head`` is set)."""
        check_loss_choice(loss_backend)
        if cuda_graphs:
            check_capturable(self.head)  # DS: one line naming the option
            if loss_backend in EXTERNAL_PACKAGES:
                raise ModelConfigError(_EXTERNAL_GRAPHS.format(loss_backend))
        # a plain object, not a submodule: the head's parameters stay registered once
        self._graphed_loss = GraphedTrainingLoss(self.head) if cuda_graphs else None
        if isinstance(compile, dict):
            self.compile_options = _checked_compile_options(compile)
        elif compile is True:
            self.compile_options = {}
        elif compile is False or compile is None:
            self.compile_options = None
        else:
            raise ModelConfigError(
                f"model.compile must be true, false or torch.compile's keyword arguments, got "
                f"{compile!r}"
            )
        if loss_backend in EXTERNAL_PACKAGES:  # a missing package: now, not at the first step
            external_loss_function(loss_backend)
        self.loss_backend = loss_backend
        options = self.head.loss_options
        if loss_backend == "auto":
            self.head.loss_options = replace(options, backend="auto")
        else:  # a backend, or a plan of the torch one
            self.head.loss_options = measured_options(options, loss_backend)
        self._compiled = False

    def place_loss_backend(self, device: torch.device, precision: str | None = None) -> None:
        """Once the device is known: ``cce``/``liger`` need CUDA, ``auto`` becomes the
        backend measured fastest for this head there (``fastest_backend``), and ``fused``
        where its products cannot run (on ``device`` under the trainer's ``precision``) says
        so in one line: the rows plan runs instead."""
        backend = self.loss_backend
        check_backend_device(backend, device)
        if backend == FUSED and (why := fused_products_missing(device, _products(precision))):
            log.warning("loss_backend fused: the rows plan runs without the fused products: %s",
                        why)  # fmt: skip
        if backend == "auto":  # a backend, or a plan of the torch one
            backend = fastest_backend(type(self.head).__name__, self.head.vocab_size, device)
            if self._graphed_loss is not None and backend in EXTERNAL_PACKAGES:
                backend = "torch"  # cuda_graphs: the torch backend's plans only
        self.head.loss_options = measured_options(self.head.loss_options, backend)
        if self._graphed_loss is not None and device.type != "cuda":
            warn_once(f"cuda_graphs: the head's steps are captured on CUDA only; on "
                       f"{device.type} it runs eagerly")  # fmt: skip

    def head_loss(
        self,
        hidden: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float = 0.0,
        sequence_length: int | None = None,
    ) -> HeadOutput:
        """``self.head(hidden, target, label_smoothing=...)``: what every task's step calls,
        through the CUDA graphs of ``cuda_graphs`` where they run (a training step on CUDA).
        Where the head is compiled or graphed, its rows are padded to one of a few sizes
        (:mod:`~lightning_modules.static_rows`) and its ``nll`` cut back to the batch's.
        ``sequence_length``: the rows' layout where they are sequences of that many steps
        (row ``b T + t``: a language model's), given to a head that takes it
        (``Head.takes_sequence_length``; padded rows come after the ``B T`` real ones).

        The step's ``(hidden, target)`` stay in ``self.head_inputs`` (``hidden`` detached)
        for callbacks that look at what the head saw (DS-Softmax's, top-k accuracy) in their
        batch hooks: a forward hook on the head would run inside its compiled graph, traced
        anew for every new hook (a recompilation each validation) and broken by any host
        read."""
        self.head_inputs = (hidden.detach(), target)
        rows = hidden.size(0)
        if self._static_rows(hidden.device):
            hidden, target = pad_rows(hidden, target, padded_rows(rows))
        options: dict[str, Any] = {"label_smoothing": label_smoothing}
        if sequence_length is not None and self.head.takes_sequence_length:
            options["sequence_length"] = sequence_length
        if self._graphed_loss is not None:
            output = self._graphed_loss(hidden, target, **options)
        else:
            output = self.head(hidden, target, **options)
        return output if hidden.size(0) == rows else replace(output, nll=output.nll[:rows])

    def _static_rows(self, device: torch.device) -> bool:
        """Whether the head's loss sees its rows padded to a few sizes (``static_rows``):
        where its shapes are compiled (``compile``) or captured (``cuda_graphs`` on CUDA)."""
        graphed = self._graphed_loss is not None and device.type == "cuda"
        return self.compile_options is not None or graphed

    def configure_model(self) -> None:
        if self.compile_options is None:
            return
        self._evaluate_under_no_grad()
        if self._compiled:
            return
        # adaptive cluster and DS expert sizes are counted on the device: captured as
        # data-dependent sizes instead of breaking the graph
        torch._dynamo.config.capture_scalar_outputs = True
        # the head's loss is specialised to its padded row count (static_rows): AWD-LSTM's
        # variable windows give 13 to 16 counts an epoch (about 27 over 50, the epochs' last
        # windows included), past Dynamo's default limit of 8, which sent the rest to eager
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, COMPILED_ROW_COUNTS
        )
        if any(isinstance(m, torch.nn.RNNBase) for m in self.backbone.modules()):
            # Dynamo does not trace nn.LSTM (it would skip the frame with a warning): the
            # recurrent backbone keeps its fused eager kernels
            log.info("compile: the recurrent backbone stays eager; compiling the head")
        else:
            self.backbone.compile(**self.compile_options)
        self.head.compile(**self.compile_options)
        self._compiled = True

    def _evaluate_under_no_grad(self) -> None:
        """Compiled, ``validate``, ``test`` and ``predict`` run under ``torch.no_grad`` as
        fit's validation does, not Lightning's default ``torch.inference_mode``: Dynamo
        guards on its inputs' dispatch keys (an inference tensor has no autograd key), so
        ``trainer.test`` after ``trainer.fit`` in one process recompiled the head and the
        backbone (a graph each per padded row count; minutes on a GPU). Both modes compute
        the same numbers; set on every run's trainer (a new one's loops start in inference
        mode), and ``Trainer(inference_mode=False)`` does the same."""
        trainer = self._trainer
        if trainer is None:
            return
        for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
            loop.inference_mode = False

    def setup(self, stage: str) -> None:
        if self._trainer is None:
            return
        self.place_loss_backend(self.trainer.strategy.root_device, str(self.trainer.precision))
        if stage != "fit":
            return
        trainer = self.trainer
        datamodule = getattr(trainer, "datamodule", None)
        self.head.setup(
            HeadSetup(
                device=trainer.strategy.root_device,
                decide_once=self._decide_once,
                token_counts=getattr(datamodule, "token_counts", None),
            )
        )

    def _decide_once(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` on global rank 0 only, its result broadcast to every rank."""
        trainer = self.trainer
        if trainer.world_size == 1:
            return decide()
        return trainer.strategy.broadcast(decide() if trainer.is_global_zero else None, src=0)

    def configure_optimizers(self) -> Any:
        precision = str(self.trainer.precision) if self._trainer is not None else None
        return configure_optimizers(
            self.parameters(), self.optimizer_factory, self.scheduler_factory, precision,
            trainer=self._trainer, interval=self.scheduler_interval,
        )  # fmt: skip

    # -- the batch's targets told to the head while on the host ------------------------------
    def batch_targets(self, batch: Any) -> torch.Tensor | None:
        """The targets of a training or evaluation batch, ``(inputs, targets)`` by default
        (None for another kind)."""
        return batch[1] if isinstance(batch, (tuple, list)) and len(batch) == 2 else None

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """The head sees the targets before they reach the device (``Head.expect_targets``):
        the adaptive softmax counts its clusters' sizes here instead of reading them back
        from the device in the step, where the host would wait for the backbone."""
        trainer = self._trainer
        if trainer is not None and not trainer.predicting:
            targets = self.batch_targets(batch)
            if isinstance(targets, torch.Tensor):
                if self._static_rows(self.device):  # the rows the head's loss will see
                    targets = pad_target(targets, padded_rows(targets.numel()))
                self.head.expect_targets(targets)
        return batch

    # -- the finite-loss check: recorded on the device per step, read back now and then ----
    def check_finite_loss(self, loss: torch.Tensor, stage: str) -> None:
        """Record whether a step's loss is finite (no host sync). Without a trainer (a direct
        call) no loop reads it back later: checked at once."""
        self._finite_loss.record(loss, stage, self.global_step)
        if self._trainer is None:
            self._finite_loss.raise_if_non_finite(self.head)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        trainer = self.trainer
        done = batch_idx + 1
        if done % max(trainer.log_every_n_steps, 1) == 0 or done >= trainer.num_training_batches:
            self._finite_loss.raise_if_non_finite(self.head)

    def on_train_end(self) -> None:
        self._finite_loss.raise_if_non_finite(self.head)  # max_steps may end between checks

    def on_validation_epoch_end(self) -> None:
        self._finite_loss.raise_if_non_finite(self.head)

    def on_test_epoch_end(self) -> None:
        self._finite_loss.raise_if_non_finite(self.head)

    def on_validation_start(self) -> None:
        # a validation under way (until its on_validation_end): one that a checkpoint written
        # at its end by a callback (ModelCheckpoint, before this module's hook) counts
        self._validating = not self.trainer.sanity_checking

    def on_validation_end(self) -> None:
        trainer = self.trainer
        if trainer.sanity_checking:
            return
        self._validating = False
        self._validations += 1
        # the validation that ends a training epoch takes the epoch's plateau step, before
        # the epoch's checkpoint is saved (lightning_modules/optimization.py)
        if trainer.state.fn == TrainerFn.FITTING and step_plateau_schedulers(self):
            self._plateau_epoch = trainer.current_epoch

    def on_train_epoch_end(self) -> None:
        # An epoch that no validation ended (one inside it only: val_check_interval < 1 or a
        # number of batches): its plateau step on that validation's val/loss, which Lightning's
        # own call after this hook reads from callback_metrics, taken here instead: before the
        # epoch's checkpoint, and in a fit resumed inside the epoch too, where Lightning takes
        # none (FitLoop.on_advance_end: not while restarting). Subclasses call super().
        trainer = self.trainer
        if trainer.state.fn != TrainerFn.FITTING or self._plateau_epoch == trainer.current_epoch:
            return
        if step_plateau_schedulers(self):
            self._plateau_epoch = trainer.current_epoch

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if isinstance(scheduler, ReduceLROnPlateau):
            if self._plateau_epoch == self.trainer.current_epoch:
                return  # Lightning's call after the epoch: stepped at its validation's end
            # Lightning reads val/loss from callback_metrics, which keeps an earlier
            # validation's value: stepping on it again (patience 0) would cut the rate on
            # no new evidence. Step only after a validation that ended since the last step.
            if self._validations == self._plateau_validations:
                warn_once("ReduceLROnPlateau: no validation since its last step; step skipped")
                return
            self._plateau_validations = self._validations
            scheduler.step(metric)
            return
        super().lr_scheduler_step(scheduler, metric)

    # -- a training epoch resumed mid-way (lightning_modules/epoch_resume.py) ---------------
    def train_metrics(self) -> dict[str, Any]:
        """The metrics that accumulate over a training epoch (its train perplexity): saved
        with a mid-epoch checkpoint, given back when it resumes."""
        return {}

    def epoch_state(self) -> Any:
        """What else a training epoch carries from batch to batch (a recurrent language
        model's state), saved with a mid-epoch checkpoint; None for nothing."""
        return None

    def continue_epoch_state(self, state: Any) -> None:
        """Take back the :meth:`epoch_state` of the checkpoint this run resumes mid-epoch."""

    def on_train_start(self) -> None:
        # a schedule sized to the fit, resumed: the checkpoint's length against this fit's
        check_resumed_sizes(config.scheduler for config in self.trainer.lr_scheduler_configs)
        # Resumed: the values the plateau step reads (val/loss) as the checkpoint's latest
        # validation left them (Lightning saves no callback_metrics), for an epoch's end that
        # no validation ends to step on, as the uninterrupted fit's does
        monitored, self._resumed_monitored = self._resumed_monitored, {}
        for name, value in monitored.items():
            self.trainer.callback_metrics[name] = value.to(self.device)
        # Resumed at an epoch's end (the usual last.ckpt): the generators as the checkpoint
        # saved them, before the next epoch's dropout draws its masks. (Resumed mid-epoch,
        # on_train_batch_start gives them back with the epoch's sums.)
        saved = self._resumed_epoch
        if saved is not None and saved["rng"] is not None:
            if not self.trainer.fit_loop.restarted_mid_epoch:
                set_rng_states(saved["rng"], self.device)

    def on_train_epoch_start(self) -> None:
        # (Lightning does not call this when it resumes in the middle of an epoch)
        self._resumed_epoch = None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        loader = resumable_loader(self._trainer)
        if loader is None:
            return
        saved, self._resumed_epoch = self._resumed_epoch, None
        if saved is not None and 0 < loader.resumed_from == batch_idx:
            restore_metrics(self.train_metrics(), saved["metrics"], self.device)
            self.continue_epoch_state(saved["state"])
            # a checkpoint inside an accumulation window: the window's gradient so far
            restore_accumulated_gradients(self, saved.get("gradients"))
            if saved["rng"] is not None:  # the dropout masks the uninterrupted run drew next
                set_rng_states(saved["rng"], self.device)
        mark_position(self.trainer, loader, batch_idx)

    # -- predict: the input's order, its <unk> count, SIGTERM --------------------------------
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        stop_if_terminated(self._trainer, self._order)  # (Lightning's predict loop does not)

    def on_predict_epoch_start(self) -> None:
        self._unknown.reset()
        self._order.reset()

    def on_predict_epoch_end(self) -> None:
        self._unknown.report()

    def in_input_order(
        self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int, results: list[Any]
    ) -> list[Any]:
        """A predict batch's ``results`` (one per line of ``batch["input_lines"]``) given back
        with those held before as the input's order allows (:class:`InputOrder`); the last
        batch gives every result held (``limit_predict_batches`` may end the input early)."""
        last = batch["last"] or batch_idx + 1 >= self.trainer.num_predict_batches[dataloader_idx]
        return self._order.put(batch["input_lines"], results, last)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[HEAD_KEY] = head_class_name(self.head)
        if self._module_configs is not None:
            checkpoint[MODULE_CONFIGS_KEY] = self._module_configs
        if resumable_loader(self._trainer) is not None:
            save_epoch_state(self, checkpoint, self.train_metrics(), self.epoch_state())
        trainer = self._trainer
        fitting = getattr(getattr(trainer, "state", None), "fn", None) == TrainerFn.FITTING
        metrics = trainer.callback_metrics if fitting else {}
        checkpoint[PLATEAU_KEY] = {
            "validations": self._validations + int(self._validating),
            "plateau_validations": self._plateau_validations,
            "plateau_epoch": self._plateau_epoch,
            # a validation's value not yet stepped on (an epoch's end to come steps on it)
            "monitored": {
                name: metrics[name].detach().cpu()
                for name in (plateau_monitors(trainer) if fitting else ())
                if isinstance(metrics.get(name), torch.Tensor)
            },
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # the vocabulary checked before the weights: a mismatch reported as such, not as a shape
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer else None
        restore_data_state(datamodule, checkpoint)
        check_checkpoint_head(checkpoint, self.head)
        self._resumed_epoch = read_epoch_state(checkpoint, self._trainer)
        plateau = checkpoint.get(PLATEAU_KEY)
        trainer = self._trainer
        if plateau is not None and trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            # the fit resumed: the validations since the last plateau step, as they were
            self._validations = plateau["validations"]
            self._plateau_validations = plateau["plateau_validations"]
            self._plateau_epoch = plateau["plateau_epoch"]
            self._resumed_monitored = dict(plateau["monitored"])
