"""The layers import one way (docs/design.md, "Layout"), checked by import-linter's contracts in
pyproject.toml: heads <- datamodules <- lightning_modules <- app <- cli.py."""

import shutil
import subprocess

from tests.conftest import REPO


def test_layers_import_one_way():
    lint = shutil.which("lint-imports")
    assert lint is not None, "import-linter is in requirements.txt: pip install -r requirements.txt"
    done = subprocess.run(
        [lint, "--no-logo", "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
    assert "3 kept, 0 broken" in done.stdout
