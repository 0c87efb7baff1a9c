"""The lean path of small collectives: size-1 shortcut, per-size plans (tests/ranks/lean.py),
and the memory of plans in the planner."""

import pytest

from gradsync.collectives import planner
from gradsync.config import Config
import small_jobs


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [1, 2, 3])
def test_lean_path_matches_the_closed_form(n):
    # tests/ranks/lean.py, in the job it shares with other scripts (small_jobs.py)
    result = small_jobs.result(n)
    assert small_jobs.ran(result, "lean.py", n), result
    assert small_jobs.output(result, "lean.py").count("lean ok") == n, result


def test_plans_decide_once_per_size_and_request(monkeypatch):
    calls = []
    real = planner.choose_allreduce

    def counting(*args):
        calls.append(args[:3])
        return real(*args)

    monkeypatch.setattr(planner, "choose_allreduce", counting)
    plans = planner.Plans(4, Config(), has_shm_group=False, limit=3)
    for _ in range(5):
        assert plans.allreduce(1000) == "doubling"
        assert plans.allreduce(1 << 30) == "ring"
        assert plans.allreduce(1000, "ring") == "ring"
    assert len(calls) == 3
    assert plans.allreduce(2000) == "doubling"  # past the limit: forgets, then remembers
    assert len(plans._chosen) == 1
    with pytest.raises(ValueError, match="unknown allreduce algorithm 'nope'"):
        plans.allreduce(1000, "nope")
    assert (1000, "nope") not in plans._chosen
