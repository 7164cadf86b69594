"""AWD-LSTM (Merity, Keskar, Socher 2018), the backbone of the MoS and Mixtape PTB results.

Regularisation, as in the MoS paper's setting (mos-hybrid-lightrnn-bpe.txt builds on it;
Mixtape Table 3 uses it):

- weight-dropped hidden-to-hidden matrices (DropConnect on ``W_hh``, one mask per forward,
  shared by every time step and sequence);
- locked (variational) dropout on the embedded inputs, between layers and on the output;
- embedding dropout: whole word types dropped from the embedding for a batch;
- activation regularisation on the last layer: AR ``alpha * mean(dropped_output^2)`` and
  temporal AR ``beta * mean((h_t - h_{t-1})^2)`` on the output before its dropout, offered to
  the task through :meth:`LMBackbone.extra_loss`.

NT-ASGD and fine-tuning are the optimizer's business: ``app.callbacks.NTASGD``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lightning_modules.backbones.base import check_dropout
from lightning_modules.backbones.lstm import LSTMBackbone
from lightning_modules.errors import ModelConfigError


class WeightDroppedLSTM(nn.Module):
    """One ``nn.LSTM`` layer whose hidden-to-hidden matrix is dropped out (DropConnect) in
    training. The parameters stay the LSTM's own (same state-dict names as ``nn.LSTM``); the
    dropped matrix is passed in for one call with ``torch.func.functional_call``."""

    def __init__(self, input_size: int, hidden_size: int, weight_dropout: float) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)
        self.weight_dropout = weight_dropout

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if not (self.training and self.weight_dropout > 0):
            return self.lstm(x, state)
        dropped = F.dropout(self.lstm.weight_hh_l0, self.weight_dropout, training=True)
        with warnings.catch_warnings():
            # cuDNN copies weights that are not one contiguous block (the dropped matrix is
            # new at every call): expected here, as in the original AWD-LSTM code
            warnings.filterwarnings("ignore", ".*not part of single contiguous chunk.*")
            return functional_call(self.lstm, {"weight_hh_l0": dropped}, (x, state))


class AWDLSTMBackbone(LSTMBackbone):
    """Embedding -> ``num_layers`` weight-dropped LSTMs -> context vectors.

    Defaults are the AWD-LSTM's PTB settings (Merity et al. 2018); the MoS setting is
    ``embedding_size=280, hidden_size=960, output_size=620, hidden_dropout=0.225`` with a
    MoS head projecting back to 280 (``configs/backbones/awd_lstm_mos_ptb.yaml``).

    Args:
        vocab_size: linked from the data module by the CLI.
        embedding_size: input embedding size (the head's output embedding size when tied).
        hidden_size: size of every LSTM layer but the last.
        num_layers: stacked LSTM layers (3 in AWD-LSTM).
        output_size: size of the last layer, i.e. of the context vectors given to the head.
            Default: ``embedding_size`` (so a plain softmax head can be tied).
        input_dropout: locked dropout on the embedded inputs ("dropouti").
        hidden_dropout: locked dropout between LSTM layers ("dropouth").
        output_dropout: locked dropout on the last layer's output ("dropout").
        embedding_dropout: probability of dropping a word type from the embedding for a
            batch ("dropoute").
        weight_dropout: DropConnect on the hidden-to-hidden matrices ("wdrop").
        ar_alpha: activation regularisation weight on the dropped last-layer output.
        tar_beta: temporal activation regularisation weight on the last layer's output.
    """

    @classmethod
    def output_size_from(cls, init_args: Mapping[str, Any]) -> int:
        output_size = init_args.get("output_size")  # (0 is not unset: see LSTMBackbone's)
        return init_args.get("embedding_size", 400) if output_size is None else output_size

    def __init__(
        self,
        vocab_size: int,
        embedding_size: int = 400,
        hidden_size: int = 1150,
        num_layers: int = 3,
        output_size: int | None = None,
        input_dropout: float = 0.4,
        hidden_dropout: float = 0.25,
        output_dropout: float = 0.4,
        embedding_dropout: float = 0.1,
        weight_dropout: float = 0.5,
        ar_alpha: float = 2.0,
        tar_beta: float = 1.0,
    ) -> None:
        if num_layers < 1:
            raise ModelConfigError(f"AWDLSTMBackbone num_layers must be >= 1, got {num_layers}")
        for name, value in (
            ("input_dropout", input_dropout),
            ("hidden_dropout", hidden_dropout),
            ("output_dropout", output_dropout),
            ("embedding_dropout", embedding_dropout),
            ("weight_dropout", weight_dropout),
        ):
            check_dropout(name, value)
        if ar_alpha < 0 or tar_beta < 0:
            raise ModelConfigError(
                f"AWDLSTMBackbone ar_alpha and tar_beta must be >= 0, got {ar_alpha}, {tar_beta}"
            )
        self.weight_dropout = weight_dropout  # read by _layer, during LSTMBackbone.__init__
        super().__init__(
            vocab_size,
            embedding_size,
            hidden_size,
            num_layers,
            embedding_size if output_size is None else output_size,
            input_dropout,
            hidden_dropout,
            output_dropout,
        )
        self.embedding_dropout = embedding_dropout
        self.ar_alpha, self.tar_beta = ar_alpha, tar_beta
        self._extra_loss: torch.Tensor | None = None

    def _layer(self, input_size: int, hidden_size: int) -> nn.Module:
        return WeightDroppedLSTM(input_size, hidden_size, self.weight_dropout)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.embedding(tokens)
        if not (self.training and self.embedding_dropout > 0):
            return embedded
        # one keep/drop decision per word type for the whole batch, rescaled (AWD's dropoute)
        keep = self.embedding.weight.new_empty(self.embedding.num_embeddings)
        keep.bernoulli_(1 - self.embedding_dropout).div_(1 - self.embedding_dropout)
        return embedded * keep[tokens].unsqueeze(-1)

    def forward(
        self, tokens: torch.Tensor, state: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        x, new_state = self._recur(tokens, state)
        output = self.output_dropout(x)
        if self.training and (self.ar_alpha > 0 or self.tar_beta > 0):
            self._extra_loss = self._activation_regularisation(x, output)
        return output, new_state

    def _activation_regularisation(self, raw: torch.Tensor, dropped: torch.Tensor) -> torch.Tensor:
        """AR on the dropped output, TAR on the raw one (Merity et al. 2018, Sec. 4.6)."""
        loss = self.ar_alpha * dropped.float().pow(2).mean()
        if raw.size(1) > 1:
            loss = loss + self.tar_beta * (raw[:, 1:] - raw[:, :-1]).float().pow(2).mean()
        return loss

    def extra_loss(self) -> torch.Tensor | None:
        """AR + TAR of the last training forward (then forgotten, so a term is added once)."""
        loss, self._extra_loss = self._extra_loss, None
        return loss
