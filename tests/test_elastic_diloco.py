"""Streaming DiLoCo under elastic training, end to end (tests/ranks/elastic_diloco.py).

3 workers under ``gradsync run --min-np 2``, DiLoCo over the Horovod API with int8 on the
outer gradient (H = 8, 4 fragments); worker 2 dies at step 10, and the survivors' sync of
fragment 0 started there never completes. They fail at its landing (step 11), roll back to
their commit of step 9 (the window's steps 1-9 are kept: steps 10-11 and the fragment in
flight are lost), take one outer state (rank 0's: anchors, momentum, int8 residuals, step
counter) and finish at size 2 with equal outer states. About 40 s on a loaded machine.
"""

import re

import pytest

from harness import launch, worker_results

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_a_worker_killed_mid_fragment_costs_at_most_the_fragment_in_flight():
    result = launch(3, "elastic_diloco.py", "2", "10", timeout=180,
                    launcher_args=("--min-np", "2"))
    assert result.returncode == 0, result
    found = worker_results(result.output)
    assert sorted(found) == ["localhost[0]", "localhost[1]"], result
    assert {r["size"] for r in found.values()} == {"2"}, result
    assert {r["step"] for r in found.values()} == {"24"}, result
    assert len({r["outer"] for r in found.values()}) == 1, result  # anchors, momenta equal
    recovered = dict(re.findall(r"RECOVERED id=(\S+) step=(\d+ outer=\S+)", result.output))
    assert sorted(recovered) == ["localhost[0]", "localhost[1]"], result
    # Both went on from step 9 (the commit before the fault) with the same whole outer
    # state, residuals and the schedule included.
    assert len(set(recovered.values())) == 1 and all(
        v.startswith("9 ") for v in recovered.values()), result
    plans = set(re.findall(r"PLAN (.*)", result.output))
    assert plans == {"action=rollback updates=9 lost=2"}, result
