"""Command-line entry point: ``python cli.py fit|validate|test|predict --config ...``.

The CLI itself (links, checks) is ``app/cli/lightning_cli.py``. Errors that mean "fix your config
or data" (``heads.errors.UserError``) are printed as one line with exit status 2.
"""

from __future__ import annotations

import sys
import warnings

from app.cli.console import exit_status, quiet_lightning, show_app_log
from app.cli.lightning_cli import AppCLI, make_cli


def main(argv: list[str] | None = None) -> AppCLI:
    # Our BPTT loaders are deliberately single-process: the streams are memory-mapped views.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*IterableDataset.*has `__len__` defined.*")
    warnings.filterwarnings("ignore", ".*infer the batch indices.*")
    # overfit_batches: Lightning cannot tell that the BPTT windows (an IterableDataset) come
    # in order; translation keeps its training batches alike itself (LengthSortedSampler)
    warnings.filterwarnings("ignore", ".*requested to overfit but enabled .* shuffling.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*is deprecated.*")
    # Lightning's own all_gather (a checkpoint's per-rank epoch state under DDP) calls it
    warnings.filterwarnings("ignore", ".*torch.distributed.nn.functional.all_gather is deprec.*")
    quiet_lightning()
    show_app_log()  # data cache hits and misses, the heads' decisions
    return make_cli(sys.argv[1:] if argv is None else argv)


def console_main(argv: list[str] | None = None) -> int:
    return exit_status(lambda: main(argv))


if __name__ == "__main__":
    sys.exit(console_main())
