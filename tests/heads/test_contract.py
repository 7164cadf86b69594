"""The head contract (``tests/heads/contract.py``) on every head of its registry ``HEADS``."""

import pytest

from tests.heads.contract import HEADS, each_check, run_check

pytestmark = pytest.mark.usefixtures("one_thread")


@each_check
@pytest.mark.parametrize("make", HEADS.values(), ids=HEADS.keys())
def test_contract(check, make):
    run_check(check, make)
