import os
import subprocess
import sys

import pytest

from app.machine import host_use, host_use_between

# 0.5 s of CPU, then a line that says so, then idle until killed
BUSY = "import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.5: pass\n" \
       "print('done', flush=True)\ntime.sleep(60)"  # fmt: skip


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts children from /proc")
def test_host_use_counts_a_busy_child_process_and_the_wall_clock():
    """A child that burns 0.5 s of CPU between two snapshots is counted; the wall clock too
    (at least the child's 0.5 s)."""
    before = host_use()
    child = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"  # its work done, however busy the host
        spent = host_use_between(before, host_use())
    finally:
        child.kill()
        child.communicate()
    assert spent["wall_s"] >= 0.5
    assert spent["children_cpu_s"] >= 0.45
    assert spent["process_cpu_s"] >= 0.0


def test_host_use_between_keeps_a_missing_count_missing():
    before = {"wall_s": 1.0, "process_cpu_s": 2.0, "children_cpu_s": None}
    after = {"wall_s": 4.5, "process_cpu_s": 2.25, "children_cpu_s": None}
    assert host_use_between(before, after) == {"wall_s": 3.5, "process_cpu_s": 0.25,
                                               "children_cpu_s": None}  # fmt: skip
