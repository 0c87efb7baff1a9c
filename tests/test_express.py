"""The express lane of small synchronous allreduces (gradsync/express.py).

Through ``gradsync run`` at 2, 3 and 4 ranks (tests/ranks/express.py): closed-form results
for every dtype, op and small count on the lane, named and unnamed, beside ranks on the full
road, and with the compiled road off; a mismatch raised on every rank, of names and of an
unnamed call's dtype, op or count. Then the engine's side of the lane alone.
"""

import threading

import pytest

from gradsync.engine import Engine
from harness import launch


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,mode", [pytest.param(2, "lane", marks=pytest.mark.slow), (3, "mixed"), (4, "lane"), (2, "off")])
def test_lane_matches_the_closed_form(n, mode):
    env = {"GRADSYNC_SHM_FAST": "0"} if mode == "off" else None
    result = launch(n, "express.py", mode, timeout=120, env=env)
    assert result.returncode == 0, result.output
    assert result.output.count("express ok") == n, result.output
    taken = [int(line.rsplit(" ", 1)[1]) for line in result.output.splitlines()
             if "express ok" in line]
    if mode == "off":
        assert taken == [0] * n, result.output
    else:
        assert max(taken) > 0, result.output


@pytest.mark.multiprocess
@pytest.mark.parametrize("n,mode,what", [(2, "lane", "dtype"), (3, "mixed", "op"),
                                         (4, "lane", "count")])
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
