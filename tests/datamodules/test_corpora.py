"""The corpora shipped in ``datamodules/corpora/``: their README's table is what the files hold."""

import hashlib
import lzma
import re

import pytest

from datamodules.text_source import CORPORA

ROW = re.compile(
    r"^\| `(?P<file>[\w./]+\.xz)` \| (?P<lines>[\d,]+) \| (?P<words>[\d,]+) "
    r"\| `(?P<sha>\w{64})` \|$"
)


def readme_rows() -> list[dict[str, str]]:
    text = (CORPORA / "README.md").read_text()
    return [m.groupdict() for line in text.splitlines() if (m := ROW.match(line))]


def test_every_shipped_file_has_a_row():
    assert sorted(row["file"] for row in readme_rows()) == sorted(
        str(p.relative_to(CORPORA)) for p in CORPORA.rglob("*.xz")
    )
    assert len(readme_rows()) == 9


@pytest.mark.parametrize("row", readme_rows(), ids=lambda row: row["file"])
def test_checksum_and_counts_of_the_uncompressed_text(row):
    data = lzma.decompress((CORPORA / row["file"]).read_bytes())
    assert hashlib.sha256(data).hexdigest() == row["sha"]
    assert data.count(b"\n") == int(row["lines"].replace(",", ""))
    assert len(data.decode("utf-8").split()) == int(row["words"].replace(",", ""))
