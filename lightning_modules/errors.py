"""User errors of the model layer (see ``heads/errors.py`` for the base class and the head's
own: ``HeadConfigError``, ``CheckpointMismatchError``), and its warning lines (``warn_once``)."""

import functools
import logging

from lightning.pytorch.utilities.rank_zero import rank_zero_only

from heads.errors import UserError

log = logging.getLogger(__name__)


@functools.cache
@rank_zero_only
def warn_once(message: str) -> None:
    """A ``warning:`` line (the shape of the CLI's), once a process, from rank 0 under DDP
    (a DS mitosis rebuilds the optimizers, and the schedule with them: said once)."""
    log.warning(f"warning: {message}")


class ModelConfigError(UserError, ValueError):
    """A model option that cannot work (sizes that do not fit, values out of range)."""


class CheckpointPathError(UserError, FileNotFoundError):
    """A checkpoint path (``--ckpt_path``, ``pretrained_checkpoint``) names no file."""


class NonFiniteLossError(UserError, FloatingPointError):
    """The loss became NaN or infinite: training stops instead of continuing silently."""
