"""LanguageModel: backbone + pluggable head, trained with truncated BPTT."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.apply_func import apply_to_collection

from datamodules.vocab.code_grammar import CodeGrammar
from datamodules.vocab.hybrid_lightrnn import HybridLightRNNVocab
from heads import Head
from lightning_modules.backbones import LMBackbone
from lightning_modules.checks import HEAD_KEY, tie_head
from lightning_modules.errors import ModelConfigError
from lightning_modules.head_task import HeadTask, warn_once
from lightning_modules.optimization import SchedulerInterval
from lightning_modules.pretrained import Pretrained, read_pretrained
from lightning_modules.weighted_mean import WeightedMean
from lightning_modules.word_perplexity import (
    RENORMALISED_STAGES,
    code_grammar,
    update_renormalised_sums,
    update_word_sums,
    word_perplexities,
    word_starts,
    word_sums,
)
from lightning_modules.word_topk import top_words_batch

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
    ``exp(sum of code NLLs / number of words)``, comparable across vocabularies; over
    Hybrid-LightRNN codes validation and test add ``{stage}/word_ppl_renorm``, the code model
    renormalised over valid code sequences (``lightning_modules/word_perplexity.py``).

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

    predict_input = "prompt"

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
        self._update_renormalised_nll(stage, hidden, inputs, targets)
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

    def _update_renormalised_nll(
        self, stage: str, hidden: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor
    ) -> None:
        """Over Hybrid-LightRNN codes, evaluation also sums the word NLL renormalised over the
        valid code sequences (``{stage}/word_ppl_renorm``, lightning_modules/word_perplexity.py):
        the head's distribution once more over this window's rows, each input code being the
        one before its target."""
        if self._word_starts is None or stage not in RENORMALISED_STAGES:
            return
        grammar = code_grammar(self._trainer, self.device)
        if grammar is not None:
            update_renormalised_sums(
                self.word_metrics, stage, self.head.training_log_prob,
                hidden.reshape(-1, hidden.size(-1)), inputs.reshape(-1), targets.reshape(-1),
                grammar,
            )  # fmt: skip

    def _log_split_perplexity(self, stage: str) -> None:
        if self._word_starts is not None:
            renormalised = code_grammar(self._trainer, self.device) is not None
            for name, value in word_perplexities(self.word_metrics, stage, renormalised).items():
                self.log(f"{stage}/{name}", value, prog_bar=name == "word_ppl", sync_dist=False)
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
    def predict_step(
        self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0
    ) -> list[dict[str, Any]]:
        """A batch of prompts (``PromptBatches``: right-padded ids and each prompt's length),
        one result each. The backbones are causal, so each prompt's context vector is read at
        its last real position, untouched by the padding after it; the top-k of the whole
        batch is one ``head.topk`` and one read-back. Over Hybrid-LightRNN codes, and for
        sampling after a backbone that carries a state (whose state after the padding is not
        the prompt's), each prompt's own state is read (:meth:`_read_prompts`).

        The loader sorts each window's prompts by length, so a batch's prompts are scattered:
        the step returns the results that now continue the input's order (:class:`InputOrder`;
        none, or several batches' worth), so the writer prints the input's order."""
        vocab = self.trainer.datamodule.vocab
        self._unknown.add_counts(batch["unknown"], batch["tokens"])  # counted as encoded
        # each prompt's length: on the host (the loops' decisions) and on the device (indices)
        ids, lengths, ends = batch["ids"], list(batch["lengths"]), batch["ends"]
        grammar = vocab.grammar(self.device) if isinstance(vocab, HybridLightRNNVocab) else None
        needs_state = grammar is not None or self.generate_tokens > 0
        last, state = self._read_prompts(ids, lengths, ends, needs_state)
        k = self.predict_top_k
        if grammar is not None:  # words, not codes (<row3> says nothing)
            after = self._after_codes(ids, lengths, ends, state)
            rows = top_words_batch(self.head.log_prob(last), after, vocab, k)
            names = [[(lp, vocab.words.itos[word]) for lp, word in top] for top in rows]
        else:
            log_probs, indices = self.head.topk(last, k)
            # one read-back for the whole batch (float64 holds every id exactly)
            both = torch.stack((log_probs.double(), indices.double())).cpu()
            # a DS-Softmax expert of fewer than k classes pads its answer with classes outside
            # it at -inf (Head.topk): no candidates, so they are left out
            names = [
                [(lp, vocab.itos[int(i)]) for lp, i in zip(lps, row, strict=True) if lp > -math.inf]
                for lps, row in zip(both[0].tolist(), both[1].tolist(), strict=True)
            ]
        results: list[dict[str, Any]] = [
            {
                "prompt": prompt,
                # 6 significant digits: rounded to 6 decimals, a deep top-k's tail read 0.0
                "top_k": [{"token": n, "prob": float(f"{math.exp(lp):.6g}")} for lp, n in row],
            }
            for prompt, row in zip(batch["prompt"], names, strict=True)
        ]
        if self.generate_tokens > 0:
            samples = self._sample_batch(ids, lengths, ends, last, state, grammar)
            for result, sample in zip(results, samples, strict=True):
                result["sample"] = " ".join(vocab.decode_words(sample))
        if "input_lines" not in batch:  # a batch built by hand, in its own order
            return results
        return self.in_input_order(batch, batch_idx, dataloader_idx, results)

    # -- predict's reading of prompts --------------------------------------------------------
    # ``lengths`` (host) and ``ends`` (the same on the device) are each row's real tokens in
    # a right-padded ``ids``: the host decides the loops and slices, the device indexes.
    def _read_prompts(
        self, ids: torch.Tensor, lengths: list[int], ends: torch.Tensor, needs_state: bool
    ) -> tuple[torch.Tensor, Any]:
        """``(last [B, d], state)``: each prompt's context vector at its last real token, and,
        where ``needs_state`` and the backbone carries one, the state after that token (rows
        of the batch; else None).

        A backbone without state reads each prompt's last ``max_length`` tokens. One with a
        state reads the padded batch in one pass when its state is not needed; else the rows
        sorted by length, longest first, in one pass per distinct length, each pass only the
        rows not yet ended (so no padding is read, and a row's state is taken where it ends).
        """
        rows = torch.arange(len(lengths), device=ids.device)
        if not self.backbone.carries_state:
            window, positions = self._window_rows(ids, lengths, ends)
            return self.backbone(window)[0][rows, positions], None
        if not needs_state:
            return self.backbone(ids[:, : max(lengths)])[0][rows, ends - 1], None
        order = sorted(range(len(lengths)), key=lambda b: -lengths[b])  # longest first
        perm = ends.argsort(descending=True, stable=True)  # the same order, on the device
        ordered = ids.index_select(0, perm)
        dims = self._state_batch_dims()
        lasts, states, state, start, active = [], [], None, 0, len(order)
        for end in sorted(set(lengths)):
            hidden, state = self.backbone(ordered[:active, start:end], state)
            still = sum(1 for b in order if lengths[b] > end)  # rows going on past `end`
            lasts.append(hidden[still:active, -1])
            states.append(_state_rows(state, dims, still, active))
            state, start, active = _state_rows(state, dims, 0, still), end, still
        # the pieces ended shortest first, from the back of the order: back to the input's order
        back = perm.argsort()
        last = torch.cat(lasts[::-1]).index_select(0, back)
        return last, _state_select(_state_cat(states[::-1], dims), dims, back)

    def _state_batch_dims(self) -> Any:
        """The batch dimension of each tensor of the backbone's state (a structure like the
        state's; None for a part without one), found once by reading a one-token batch of
        one row and of two rows (backbones keep it in different places: an LSTM's ``h`` is
        ``[layers, B, d]``, an n-gram's history ``[B, k - 1]``)."""
        if getattr(self, "_state_dims", None) is None:
            token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            one = self.backbone(token)[1]
            two = self.backbone(token.expand(2, 1))[1]
            self._state_dims = _batch_dims(one, two)
        return self._state_dims

    def _after_codes(
        self, ids: torch.Tensor, lengths: list[int], ends: torch.Tensor, state: Any
    ) -> Callable[[list[int], list[int]], torch.Tensor]:
        """``after(rows, codes) -> [n, num_codes]``: the next code's log-probabilities once
        prompt ``rows[i]`` is followed by ``codes[i]``, all in one backbone pass."""

        def after(rows: list[int], codes: list[int]) -> torch.Tensor:
            index = torch.tensor(rows, device=ids.device)
            token = torch.tensor(codes, device=ids.device).unsqueeze(1)
            if self.backbone.carries_state:
                dims = self._state_batch_dims()
                last = self.backbone(token, _state_select(state, dims, index))[0][:, -1]
            else:
                chosen = [lengths[r] for r in rows]
                context = ids.index_select(0, index)
                last, _ = self._extend(context, chosen, ends.index_select(0, index), token)
            return self.head.log_prob(last)

        return after

    def _extend(
        self, ids: torch.Tensor, lengths: list[int], ends: torch.Tensor, token: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(last [n, d], context)`` for a backbone without state: the context vector once
        ``token`` ``[n, 1]`` follows each row's tokens of ``ids``, and those contexts
        (right-padded, each row one longer)."""
        context = torch.cat((ids[:, : max(lengths)], token), dim=1)
        context = context.scatter(1, ends.unsqueeze(1), token)
        window, positions = self._window_rows(context, [n + 1 for n in lengths], ends + 1)
        rows = torch.arange(len(lengths), device=ids.device)
        return self.backbone(window)[0][rows, positions], context

    def _window_rows(
        self, ids: torch.Tensor, lengths: list[int], ends: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(window [B, W], positions [B])``: the tokens a backbone without state reads (each
        row's last ``max_length`` where it has a position table of that size: a long prompt, a
        long sample), moved to start at position 0, and where each row's last token now is."""
        limit = getattr(self.backbone, "max_length", None)
        longest = max(lengths)
        if limit is None or longest <= limit:
            return ids[:, :longest], ends - 1
        start = (ends - limit).clamp(min=0)
        index = start.unsqueeze(1) + torch.arange(limit, device=ids.device)
        return ids.gather(1, index.clamp(max=ids.size(1) - 1)), ends.clamp(max=limit) - 1

    def _sample(
        self, ids: torch.Tensor, last: torch.Tensor, state: Any, grammar: CodeGrammar | None
    ) -> list[int]:
        """``generate_tokens`` tokens sampled after one prompt ``ids`` ``[1, T]``."""
        ends = torch.full((1,), ids.size(1), device=ids.device)
        return self._sample_batch(ids, [ids.size(1)], ends, last, state, grammar)[0]

    def _sample_batch(
        self,
        ids: torch.Tensor,
        lengths: list[int],
        ends: torch.Tensor,
        last: torch.Tensor,
        state: Any,
        grammar: CodeGrammar | None,
    ) -> list[list[int]]:
        """``generate_tokens`` tokens sampled after each prompt (its ``last`` context vector,
        its ``state``), all rows drawn together: one ``multinomial`` over ``[B, V]`` a step, so
        a seed's draws depend on the batch (``data.predict_batch_size``), and are the same
        again for the same batches. Over Hybrid-LightRNN codes (a ``grammar``), that many
        words, each code drawn among those that may follow the last; every row goes on until
        each has its words, then each is cut at its own. The draws stay on the device until
        the end (one read-back), but, over codes, a check a step past ``generate_tokens``."""
        n, rows = self.generate_tokens, torch.arange(len(lengths), device=ids.device)
        previous = ids[rows, ends - 1]
        words = torch.zeros(len(lengths), dtype=torch.long, device=ids.device)
        sampled: list[torch.Tensor] = []
        while True:
            log_probs = self.head.log_prob(last)
            if grammar is not None:
                log_probs = grammar.restrict(log_probs, previous)
            token = torch.multinomial((log_probs / self.temperature).softmax(-1), 1)  # [B, 1]
            sampled.append(token[:, 0])
            if grammar is None:
                if len(sampled) == n:
                    break
            else:
                words = words + ~grammar.is_row[token[:, 0]]
                if len(sampled) >= n and not bool((words < n).any()):
                    break
            if self.backbone.carries_state:
                hidden, state = self.backbone(token, state)
                last = hidden[:, -1]
            else:  # re-read each context, one token longer
                last, ids = self._extend(ids, lengths, ends, token)
                lengths, ends = [length + 1 for length in lengths], ends + 1
            previous = token[:, 0]
        drawn = torch.stack(sampled, dim=1).tolist()
        if grammar is None:
            return drawn
        is_row = grammar.is_row.tolist()
        return [_first_words(codes, is_row, n) for codes in drawn]

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
        # the next windows see the same context as without the stop, in the backbone's dtype:
        # a fit stopped under bf16-true and resumed under 32-true (or the reverse) gave the
        # LSTM the checkpoint's bfloat16 state beside float32 weights, and it stopped with
        # "could not create a primitive descriptor" (CUDA: "Input and hidden tensors are not
        # the same dtype"); under a mixed precision the weights' float32, cast by autocast
        if state is not None:
            dtype = next(
                (p.dtype for p in self.backbone.parameters() if p.is_floating_point()), None
            )
            self._state["train"] = apply_to_collection(
                state,
                torch.Tensor,
                lambda t: t.to(self.device, dtype if t.is_floating_point() else t.dtype),
            )


def _first_words(codes: list[int], is_row: list[bool], words: int) -> list[int]:
    """The codes of the first ``words`` words (a word ends at a code that is not a row)."""
    for i, code in enumerate(codes):
        words -= not is_row[code]
        if words == 0:
            return codes[: i + 1]
    return codes


def _batch_dims(one: Any, two: Any) -> Any:
    """Where a state read for one row and for two differ: each tensor's batch dimension."""
    if one is None:
        return None
    if isinstance(one, torch.Tensor):
        differ = [d for d, (a, b) in enumerate(zip(one.shape, two.shape, strict=True)) if a != b]
        return differ[0] if differ else None
    return type(one)(_batch_dims(a, b) for a, b in zip(one, two, strict=True))


def _state_rows(state: Any, dims: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a state's batch."""
    if state is None or dims is None:
        return state
    if isinstance(state, torch.Tensor):
        return state.narrow(dims, start, stop - start).contiguous()
    return type(state)(_state_rows(s, d, start, stop) for s, d in zip(state, dims, strict=True))


def _state_cat(states: list[Any], dims: Any) -> Any:
    """States of consecutive row blocks, as one."""
    first = states[0]
    if first is None or dims is None:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(states, dim=dims)
    return type(first)(_state_cat([s[i] for s in states], d) for i, d in enumerate(dims))


def _state_select(state: Any, dims: Any, index: torch.Tensor) -> Any:
    """The state's rows ``index`` (in that order, repeats allowed)."""
    if state is None or dims is None:
        return state
    if isinstance(state, torch.Tensor):
        return state.index_select(dims, index).contiguous()
    return type(state)(_state_select(s, d, index) for s, d in zip(state, dims, strict=True))
