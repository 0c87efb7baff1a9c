"""Recovery without rollback (gradsync/elastic/recovery.py), end to end.

Each job trains one epoch of tests/ranks/elastic_redo.py on 4 workers under ``gradsync run
--min-np 2``; a worker dies at a chosen point and every survivor compares its parameters with
a replay of the run the rule prescribes (``FIRST`` updates at size 4, the rest at size 3),
computed in one process: equal up to float rounding (the allreduce sums in another order),
while the runs of the other rules differ by far more (1e-2 and up: other updates). No commit
is ever made, so a roll-back goes back to the start.
"""

import re

import pytest

from harness import launch, worker_results

pytestmark = pytest.mark.multiprocess

SURVIVORS = ["localhost[0]", "localhost[1]", "localhost[3]"]
CLOSE = 1e-5  # float rounding of 7-8 SGD steps; a step more or less moves the weights ~1e-3


def run(mode: str, at: int, first: int, env=None):
    result = launch(4, "elastic_redo.py", mode, "2", str(at), str(first), timeout=240,
                    env=env, launcher_args=("--min-np", "2"))
    assert result.returncode == 0, result
    found = worker_results(result.output)
    assert sorted(found) == SURVIVORS, result
    assert {r["size"] for r in found.values()} == {"3"}, result
    assert len({r["hash"] for r in found.values()}) == 1, result  # identical parameters
    assert all(float(r["refdiff"]) < CLOSE for r in found.values()), result
    plans = set(re.findall(r"PLAN (.*)", result.output))
    assert len(plans) == 1, result  # every survivor followed the same plan
    return result, plans.pop()


def test_a_worker_killed_mid_allreduce_costs_only_the_step_in_flight():
    # 3 updates at size 4, the 4th in flight when worker 2 dies: the survivors redo it at
    # size 3 from their live state, although nothing was ever committed.
    result, plan = run("redo", 3, 3)
    assert plan == "action=go_on updates=3 lost=0", result
    assert "elastic recovery: generation 1, 3 workers, go_on from update 3" in result.output


@pytest.mark.slow
def test_survivors_one_update_apart_take_the_state_of_the_one_ahead():
    # worker 1 applied update 4 (its allreduce had completed), workers 0 and 3 failed before
    # applying it: all take worker 1's state, so update 4 is kept.
    result, plan = run("ahead", 3, 4)
    assert plan == "action=go_on updates=4 lost=0", result


@pytest.mark.slow
def test_a_failure_between_an_update_and_its_bookkeeping_rolls_back():
    # a collective of the script's own after update 4 and before record_batch: the live
    # state is no resume point, so the survivors roll back to their last save (the start).
    result, plan = run("metric", 3, 0)
    assert plan == "action=rollback updates=0 lost=4", result


@pytest.mark.slow
def test_rollback_always_goes_back_to_the_last_commit():
    result, plan = run("redo", 3, 0, env={"ELASTIC_ROLLBACK": "always"})
    assert plan == "action=rollback updates=0 lost=3", result


@pytest.mark.slow
def test_a_stopped_worker_the_launcher_cannot_kill_comes_back_and_is_fenced(tmp_path):
    # Worker 2 is SIGSTOPped mid-step; its heartbeat goes silent, the launcher's SIGKILL
    # reaches only its parent process, the others go on at size 3 and run collectives until
    # worker 2, SIGCONTed, has tried to go on: it must end with ExcludedError naming the
    # generation and the reason, and the survivors must end exactly as if it never came back.
    mark = tmp_path / "stale"
    result, plan = run("stale", 3, 3, env={
        "GRADSYNC_HEARTBEAT_TIMEOUT": "3", "GRADSYNC_HEARTBEAT_INTERVAL": "0.5",
        "STALE_MARK": str(mark)})
    assert plan == "action=go_on updates=3 lost=0", result
    assert mark.exists(), result
    excluded = mark.read_text()
    assert excluded.startswith("EXCLUDED excluded from the job at generation 0: worker "
                               "localhost[2] (rank 2 of generation 0) sent no heartbeats and "
                               "was killed"), excluded
    assert "the job went on without it (generation 1's workers:" in excluded, excluded
