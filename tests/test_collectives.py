"""Every collective through the real launcher at 1, 2, 3 and 4 ranks, against NumPy.

The launcher's sweeps run in the job of each size that tests/small_jobs.py shares between
several scripts; the sweeps on emulated hosts start their ranks themselves.

The rank side is tests/ranks/sweep.py; it sweeps op x dtype x element count x algorithm
(including the shared-memory one when every rank is on one host) and exits non-zero at the
first wrong element, printing what it was.
"""

import pytest

from forked_jobs import spawn
import small_jobs

pytestmark = pytest.mark.multiprocess


def sweep(n: int, entry: str = "sweep.py") -> str:
    """What ``entry`` (sweep.py, or sweep.py:MODE) printed in the ``n``-rank job it shares with
    other scripts (small_jobs.py), once it returned on every rank."""
    result = small_jobs.result(n)
    assert small_jobs.ran(result, entry, n), result
    return small_jobs.output(result, entry)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sweep_default_transport(n):
    output = sweep(n)
    assert output.count("checks passed") == n, output
    # The small shm allreduces took the compiled road (tests/test_shm_fast.py tests both).
    assert output.count("shm road compiled") == (n if n > 1 else 0), output


def test_sweep_on_the_python_shm_road():
    output = sweep(3, "sweep.py:python")  # init(shm_fast=False)
    assert output.count("checks passed") == 3, output
    assert output.count("shm road python") == 3, output


@pytest.mark.parametrize("n", [3])
def test_sweep_over_tcp(n):
    output = sweep(n, "sweep.py:tcp")  # init(transport="tcp")
    assert output.count("checks passed") == n, output
    assert output.count("shm road none") == n, output  # no shared segment between the pairs


@pytest.mark.parametrize("layout", ["aabb", pytest.param("abab", marks=pytest.mark.slow), "abcab"])
def test_sweep_on_emulated_hosts(layout):
    # Rank r plays host layout[r]: shared memory inside a host, TCP between hosts; "abab"
    # numbers ranks across hosts alternately, "abcab" has uneven hosts. The hierarchical and
    # topology-ordered algorithms run here on real processes. "aabb" runs last in the 4-rank
    # job of small_jobs.py (sweep.py sets its host's name for its own init()).
    if layout == "aabb":
        output = sweep(4, "sweep.py:hosts=aabb")
        assert output.count("checks passed") == 4, output
        # two hosts of two ranks each: the names were this script's, not the job's
        for host in ("host-a", "host-b"):
            assert output.count(f"2 ranks on host {host}") == 2, output
        return
    ranks = spawn(len(layout), "sweep.py", timeout=240, lean=True,
                  per_rank_env=lambda r: {"GRADSYNC_HOSTNAME": f"host-{layout[r]}"})
    for r in ranks:
        assert r.returncode == 0, r.output
        assert "checks passed" in r.output, r.output
