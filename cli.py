"""Command-line entry point: ``python cli.py fit|validate|test|predict --config ...``.

The CLI itself (links, checks) is ``app/cli/lightning_cli.py``. Errors that mean "fix your config
or data" (``heads.errors.UserError``) are printed as one line with exit status 2.
"""

from __future__ import annotations

import sys

from app.cli.console import exit_status, quiet_lightning, show_app_log
from app.cli.lightning_cli import AppCLI, make_cli


def main(argv: list[str] | None = None) -> AppCLI:
    quiet_lightning()
    show_app_log()  # data cache hits and misses, the heads' decisions
    return make_cli(sys.argv[1:] if argv is None else argv)


def console_main(argv: list[str] | None = None) -> int:
    return exit_status(lambda: main(argv), signals=True)


if __name__ == "__main__":
    sys.exit(console_main())
