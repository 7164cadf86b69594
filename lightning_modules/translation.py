"""Translation: encoder-decoder backbone + pluggable head, teacher forcing, beam search, BLEU."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from sacrebleu.metrics import BLEU

from heads import IGNORE_INDEX, Head, HeadOutput
from lightning_modules.backbones.seq2seq import Seq2SeqTransformer
from lightning_modules.checks import tie_head
from lightning_modules.decoding import DecodeConfig, beam_search, greedy_decode
from lightning_modules.errors import ModelConfigError
from lightning_modules.head_task import HeadTask, warn_once
from lightning_modules.optimization import SchedulerInterval
from lightning_modules.weighted_mean import WeightedMean
from lightning_modules.word_perplexity import (
    code_grammar,
    update_renormalised_sums,
    update_word_sums,
    word_perplexities,
    word_starts,
    word_sums,
)

STAGES = ("train", "val", "test")
DEFAULT_DECODE = DecodeConfig()


def bleu_for(target_lang: str | None) -> BLEU:
    """sacrebleu's BLEU with its tokenizer for the target language (``zh``, ``ja``, ``ko``
    take their own; 13a for the rest), so Chinese, Japanese or Korean output is not scored as
    one token a sentence; 13a, with a warning, where the language's tokenizer needs a package
    not installed (``pip install sacrebleu[ja]``)."""
    if target_lang is None:
        return BLEU()
    try:
        return BLEU(trg_lang=target_lang)
    except RuntimeError as error:  # sacrebleu: "... requires extra dependencies ..."
        warn_once(f"BLEU for {target_lang!r} tokenized by 13a: {str(error).strip()}")
        return BLEU()


def _ddp_world_size() -> int:
    """The number of processes of the default group, 1 outside ``torch.distributed``."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _per_global_token(
    output: HeadOutput, mean_nll: torch.Tensor, tokens: torch.Tensor, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DDP rank's training loss weighted per token of the whole step (as fairseq does),
    and the step's loss and NLL per token over all ranks, for the logs.

    DDP averages the ranks' gradients; token buckets give the ranks very different token
    counts in a step, so a mean of per-rank token means would weigh the tokens of a short
    batch more. ``sum * world / global_tokens`` (``output.loss`` is the rank's smoothed sum
    over its tokens) averages to the union's per-token loss. The auxiliary loss is a step's
    regulariser, not per token: added as it is, the ranks' average keeps its weight. One
    all-reduce on the device, no read-back."""
    local = tokens.to(output.loss.dtype)
    sums = torch.stack([output.loss.detach() * local, mean_nll.detach() * local, local])
    torch.distributed.all_reduce(sums)
    total = sums[2].clamp_min(1)  # an all-ignored step: 0, as one process has it
    loss = output.loss * (local * world / total) + output.aux_loss
    return loss, sums[0] / total + output.aux_loss.detach(), sums[1] / total


class Translation(HeadTask):
    """Sequence-to-sequence translation over any :class:`~heads.Head`.

    The decoder's context vectors ``[B, T, d]`` are flattened to ``[N, d]`` and given to the
    head with the next target tokens ``[N]`` (``-100`` at padding), as in the LM task.
    Under DDP a training step's loss is weighted per token of all ranks' batches, as one
    process would weigh their union (token buckets give the ranks unequal token counts).
    Validation and test report the token-weighted loss / perplexity of the reference and
    sacreBLEU of the decoded translations on detokenised text against the raw reference
    lines (a blank source line's translation blank, as ``predict`` gives it); a few sample
    translations go to TensorBoard as text, and ``test`` writes all translations
    (line-aligned with the test file) to ``translations_file``.

    Args:
        backbone: a :class:`~lightning_modules.backbones.seq2seq.Seq2SeqTransformer`.
        head: the output layer; ``head.hidden_size`` must equal the backbone's output size.
        optimizer, scheduler: factories (LightningCLI dependency injection);
            ``ReduceLROnPlateau`` watches ``val/loss``.
        label_smoothing: epsilon of uniform label smoothing in training, ``(1 - eps) NLL +
            eps * mean_x(-log p_x)``, computed by the head (``Head.forward``) without a
            ``[N, V]`` tensor where it can, auxiliary losses kept; evaluation reports the
            plain NLL.
        tie_weights: share the head's output embeddings with the decoder's input embedding.
        decode: the decoding options (:class:`~lightning_modules.decoding.DecodeConfig`:
            ``beam_size``, ``val_beam_size``, ``bleu_every_n_epochs``, ``length_penalty``,
            ``max_length_a``, ``max_length_b``, ``num_samples``), e.g. ``model.init_args.decode:
            {beam_size: 4, length_penalty: 0.6}``.
        translations_file: where ``test`` writes translations, one line per test line; default
            ``<log dir>/translations_test.txt``.
        compile: ``torch.compile`` the backbone and the head (true, or torch.compile's keyword
            arguments); see ``HeadTask``.
        loss_backend: the head's fused-loss backend (auto, torch, cce, liger) or a plan of
            the torch backend (eager, compiled, rows, plain, checkpoint, fused); see ``HeadTask``.
        cuda_graphs: capture the head's training step as CUDA graphs, one per batch shape
            (not DS-Softmax; CUDA only: elsewhere it runs eagerly); see ``HeadTask``.
        scheduler_interval: when ``scheduler`` steps: ``step`` (after every optimizer step),
            ``epoch``, or unset: the scheduler's own (every step for ``InverseSquareRootLR``,
            ``WarmupCosineLR``, ``OneCycleLR``, ``CyclicLR``; else every epoch). Set ``step``
            for a torch schedule whose lengths count optimizer steps (``CosineAnnealingLR``'s
            ``T_max``, ``LinearLR``'s ``total_iters``, the count a ``LambdaLR`` is given).
    """

    # the run's quality in TensorBoard's HPARAMS tab (hp_metric): its best validation BLEU
    HP_METRIC = ("val/bleu", "max")

    predict_input = "source"

    def __init__(
        self,
        backbone: Seq2SeqTransformer,
        head: Head,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable | None = None,
        label_smoothing: float = 0.0,
        tie_weights: bool = False,
        decode: DecodeConfig = DEFAULT_DECODE,
        translations_file: str | None = None,
        compile: bool | dict[str, Any] = False,
        loss_backend: str = "auto",
        cuda_graphs: bool = False,
        scheduler_interval: SchedulerInterval | None = None,
    ) -> None:
        super().__init__(
            backbone, head, optimizer, scheduler, compile, loss_backend, cuda_graphs,
            scheduler_interval=scheduler_interval,
        )  # fmt: skip
        if not 0.0 <= label_smoothing < 1.0:
            raise ModelConfigError(
                f"model.label_smoothing must be in [0, 1), got {label_smoothing}"
            )
        if decode.beam_size < 1 or decode.val_beam_size < 0:
            raise ModelConfigError(
                "model.decode.beam_size must be >= 1 and model.decode.val_beam_size >= 0, "
                f"got {decode.beam_size}, {decode.val_beam_size}"
            )
        if decode.bleu_every_n_epochs < 1:
            raise ModelConfigError(
                f"model.decode.bleu_every_n_epochs must be >= 1, got {decode.bleu_every_n_epochs}"
            )
        if tie_weights:
            tie_head(head, backbone.embedding.weight)
        # Only structural options go to hparams (see LanguageModel): decoding options must
        # stay free to change on the command line when testing a checkpoint.
        self.save_hyperparameters(
            ignore=[
                "backbone",
                "head",
                "optimizer",
                "scheduler",
                "decode",
                "translations_file",
                "compile",
                "loss_backend",
                "cuda_graphs",
            ]
        )
        self.label_smoothing = label_smoothing
        self.decode = decode
        self.translations_file = translations_file
        self.metrics = torch.nn.ModuleDict({f"{s}_nll": WeightedMean() for s in STAGES})
        # over Hybrid-LightRNN codes: also the word perplexity of the references
        self.word_metrics = word_sums(("val", "test"))
        self._word_starts: torch.Tensor | None = None
        self._translations: dict[int, list[int]] = {}
        self._decode_seconds = 0.0
        # predict's source words read as <unk>, said at its end

    # -- loss --------------------------------------------------------------------------
    def forward(
        self,
        source: torch.Tensor,
        source_padding: torch.Tensor,
        target_input: torch.Tensor,
        target_output: torch.Tensor,
    ) -> torch.Tensor:
        """The mean NLL of a batch's references: what Lightning's model summary runs on
        ``example_input_array`` to count each module's FLOPs. Eager even where ``compile`` is
        on (see ``LanguageModel.forward``)."""
        with torch.compiler.set_stance("force_eager"):
            hidden = self.backbone(source, source_padding, target_input)
            hidden = hidden.reshape(-1, hidden.size(-1))
            return self.head(hidden, target_output.reshape(-1)).loss

    def setup(self, stage: str) -> None:
        data = getattr(self._trainer, "datamodule", None) if self._trainer else None
        joint = getattr(getattr(data, "hparams", None), "joint_vocab", None)
        if getattr(self.backbone, "share_embeddings", False) and joint is False:
            # equal sizes pass the backbone's own check: capped vocabularies often are
            raise ModelConfigError(
                "model.backbone.share_embeddings needs one vocabulary for both sides, but the "
                "data gives a source and a target vocabulary of their own (the same size, "
                "other words): set data.joint_vocab true"
            )
        super().setup(stage)
        if stage == "fit":  # set before the summary (on_fit_start)
            self.example_input_array = self._first_training_batch()

    def _first_training_batch(self) -> tuple[torch.Tensor, ...] | None:
        """This rank's first training batch as the forward's arguments, or None without a
        translation data module: a real batch's sentence lengths, so the FLOPs are a step's."""
        data = getattr(self._trainer, "datamodule", None) if self._trainer else None
        if not hasattr(data, "encoded"):
            return None
        batch = next(iter(data.train_dataloader()), None)
        if batch is None:
            return None
        keys = ("source", "source_padding", "target_input", "target_output")
        return tuple(batch[key] for key in keys)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean NLL of the reference tokens, training loss with smoothing and aux loss)."""
        mean_nll, loss, _ = self._losses(batch)
        return mean_nll, loss

    def _losses(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`loss`'s pair and the NLL of each target token ``[N]``."""
        mean_nll, output, _ = self._head_output(batch)
        return mean_nll, output.loss + output.aux_loss, output.nll

    def _head_output(
        self, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, HeadOutput, torch.Tensor]:
        """The mean NLL of the reference tokens, the head's output and its input ``[N, d]``."""
        hidden = self.backbone(batch["source"], batch["source_padding"], batch["target_input"])
        hidden = hidden.reshape(-1, hidden.size(-1))
        target = batch["target_output"].reshape(-1)
        eps = self.label_smoothing if self.training else 0.0  # evaluation: the plain NLL
        output = self.head_loss(hidden, target, label_smoothing=eps)
        if eps == 0.0:  # the loss is then the mean NLL
            mean_nll = output.loss
        else:
            mean_nll = output.nll.sum() / (target != IGNORE_INDEX).sum().clamp_min(1)
        return mean_nll, output, hidden

    def _step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        nll, output, hidden = self._head_output(batch)
        loss, token_nll = output.loss + output.aux_loss, output.nll
        tokens = (batch["target_output"] != IGNORE_INDEX).sum()
        logged_loss, logged_nll = loss, nll
        # training under DDP: per token of the whole step (evaluation has no collective)
        if stage == "train" and (world := _ddp_world_size()) > 1:
            loss, logged_loss, logged_nll = _per_global_token(output, nll, tokens, world)
        self.check_finite_loss(loss, stage)
        self.metrics[f"{stage}_nll"].update(nll.detach(), weight=tokens)
        if stage == "train":
            # not prog_bar: Lightning reads those back after every batch (a GPU sync); the
            # app's progress bar shows it at the logging interval (interval_progress_bar)
            self.log("train/loss", logged_loss)
            self.log("train/nll", logged_nll)
            return loss
        if self._word_starts is None:
            self._word_starts = word_starts(self._trainer, self.device)
        if self._word_starts is not None:  # targets are codes: the words' sums too
            targets, token_nll = batch["target_output"].reshape(-1), token_nll.detach()
            update_word_sums(self.word_metrics, stage, self._word_starts, token_nll, targets)
            # and renormalised over valid code sequences (lightning_modules/word_perplexity.py)
            grammar = code_grammar(self._trainer, self.device)
            if grammar is not None:
                previous = batch["target_input"].reshape(-1)  # <bos> (= <eos>) starts a word
                update_renormalised_sums(self.word_metrics, stage, self.head.training_log_prob,
                                         hidden.detach(), previous, targets, grammar)  # fmt: skip
        return loss

    def train_metrics(self) -> dict[str, Any]:
        return {"train_nll": self.metrics["train_nll"]}

    def batch_targets(self, batch: Any) -> torch.Tensor | None:
        return batch.get("target_output") if isinstance(batch, dict) else None

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._step(batch, "train")

    # -- decoding ----------------------------------------------------------------------
    def translate(self, batch: dict[str, torch.Tensor], beam_size: int) -> list[list[int]]:
        """Target ids (without ``<eos>``) for each source sentence of a batch."""
        data = self.trainer.datamodule
        args = (self.backbone, self.head, batch["source"], batch["source_padding"], self.decode)
        tokens = (data.bos_id, data.target_vocab.eos_id)
        # a coded target (Hybrid-LightRNN) decodes to valid code pairs only: a row, then a
        # column that row holds a word in; no <unk> from a broken pair
        grammar = getattr(data.target_vocab, "grammar", None)
        grammar = grammar(self.device) if grammar is not None else None
        if beam_size == 1:
            return greedy_decode(*args, *tokens, grammar.restrict if grammar else None)
        # a search lets a hypothesis with no allowed code end (no fallback to probability 1)
        restrict = functools.partial(grammar.restrict, fallback=False) if grammar else None
        return beam_search(*args, *tokens, beam_size=beam_size, restrict=restrict)

    def _eval_step(self, batch: dict[str, torch.Tensor], stage: str, beam_size: int) -> None:
        self._step(batch, stage)
        if beam_size > 0:
            start = time.perf_counter()
            hypotheses = self.translate(batch, beam_size)
            self._decode_seconds += time.perf_counter() - start
            for index, ids in zip(batch["index"].tolist(), hypotheses, strict=True):
                self._translations[index] = ids

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(
            batch, "val", self.decode.val_beam_size if self._decodes_validation() else 0
        )

    def _decodes_validation(self) -> bool:
        """Whether this validation decodes (BLEU): every ``bleu_every_n_epochs``-th epoch, and
        always outside fitting (``validate``)."""
        trainer = self._trainer
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:
            return True
        return (trainer.current_epoch + 1) % self.decode.bleu_every_n_epochs == 0

    def on_fit_start(self) -> None:
        # ModelCheckpoint would stop the run with a vaguer message on the first validation
        # that did not decode
        for callback in self.trainer.checkpoint_callbacks:
            every = getattr(callback, "_every_n_epochs", 1) or 1
            bleu = getattr(callback, "monitor", None) == "val/bleu"
            if bleu and every % self.decode.bleu_every_n_epochs:
                raise ModelConfigError(
                    f"ModelCheckpoint(monitor='val/bleu') saves every {every} epochs but BLEU "
                    f"is computed every {self.decode.bleu_every_n_epochs} "
                    f"(model.decode.bleu_every_n_epochs): "
                    f"set the checkpoint's every_n_epochs to a multiple of it"
                )

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test", self.decode.beam_size)

    def predict_step(
        self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0
    ) -> list[dict[str, str]]:
        """Translations of ``data.predict_sentences`` or ``predict_file`` (``beam_size``); a
        blank line stays blank (a document's paragraph breaks), whatever the model says.

        The data module batches the lines sorted by length within windows
        (``StreamedWindows``), so a batch's lines are scattered: each step returns the
        translations that now continue the input's order (:class:`InputOrder`: line 0, 1,
        ... as far as every line is done; none, or several batches' worth), so the writer
        prints, and ``trainer.predict`` returns once flattened, the input's order. The last
        batch gives every line still held (all of them, unless ``limit_predict_batches`` left
        some out), in order."""
        data = self.trainer.datamodule
        sources = batch["text"]
        hypotheses = self.translate(batch, self.decode.beam_size)
        records = []
        for text, ids in zip(sources, hypotheses, strict=True):
            self._unknown.add(data.source_vocab, text)  # (counts only: the order is no matter)
            translation = data.detokenize(ids) if text.strip() else ""
            records.append({"source": text, "translation": translation})
        return self.in_input_order(batch, batch_idx, dataloader_idx, records)

    # -- epoch ends: perplexity, BLEU, samples, translations file ------------------------
    def _log_perplexity(self, stage: str) -> None:
        metric = self.metrics[f"{stage}_nll"]
        mean_nll = metric.compute()
        metric.reset()
        # the training epoch's mean NLL has its own tag, apart from the per-batch train/nll
        # (train/loss per batch is the smoothed loss the optimizer sees)
        loss_tag = "train/nll_epoch" if stage == "train" else f"{stage}/loss"
        self.log(loss_tag, mean_nll, prog_bar=stage != "train")
        self.log(f"{stage}/ppl", mean_nll.exp(), prog_bar=stage != "train")
        if stage != "train" and self._word_starts is not None:  # codes: per word too
            renormalised = code_grammar(self._trainer, self.device) is not None
            for name, value in word_perplexities(self.word_metrics, stage, renormalised).items():
                self.log(f"{stage}/{name}", value)

    def _gathered_translations(self) -> dict[int, list[int]]:
        translations, self._translations = self._translations, {}
        if self.trainer.world_size > 1:
            parts: list[dict[int, list[int]]] = [{} for _ in range(self.trainer.world_size)]
            torch.distributed.all_gather_object(parts, translations)
            translations = {k: v for part in parts for k, v in part.items()}
        return translations

    def _report_translations(self, stage: str, split: str) -> dict[int, str]:
        translations = self._gathered_translations()
        if not translations:
            return {}
        # wall-clock seconds of search on this rank (head speed at inference)
        self.log(f"{stage}/decode_s", self._decode_seconds)
        self._decode_seconds = 0.0
        data = self.trainer.datamodule
        indices = sorted(translations)
        # a blank source line's translation is blank, as predict writes it (a document's
        # paragraph break), not what the model says after <eos> alone: the test file and its
        # BLEU are then those of `predict --data.predict_file` on the same source file
        sources = data.sources(split)
        hypotheses = {
            i: data.detokenize(translations[i]) if sources[i].strip() else "" for i in indices
        }
        references = data.references(split)
        bleu = bleu_for(getattr(getattr(data, "hparams", None), "target_lang", None))
        # BLEU of the lines decoded (all of them unless limit_*_batches cuts the split)
        score = bleu.corpus_score(
            [hypotheses[i] for i in indices], [[references[i] for i in indices]]
        )
        self.log(f"{stage}/bleu", score.score, prog_bar=True)
        if self.trainer.is_global_zero:
            when = "sanity check: " if self.trainer.sanity_checking else ""  # not logged
            rank_zero_info(
                f"{when}{stage} BLEU {score.score:.2f} on {len(indices)} lines "
                f"({bleu.get_signature()})"
            )
            self._log_samples(stage, split, indices, hypotheses, references)
        return hypotheses

    def _log_samples(
        self,
        stage: str,
        split: str,
        indices: list[int],
        hypotheses: dict[int, str],
        references: list[str],
    ) -> None:
        if self.decode.num_samples <= 0:
            return
        sources = self.trainer.datamodule.sources(split)
        # the same lines every epoch, spread over the split, so progress is comparable
        step = max(1, len(indices) // self.decode.num_samples)
        rows = [
            f"**source:** {sources[i]}  \n**reference:** {references[i]}  \n"
            f"**translation:** {hypotheses[i]}"
            for i in indices[::step][: self.decode.num_samples]
        ]
        for logger in self.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(
                    f"{stage}/samples", "\n\n---\n\n".join(rows), self.global_step
                )

    def on_train_epoch_end(self) -> None:
        self._log_perplexity("train")
        super().on_train_epoch_end()  # the epoch's plateau step, where no validation took it

    def on_validation_epoch_start(self) -> None:
        self._translations, self._decode_seconds = {}, 0.0

    def on_test_epoch_start(self) -> None:
        self._translations, self._decode_seconds = {}, 0.0

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()  # a non-finite loss stops the run before logging
        self._log_perplexity("val")
        self._report_translations("val", "valid")

    def on_test_epoch_end(self) -> None:
        super().on_test_epoch_end()
        self._log_perplexity("test")
        hypotheses = self._report_translations("test", "test")
        if not hypotheses:
            return
        # every rank: trainer.log_dir is a broadcast under DDP (rank 0 alone would hang)
        path = self.translations_path()
        if self.trainer.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(hypotheses[i] + "\n" for i in sorted(hypotheses)), "utf-8")
            total = len(self.trainer.datamodule.references("test"))
            rank_zero_info(f"wrote {len(hypotheses)} of {total} test translations to {path}")

    def translations_path(self) -> Path:
        if self.translations_file:
            return Path(self.translations_file)
        root = self.trainer.log_dir or self.trainer.default_root_dir
        return Path(root) / "translations_test.txt"
