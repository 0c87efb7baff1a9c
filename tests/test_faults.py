"""Failures end in the documented error on every rank, within a deadline; nothing hangs.

Ranks are started here the way torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, ...),
without gradsync's launcher, because the launcher would stop the survivors of a failure
before they could report what they saw. tests/ranks/faults.py is the rank side. Each rank is
a process of its own, forked from one that imported torch, NumPy and gradsync once
(tests/forked_jobs.py; faults.py trains nothing): its exit status, its signals and its
sockets are its own, as when each rank was an interpreter of its own.
"""

import functools
import re

import pytest

import forked_jobs

pytestmark = pytest.mark.multiprocess


def spawn(n: int, *args: str, timeout: float, **kwargs):
    """``n`` ranks of faults.py with ``args``, forked (``forked_jobs.spawn``: ``env``,
    ``per_rank_env``) from a lean process."""
    return forked_jobs.spawn(n, *args, timeout=timeout, lean=True, **kwargs)


def results(ranks):
    out = {}
    for r in ranks:
        m = re.search(r"RESULT rank=(\d+) (.*)", r.output)
        out[r.rank] = m.group(2) if m else f"<no result, exit {r.returncode}>\n{r.output[-3000:]}"
    return out


def elapsed(ranks):
    return [float(m.group(1)) for r in ranks for m in [re.search(r"ELAPSED rank=\d+ ([\d.]+)", r.output)] if m]


@pytest.mark.parametrize("n, victim, algorithm", [(2, 1, "auto"), (3, 2, "ring"), (4, 1, "auto"),
                                                  (3, 0, "doubling")])
def test_killed_rank_is_a_lost_peer_on_every_other_rank(n, victim, algorithm):
    ranks = spawn(n, "faults.py", "kill", str(victim), timeout=60,
                  env={"FAULT_ALGORITHM": algorithm, "FAULT_TIMEOUT": "30"})
    got = results(ranks)
    for r in range(n):
        if r == victim:
            assert ranks[r].returncode == -9
            continue
        assert got[r].startswith("PeerLostError"), got
        assert f"rank {victim}" in got[r], got
    # lost peers are noticed from closed sockets / vanished pids, far before the 30 s timeout
    assert max(elapsed(ranks)) < 10, elapsed(ranks)


_MISMATCHES = [("shape", r"float32\[10, 5\]"), ("dtype", "float64"), ("op", "op=MAX"),
               ("name", "grad.fc2"), ("kind", "broadcast")]


def mismatch_results(ranks, what):
    """Each rank's RESULT for the entry ``what`` (faults.py mismatch WHAT,...)."""
    out = {}
    for r in ranks:
        m = re.search(rf"RESULT rank=(\d+) what={re.escape(what)} (.*)", r.output)
        out[r.rank] = m.group(2) if m else f"<no result, exit {r.returncode}>\n{r.output[-3000:]}"
    return out


@functools.lru_cache(maxsize=None)
def mismatch_job(n: int, kinds: tuple[str, ...]):
    """One job of ``n`` ranks that runs each entry of ``kinds`` in turn (a mismatch, or the
    intruders' check), a fresh job for each (``shutdown()`` then ``init()`` in the same ranks):
    one start-up for all of them. Run once per pytest process; the exit statuses are not
    checked: the RESULT lines are."""
    return spawn(n, "faults.py", "mismatch", ",".join(kinds), timeout=90)


# Every kind at 2 ranks (one job); at 3 ranks the shape in the default tier, the other kinds in
# the slow one (one job for those four). The default tier's jobs also run the intruders' check
# first and, at 3 ranks, the shape over TCP with the ring: one start-up per size.
_TCP_SHAPE = "shape:tcp:ring"
_DEFAULT_JOB = {2: ("intruders",) + tuple(w for w, _ in _MISMATCHES),
                3: ("intruders", "shape", _TCP_SHAPE)}
_SLOW_AT_3 = tuple(w for w, _ in _MISMATCHES if w != "shape")


@pytest.mark.parametrize("n, what, detail", [(2, w, d) for w, d in _MISMATCHES] + [
    (3, w, d) if w == "shape" else pytest.param(3, w, d, marks=pytest.mark.slow)
    for w, d in _MISMATCHES])
def test_mismatched_collectives_fail_on_every_rank(n, what, detail):
    kinds = _DEFAULT_JOB[n] if n == 2 or what == "shape" else _SLOW_AT_3
    got = mismatch_results(mismatch_job(n, kinds), what)
    for r in range(n):
        assert got[r].startswith("CollectiveMismatchError"), got
        assert re.search(detail, got[r]), got[r]   # the report shows what rank 1 issued
        assert "grad.fc1" in got[r] or what == "kind", got[r]  # ... and what the others did


def test_mismatch_is_caught_by_the_tcp_frames_too():
    # in the 3-rank job of the mismatches: every pair over TCP, the ring's frames
    got = mismatch_results(mismatch_job(3, _DEFAULT_JOB[3]), _TCP_SHAPE)
    assert len(got) == 3, got
    assert all(v.startswith("CollectiveMismatchError") for v in got.values()), got


@pytest.mark.parametrize("n", [2, 3])
def test_intruders_are_dropped_and_the_job_goes_on(n):
    # the first check of the job of the mismatches at n ranks, in its own init()
    ranks = mismatch_job(n, _DEFAULT_JOB[n])
    got = mismatch_results(ranks, "intruders")
    assert all(v.startswith("ok") for v in got.values()), got
    for r in range(1, n):
        assert "rejected=4" in got[r], got
        assert "dropped a connection" in ranks[r].output


def test_a_rank_that_leaves_early_is_a_lost_peer():
    ranks = spawn(3, "faults.py", "exit-early", timeout=60)
    got = results(ranks)
    assert got[1] == "left"
    for r in (0, 2):
        assert got[r].startswith("PeerLostError") and "rank 1" in got[r], got


def test_wrong_secret_fails_init_on_every_rank():
    # The secret guards TCP connections, so each rank plays a different host.
    ranks = spawn(3, "faults.py", "intruders", timeout=60, per_rank_env=lambda r: {
        "GRADSYNC_SECRET": ("ab" if r == 2 else "cd") * 32, "GRADSYNC_HOSTNAME": f"host{r}"})
    for r in ranks:
        assert r.returncode not in (0, None), r.output
        assert "AuthenticationError" in r.output, r.output
