"""The test harness itself: a job that hangs is ended by its deadline, with the stack of the
hung rank dumped and no rank left running."""

import time

import pytest

from harness import MARK, kill_marked, launch, marked, new_mark

pytestmark = pytest.mark.multiprocess


def test_a_hung_job_dumps_stacks_and_leaves_no_rank_behind():
    start = time.monotonic()
    mark = new_mark()  # finds this job's ranks, and no other job's on the machine
    result = launch(2, "hang.py", timeout=14, env={MARK: mark})  # rank deadline: 14 - 8 = 6 s
    left = marked(mark)
    kill_marked(mark)
    assert result.returncode != 0, result
    assert time.monotonic() - start < 14
    # faulthandler's dump ("Timeout (0:00:06)!" then each thread's stack) from the first rank
    # to reach its deadline; the launcher then stops the other.
    assert "Timeout (0:00:06)!" in result.output, result
    assert "hang.py" in result.output, result
    assert "gradsync run: rank" in result.output, result
    assert left == [], f"ranks still running: {left}"
