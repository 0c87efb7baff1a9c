"""The express lane of small synchronous allreduces (gradsync/pipeline/express.py).

At 2, 3 and 4 ranks on one host (tests/ranks/express.py): closed-form results for every
dtype, op and small count on the lane, named and unnamed, beside ranks on the full road, and
with the compiled road off; a mismatch raised on every rank, of names and of an unnamed call's
dtype, op or count (op and count in the jobs of the closed forms, after them). Then the
engine's side of the lane alone.

The ranks are forked from one process that imported torch once (tests/forked_jobs.py): what
is checked is the lane inside each rank's runtime, which the launcher's start-up (an
interpreter and torch's import per rank, and one for the launcher's store) adds nothing to.
"""

import threading

import pytest

from gradsync.pipeline.engine import Engine
import forked_jobs


def express_job(n: int, *args: str, env: dict | None = None) -> list:
    """Runs tests/ranks/express.py with ``args`` in ``n`` forked ranks of one host; checks
    that every rank exited 0 (a failed check exits 1 naming it) and returns each rank's
    ``express ok`` counts: how many of its calls took the lane, once per job it ran."""
    ranks = forked_jobs.spawn(n, "express.py", *args, timeout=150, env=env, lean=True)
    assert [rank.returncode for rank in ranks] == [0] * n, "\n".join(ranks)
    return [[int(line.rsplit(" ", 1)[1]) for line in rank.output.splitlines()
             if line.startswith("express ok")] for rank in ranks]


@pytest.mark.multiprocess
# With a mismatch (3-mixed-op, 4-lane-count): then the unnamed mismatch of
# test_unnamed_mismatch_raises_on_every_rank, in a second job of the same ranks (one start-up).
@pytest.mark.parametrize("n,mode,mismatch", [
    pytest.param(2, "lane", None, marks=pytest.mark.slow), (3, "mixed", "op"),
    (4, "lane", "count"), (2, "off", None)])
def test_lane_matches_the_closed_form(n, mode, mismatch):
    env = {"GRADSYNC_SHM_FAST": "0"} if mode == "off" else None
    args = (mode, f"+{mismatch}") if mismatch else (mode,)
    taken = express_job(n, *args, env=env)
    assert [len(counts) for counts in taken] == [2 if mismatch else 1] * n, taken
    first = [counts[0] for counts in taken]  # the closed forms' job
    if mode == "off":
        assert first == [0] * n, taken
    elif mode == "mixed":
        assert first[0] == 0 and min(first[1:]) > 0, taken  # rank 0 on the full road
    else:
        assert min(first) > 0, taken


@pytest.mark.multiprocess
# (3, "mixed", "op") and (4, "lane", "count") run after the closed forms, in the jobs of
# test_lane_matches_the_closed_form[3-mixed-op] and [4-lane-count]
@pytest.mark.parametrize("n,mode,what", [(2, "lane", "dtype")])
def test_unnamed_mismatch_raises_on_every_rank(n, mode, what):
    taken = express_job(n, mode, what)
    assert all(len(counts) == 1 and counts[0] > 0 for counts in taken), taken


class _World:
    failure = None


def test_claim_is_refused_while_anything_is_queued_or_running():
    engine = Engine(_World())
    assert engine.claim_inline()
    assert not engine.claim_inline()  # running
    engine.end_inline()
    release = threading.Event()
    handle = engine.submit(release.wait, "blocker")
    assert not engine.claim_inline()  # queued or running on the progress thread
    release.set()
    handle.wait(10)
    engine.drain()
    assert engine.claim_inline()
    engine.end_inline()
    engine.stop()


def test_end_inline_wakes_a_drain():
    engine = Engine(_World())
    assert engine.claim_inline()
    drained = threading.Event()
    waiter = threading.Thread(target=lambda: (engine.drain(), drained.set()))
    waiter.start()
    assert not drained.wait(0.2)  # the claimed operation is still running
    engine.end_inline()
    assert drained.wait(10)
    waiter.join()
    engine.stop()
