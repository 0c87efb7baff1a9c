"""A process may shut down and initialise again (as test frameworks and notebooks do)."""

import pytest

from harness import launch, spawn

pytestmark = pytest.mark.multiprocess


def test_reinit_under_the_launcher():
    result = launch(3, "reinit.py", timeout=60)
    assert result.returncode == 0, result
    assert result.output.count("reinit ok") == 3


def test_reinit_when_rank0_hosts_the_store():
    ranks = spawn(2, "reinit.py", timeout=60, agent_store=False)
    for r in ranks:
        assert r.returncode == 0 and "reinit ok" in r.output, r.output
