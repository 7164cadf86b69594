"""LanguageModel: backbone + pluggable head, trained with truncated BPTT."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.fabric.utilities import move_data_to_device
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info

from datamodules.vocab.code_grammar import CodeGrammar
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from heads import Head
from lightning_modules.backbones import LMBackbone
from lightning_modules.checks import HEAD_KEY, tie_head
from lightning_modules.errors import ModelConfigError
from lightning_modules.head_task import HeadTask, warn_once
from lightning_modules.optimization import SchedulerInterval
from lightning_modules.pretrained import Pretrained, read_pretrained
from lightning_modules.unknown_input import UnknownInput
from lightning_modules.weighted_mean import WeightedMean
from lightning_modules.word_perplexity import (
    update_word_sums,
    word_perplexity,
    word_starts,
    word_sums,
)
from lightning_modules.word_topk import top_words

STAGES = ("train", "val", "test")
NOT_HPARAMS = [
    "backbone", "head", "optimizer", "scheduler", "predict_top_k", "generate_tokens",
    "temperature", "pretrained_checkpoint", "compile", "loss_backend", "cuda_graphs",
]  # fmt: skip


def _check_predict_options(predict_top_k: int, generate_tokens: int, temperature: float) -> None:
    if temperature <= 0:
        raise ModelConfigError(f"model.temperature must be positive, got {temperature}")
    if predict_top_k < 1:
        raise ModelConfigError(f"model.predict_top_k must be at least 1, got {predict_top_k}")
    if generate_tokens < 0:
        raise ModelConfigError(
            f"model.generate_tokens must be 0 (none) or more, got {generate_tokens}"
        )


class LanguageModel(HeadTask):
    """Next-token language model over any :class:`~heads.Head`.

    Perplexity is ``exp`` of the token-weighted mean NLL over the whole split
    (:class:`~lightning_modules.weighted_mean.WeightedMean`, reduced over DDP ranks), not a
    mean of batch perplexities. When the data module's ids are codes of words (BPE pieces,
    Hybrid-LightRNN codes: it has a ``word_start_mask``), ``{stage}/word_ppl`` is also logged:
    ``exp(sum of code NLLs / number of words)``, comparable across vocabularies.

    Args:
        backbone: maps ``[B, T]`` ids to ``[B, T, d]`` context vectors.
        head: the output layer; ``head.hidden_size`` must equal ``backbone.output_size``.
        optimizer: optimizer factory (LightningCLI dependency injection).
        scheduler: optional learning-rate scheduler factory; ``ReduceLROnPlateau`` watches
            ``val/loss``.
        tie_weights: share the head's output embeddings with the backbone's input embedding.
        predict_top_k: how many next-token candidates ``predict`` reports (over
            Hybrid-LightRNN codes: the next words, see :mod:`lightning_modules.word_topk`).
        generate_tokens: if > 0, ``predict`` also samples this many tokens after the prompt
            (over Hybrid-LightRNN codes: words, each a valid code or code pair).
        temperature: sampling temperature for ``generate_tokens``.
        pretrained_checkpoint: a checkpoint of a trained LanguageModel whose backbone weights
            are loaded, and its head's where this head can start from them
            (``Head.load_pretrained``: the same head, or DS-Softmax from a softmax, the
            pretrain-then-replace recipe of DS-Softmax appendix B).
        freeze_backbone: train the head only.
        compile: ``torch.compile`` the backbone and the head (true, or torch.compile's keyword
            arguments such as ``{mode: max-autotune}``); see ``HeadTask``.
        loss_backend: the head's fused-loss backend: auto, torch, cce or liger (CUDA,
            optional packages), or a plan of the torch backend (eager, compiled, rows,
            plain, checkpoint); see ``HeadTask``.
        cuda_graphs: capture the head's training step as CUDA graphs, one per batch shape
            (not DS-Softmax; CUDA only: elsewhere it runs eagerly); see ``HeadTask``.
        scheduler_interval: when ``scheduler`` steps: ``step`` (after every optimizer step),
            ``epoch``, or unset: the scheduler's own (every step for ``InverseSquareRootLR``,
            ``WarmupCosineLR``, ``OneCycleLR``, ``CyclicLR``; else every epoch). Set ``step``
            for a torch schedule whose lengths count optimizer steps (``CosineAnnealingLR``'s
            ``T_max``, ``LinearLR``'s ``total_iters``, the count a ``LambdaLR`` is given).
    """

    # the run's quality in TensorBoard's HPARAMS tab (hp_metric): its best validation perplexity
    HP_METRIC = ("val/ppl", "min")

    def __init__(
        self,
        backbone: LMBackbone,
        head: Head,
        optimizer: OptimizerCallable = torch.optim.Adam,
        scheduler: LRSchedulerCallable | None = None,
        tie_weights: bool = False,
        predict_top_k: int = 10,
        generate_tokens: int = 0,
        temperature: float = 1.0,
        pretrained_checkpoint: str | None = None,
        freeze_backbone: bool = False,
        compile: bool | dict[str, Any] = False,
        loss_backend: str = "auto",
        cuda_graphs: bool = False,
        scheduler_interval: SchedulerInterval | None = None,
    ) -> None:
        super().__init__(
            backbone, head, optimizer, scheduler, compile, loss_backend, cuda_graphs,
            scheduler_interval=scheduler_interval,
        )  # fmt: skip
        if tie_weights:
            tie_head(head, backbone.embedding.weight)
        _check_predict_options(predict_top_k, generate_tokens, temperature)
        # Only structural options go to hparams: LightningCLI re-applies a checkpoint's hparams
        # over the command line, which must stay free to change the predict options. (Modules
        # and factories are described by the config LightningCLI saves beside the logs.)
        self.save_hyperparameters(ignore=NOT_HPARAMS)
        self.predict_top_k = predict_top_k
        self.generate_tokens = generate_tokens
        self.temperature = temperature
        self._pretrained: Pretrained | None = None
        if pretrained_checkpoint is not None:
            self.load_pretrained(pretrained_checkpoint)
        if freeze_backbone:
            self.backbone.requires_grad_(False)
        self._state: dict[str, Any] = {}
        self.metrics = torch.nn.ModuleDict(
            {stage: WeightedMean() for stage in ("train_nll", "val_nll", "test_nll")}
        )
        self.word_metrics = word_sums(STAGES)  # over codes (lightning_modules/word_perplexity.py)
        self._word_starts: torch.Tensor | None = None
        self._unknown = UnknownInput("prompt")  # predict's input read as <unk>, said at its end

    # -- steps -------------------------------------------------------------------------
    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one batch from a fresh recurrent state: what Lightning's model summary
        runs on ``example_input_array`` to count each module's FLOPs. Eager even where
        ``compile`` is on: compiling under the summary's FLOP counter would leave the modules
        uncompiled for training."""
        with torch.compiler.set_stance("force_eager"):
            hidden, _ = self.backbone(inputs)
            return self.head(hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)).loss

    def setup(self, stage: str) -> None:
        if self._pretrained is not None and self._trainer is not None:
            self._pretrained.check_data(self._trainer.datamodule)  # none: nothing to check
        super().setup(stage)
        if stage == "fit":
            # set before the summary (on_fit_start); moved to the device with the batch
            self.example_input_array = self._first_training_batch()

    def on_fit_start(self) -> None:
        frozen = self.hparams.get("freeze_backbone", False)
        if frozen and self._pretrained is None and self.trainer.ckpt_path is None:
            # the DS recipes freeze a pretrained backbone; without one it stays random
            warn_once(
                "model.freeze_backbone: no model.pretrained_checkpoint (and no --ckpt_path), "
                "so the frozen backbone keeps its random initialisation and only the head "
                "learns; give model.pretrained_checkpoint a trained language model's checkpoint"
            )

    def _first_training_batch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This rank's first training batch (a view of the token file), or None without a
        language-modelling data module. Real ids, so that adaptive clusters and DS experts
        count the FLOPs a real batch costs."""
        trainer = self._trainer
        data = getattr(trainer, "datamodule", None) if trainer else None
        if not hasattr(data, "rank_streams"):
            return None
        hp = data.hparams
        try:
            streams = data.rank_streams(
                "train", hp.batch_size, trainer.global_rank, trainer.world_size
            )
        except ValueError:  # too few tokens: the training loader names the option to fix
            return None
        stop = min(hp.bptt, streams.size(1) - 1)
        return streams[:, :stop].long(), streams[:, 1 : stop + 1].long()

    def _step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        inputs, targets = batch
        hidden, new_state = self.backbone(inputs, self._state.get(stage))
        # carry the recurrent state to the next window, without the graph
        self._state[stage] = LMBackbone.detach_state(new_state)
        # rows b T + t: the head may lock its dropout masks over each stream's T steps
        output = self.head_loss(hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1),
                                sequence_length=targets.size(1))  # fmt: skip
        tokens = (targets != -100).sum()
        metric = self.metrics[f"{stage}_nll"]
        metric.update(output.loss.detach(), weight=tokens)
        self._update_word_nll(stage, output.nll.detach(), targets.reshape(-1))
        loss = output.loss + output.aux_loss
        extra = self.backbone.extra_loss()  # e.g. AWD-LSTM's AR/TAR (training only)
        if extra is not None:
            loss = loss + extra
        self.check_finite_loss(loss, stage)
        if stage == "train":
            if extra is not None:
                self.log("train/backbone_reg", extra)
            # not prog_bar: Lightning reads those back after every batch (a GPU sync); the
            # app's progress bar shows it at the logging interval (interval_progress_bar)
            self.log("train/loss", output.loss)
            self.log("train/ppl_batch", output.loss.exp())
            if output.aux_loss.requires_grad:
                self.log("train/aux_loss", output.aux_loss)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        return self._step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        self._step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        self._step(batch, "test")

    def _update_word_nll(self, stage: str, nll: torch.Tensor, targets: torch.Tensor) -> None:
        if self._word_starts is None:
            self._word_starts = word_starts(self._trainer, self.device)
            if self._word_starts is None:
                return
        update_word_sums(self.word_metrics, stage, self._word_starts, nll, targets)

    def _log_split_perplexity(self, stage: str) -> None:
        if self._word_starts is not None:
            ppl = word_perplexity(self.word_metrics, stage)
            self.log(f"{stage}/word_ppl", ppl, prog_bar=True, sync_dist=False)
        metric = self.metrics[f"{stage}_nll"]
        mean_nll = metric.compute()
        metric.reset()
        # the training epoch's mean has its own tag: train/loss is the per-batch loss
        loss_tag = "train/loss_epoch" if stage == "train" else f"{stage}/loss"
        self.log(loss_tag, mean_nll, prog_bar=stage != "train", sync_dist=False)
        self.log(f"{stage}/ppl", mean_nll.exp(), prog_bar=True, sync_dist=False)

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        self._state.pop("train", None)

    def on_validation_epoch_start(self) -> None:
        self._state.pop("val", None)

    def on_test_epoch_start(self) -> None:
        self._state.pop("test", None)

    def on_train_epoch_end(self) -> None:
        self._log_split_perplexity("train")
        super().on_train_epoch_end()  # the epoch's plateau step, where no validation took it

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()  # a non-finite loss stops the run before logging
        self._log_split_perplexity("val")

    def on_test_epoch_end(self) -> None:
        super().on_test_epoch_end()
        self._log_split_perplexity("test")

    # -- predict: next-token top-k, optional sampling -----------------------------------
    def on_predict_epoch_start(self) -> None:
        self._unknown.reset()

    def on_predict_epoch_end(self) -> None:
        self._unknown.report()

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, Any]:
        vocab = self.trainer.datamodule.vocab
        self._unknown.add(vocab, batch["prompt"])
        ids = batch["ids"].to(self.device).unsqueeze(0)
        hidden, state = self.backbone(self._window(ids))
        last = hidden[:, -1]
        k, grammar = self.predict_top_k, None
        if isinstance(vocab, HybridLightRNNVocab):  # words, not codes (<row3> says nothing)
            grammar = vocab.grammar(self.device)

            def after(code: int) -> torch.Tensor:
                return self.head.log_prob(self._read(ids, state, ids.new_tensor([[code]]))[0])[0]

            top = top_words(self.head.log_prob(last)[0], after, vocab, k)
            names = [(lp, vocab.words.itos[word]) for lp, word in top]
        else:
            log_probs, indices = self.head.topk(last, k)
            pairs = zip(log_probs[0].tolist(), indices[0].tolist(), strict=True)
            # a DS-Softmax expert of fewer than k classes pads its answer with classes outside
            # it at -inf (Head.topk): no candidates, so they are left out
            names = [(lp, vocab.itos[i]) for lp, i in pairs if lp > -math.inf]
        result: dict[str, Any] = {
            "prompt": batch["prompt"],
            # 6 significant digits: rounded to 6 decimals, a deep top-k's tail read 0.0
            "top_k": [{"token": name, "prob": float(f"{math.exp(lp):.6g}")} for lp, name in names],
        }
        if self.generate_tokens > 0:
            result["sample"] = " ".join(vocab.decode_words(self._sample(ids, last, state, grammar)))
        return result

    def _read(self, ids: torch.Tensor, state: Any, token: torch.Tensor) -> tuple[Any, ...]:
        """``(last hidden [1, d], ids, state)`` once ``token`` ``[1, 1]`` follows ``ids``."""
        if self.backbone.carries_state:
            hidden, state = self.backbone(token, state)
        else:  # re-read the context
            ids = torch.cat((ids, token), dim=1)
            hidden, _ = self.backbone(self._window(ids))
        return hidden[:, -1], ids, state

    def _window(self, ids: torch.Tensor) -> torch.Tensor:
        """The context a backbone without state reads: the last ``max_length`` tokens where it
        has a position table of that size (a longer prompt, a long sample)."""
        limit = getattr(self.backbone, "max_length", None)
        return ids if limit is None or self.backbone.carries_state else ids[:, -limit:]

    def _sample(
        self, ids: torch.Tensor, last: torch.Tensor, state: Any, grammar: CodeGrammar | None
    ) -> list[int]:
        """``generate_tokens`` tokens sampled after ``ids``; over Hybrid-LightRNN codes (a
        ``grammar``), that many words, each code drawn among those that may follow the last."""
        sampled: list[int] = []
        words, previous = 0, ids[:, -1]
        while words < self.generate_tokens:
            log_probs = self.head.log_prob(last)
            if grammar is not None:
                log_probs = grammar.restrict(log_probs, previous)
            token = torch.multinomial((log_probs / self.temperature).softmax(-1), 1)  # [1, 1]
            sampled.append(int(token))
            words += grammar is None or not bool(grammar.is_row[token[0, 0]])
            last, ids, state = self._read(ids, state, token)
            previous = token[:, 0]
        return sampled

    # -- checkpoints -------------------------------------------------------------------
    def load_pretrained(self, path: str) -> None:
        """Backbone (and head, see ``pretrained_checkpoint``) weights from a checkpoint; the
        data module's vocabulary is checked against the checkpoint's at :meth:`setup`."""
        parts, self._pretrained = read_pretrained(path)  # the weights let go once loaded
        self._pretrained.check_task(self)
        self._pretrained.load_into(self.backbone, "backbone", parts.get("backbone", {}))
        head_weight = parts.get("head", {}).get("weight")
        embedding = parts.get("backbone", {}).get("embedding.weight")
        tied = getattr(self.head, "weight", None) is self.backbone.embedding.weight
        if tied and head_weight is not None and embedding is not None:
            if not torch.equal(head_weight, embedding):  # loaded next, over the embedding
                rank_zero_info(
                    "the pretrained checkpoint is untied: the tied embedding starts from its "
                    "output weights (head.weight), not its input embedding"
                )
        if not self.head.load_pretrained(parts.get("head", {})):
            rank_zero_info(
                f"{type(self.head).__name__} starts untrained: the pretrained checkpoint's "
                f"head ({self._pretrained.entries.get(HEAD_KEY)}) does not fit it"
            )

    def train_metrics(self) -> dict[str, Any]:
        return {
            "train_nll": self.metrics["train_nll"],
            **{f"word_{k}": m for k, m in self.word_metrics.items() if k.startswith("train_")},
        }

    def epoch_state(self) -> Any:
        # the recurrent state carried between training windows
        return self._state.get("train")

    def continue_epoch_state(self, state: Any) -> None:
        # the next windows see the same context as without the stop
        if state is not None:
            self._state["train"] = move_data_to_device(state, self.device)
