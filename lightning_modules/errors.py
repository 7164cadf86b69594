"""User errors of the model layer (see ``heads/errors.py`` for the base class and the head's
own: ``HeadConfigError``, ``CheckpointMismatchError``)."""

from heads.errors import UserError


class ModelConfigError(UserError, ValueError):
    """A model option that cannot work (sizes that do not fit, values out of range)."""


class CheckpointPathError(UserError, FileNotFoundError):
    """A checkpoint path (``--ckpt_path``, ``pretrained_checkpoint``) names no file."""


class NonFiniteLossError(UserError, FloatingPointError):
    """The loss became NaN or infinite: training stops instead of continuing silently."""
