"""The test harness itself: a job that hangs is ended by its deadline, with the stack of the
hung rank dumped and no rank left running."""

import subprocess
import time

import pytest

from harness import launch

pytestmark = pytest.mark.multiprocess


def test_a_hung_job_dumps_stacks_and_leaves_no_rank_behind():
    start = time.monotonic()
    result = launch(2, "hang.py", timeout=14)  # each rank's own deadline: 14 - 8 = 6 s
    assert result.returncode != 0, result
    assert time.monotonic() - start < 14
    # faulthandler's dump ("Timeout (0:00:06)!" then each thread's stack) from the first rank
    # to reach its deadline; the launcher then stops the other.
    assert "Timeout (0:00:06)!" in result.output, result
    assert "hang.py" in result.output, result
    assert "gradsync run: rank" in result.output, result
    left = subprocess.run(["pgrep", "-f", "tests/ranks/hang.py"], capture_output=True, text=True)
    assert left.stdout == "", f"ranks still running: {left.stdout}"
