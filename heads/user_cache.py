"""The one folder where the project keeps what it builds once per machine.

``$OUTPUT_HEADS_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/output-heads``. Below it, one folder
per user: ``data/`` (prepared corpora, ``datamodules/cache.py``), ``adaptive/`` (the adaptive
softmax's measured cost models) and ``native/`` (the compiled C kernels). Nothing in it is
deleted automatically; removing it only costs the time to rebuild.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "OUTPUT_HEADS_CACHE"


def cache_root(*parts: str) -> Path:
    """The cache root, or the folder ``parts`` below it (not created)."""
    if os.environ.get(CACHE_ENV):
        root = Path(os.environ[CACHE_ENV]).expanduser()
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "output-heads"
    return root.joinpath(*parts)
