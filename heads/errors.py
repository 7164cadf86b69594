"""The project's user errors: every one derives from :class:`UserError`.

A ``UserError`` means "fix your config, data or command line": ``cli.py`` prints its message as
one line (exit status 2) instead of a stack trace. Each layer defines its own subclasses
(``datamodules/errors.py``, ``lightning_modules/errors.py``); the base lives here, in the lowest
layer, so that every layer can derive from it.
"""


class UserError(Exception):
    """An error the user fixes in their config, data or command line; its message names what."""


def user_error(exc: BaseException | None) -> UserError | None:
    """The user error at the root of ``exc`` (jsonargparse and ``build()`` wrap them), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class HeadConfigError(UserError, ValueError):
    """A head option that cannot work (bad K, ratio, sizes...)."""


class CheckpointMismatchError(UserError, ValueError):
    """A checkpoint trained with another head (or head structure) than the one configured."""
