"""User errors of the data layer (see ``heads/errors.py`` for the base class)."""

from heads.errors import UserError


class DataPathError(UserError, FileNotFoundError):
    """The configured data cannot be found or is empty."""


class DataConfigError(UserError, ValueError):
    """A data option that cannot work (sizes, splits...)."""


class ParallelDataError(DataConfigError):
    """Parallel files that do not line up (different line counts) or lack a language."""


class VocabularyMismatchError(UserError, ValueError):
    """A checkpoint was trained with another vocabulary than the data gives now."""


class DataFormatError(DataPathError):
    """A data file that cannot be read as text (not UTF-8)."""


class DataCacheError(DataConfigError):
    """The prepared-data cache cannot be used (a folder that cannot be written...)."""
