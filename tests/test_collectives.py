"""Every collective through the real launcher at 1, 2, 3 and 4 ranks, against NumPy.

The rank side is tests/ranks/sweep.py; it sweeps op x dtype x element count x algorithm
(including the shared-memory one when every rank is on one host) and exits non-zero at the
first wrong element, printing what it was.
"""

import pytest

from harness import launch, spawn

pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_sweep_default_transport(n):
    result = launch(n, "sweep.py", timeout=240)
    assert result.returncode == 0, result
    assert result.output.count("checks passed") == n, result
    # The small shm allreduces took the compiled road (tests/test_shm_fast.py tests both).
    assert result.output.count("shm road compiled") == (n if n > 1 else 0), result


def test_sweep_on_the_python_shm_road():
    result = launch(3, "sweep.py", timeout=240, env={"GRADSYNC_SHM_FAST": "0"})
    assert result.returncode == 0, result
    assert result.output.count("shm road python") == 3, result


@pytest.mark.parametrize("n", [3])
def test_sweep_over_tcp(n):
    result = launch(n, "sweep.py", "tcp", timeout=240, env={"GRADSYNC_TRANSPORT": "tcp"})
    assert result.returncode == 0, result
    assert result.output.count("checks passed") == n, result


@pytest.mark.parametrize("layout", ["aabb", pytest.param("abab", marks=pytest.mark.slow), "abcab"])
def test_sweep_on_emulated_hosts(layout):
    # Rank r plays host layout[r]: shared memory inside a host, TCP between hosts; "abab"
    # numbers ranks across hosts alternately, "abcab" has uneven hosts. The hierarchical and
    # topology-ordered algorithms run here on real processes.
    ranks = spawn(len(layout), "sweep.py", timeout=240,
                  per_rank_env=lambda r: {"GRADSYNC_HOSTNAME": f"host-{layout[r]}"})
    for r in ranks:
        assert r.returncode == 0, r.output
        assert "checks passed" in r.output, r.output
