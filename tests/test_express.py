"""The express lane of small synchronous allreduces (gradsync/pipeline/express.py).

Through ``gradsync run`` at 2, 3 and 4 ranks (tests/ranks/express.py): closed-form results
for every dtype, op and small count on the lane, named and unnamed, beside ranks on the full
road, and with the compiled road off; a mismatch raised on every rank, of names and of an
unnamed call's dtype, op or count (op and count in the jobs of the closed forms, after them).
Then the engine's side of the lane alone.
"""

import threading

import pytest

from gradsync.pipeline.engine import Engine
from harness import launch


@pytest.mark.multiprocess
# With a mismatch (3-mixed-op, 4-lane-count): then the unnamed mismatch of
# test_unnamed_mismatch_raises_on_every_rank, in a second job of the same ranks (one start-up).
@pytest.mark.parametrize("n,mode,mismatch", [
    pytest.param(2, "lane", None, marks=pytest.mark.slow), (3, "mixed", "op"),
    (4, "lane", "count"), (2, "off", None)])
def test_lane_matches_the_closed_form(n, mode, mismatch):
    env = {"GRADSYNC_SHM_FAST": "0"} if mode == "off" else None
    args = (mode, f"+{mismatch}") if mismatch else (mode,)
    result = launch(n, "express.py", *args, timeout=150, env=env)
    assert result.returncode == 0, result
    assert result.output.count("express ok") == n * (2 if mismatch else 1), result
    taken = [int(line.rsplit(" ", 1)[1]) for line in result.output.splitlines()
             if "express ok" in line]
    if mode == "off":
        assert taken == [0] * n, result.output
    else:
        assert max(taken) > 0, result.output


@pytest.mark.multiprocess
# (3, "mixed", "op") and (4, "lane", "count") run after the closed forms, in the jobs of
# test_lane_matches_the_closed_form[3-mixed-op] and [4-lane-count]
@pytest.mark.parametrize("n,mode,what", [(2, "lane", "dtype")])
def test_unnamed_mismatch_raises_on_every_rank(n, mode, what):
    result = launch(n, "express.py", mode, what, timeout=90)
    assert result.returncode == 0, result.output
    assert result.output.count("express ok") == n, result.output


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
