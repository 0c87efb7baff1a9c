"""Adasum through the real launcher: 2, 3 and 4 ranks over shared memory and over TCP.

The rank side is tests/ranks/adasum_check.py: every dtype and buffer layout against the
reference of test_adasum.py, and the same bits on every rank.
"""

import pytest

from harness import launch
import small_jobs

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("n, transport", [
    (2, "shm"), (2, "tcp"), (3, "shm"), (3, "tcp"), (4, "shm"),
    pytest.param(4, "tcp", marks=pytest.mark.slow),  # 4 ranks over shm and 3 over tcp stay
])
def test_adasum_over_the_job(n, transport):
    entry = f"adasum_check.py:{transport}"
    if entry in small_jobs.SCRIPTS[n]:  # in the job of n ranks that it shares (small_jobs.py)
        result = small_jobs.result(n)
        assert small_jobs.ran(result, entry, n), result
        output = small_jobs.output(result, entry)
    else:
        result = launch(n, "adasum_check.py", transport, timeout=120)
        assert result.returncode == 0, result
        output = result.output
    assert output.count(f"adasum checks passed over {transport}") == n, result
