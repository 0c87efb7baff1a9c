"""The small-allreduce fast case (once the express lane): a synchronous allreduce prepared once
per distinct call (gradsync/pipeline/operations.prepare_allreduce) and run by the engine like
any operation (Engine.run).

At 2, 3 and 4 ranks on one host (tests/ranks/express.py): closed-form results for every
dtype, op and small count on the lane, named and unnamed, beside ranks on the full road, and
with the compiled road off; a mismatch raised on every rank, of names and of an unnamed call's
dtype, op or count (op and count in the jobs of the closed forms, after them).

In one process, over a World of two ranks whose host segment is a stand-in that records each
call (no peer, so the data is doubled as a sum of two equal ranks would be): the engine's
claim; the fast case and the full road begin with the same words and sequence numbers; a
small call behind a queued one waits its turn as a prepared operation on the progress thread;
an error of the kernel fails the call's record (and a GradsyncError the World, whose failure
later calls raise before they begin).

The ranks are forked from one process that imported torch once (tests/forked_jobs.py): what
is checked is the lane inside each rank's runtime, which the launcher's start-up (an
interpreter and torch's import per rank, and one for the launcher's store) adds nothing to.
"""

import threading
import time

import numpy as np
import pytest

import gradsync as gs
from gradsync import _native, job
from gradsync.collectives import planner
from gradsync.config import load_config
from gradsync.errors import GradsyncError, PeerLostError
from gradsync.flight_recorder import COMPLETED, FAILED, recorder
from gradsync.liveness.pace import meter
from gradsync.pipeline import operations
from gradsync.pipeline.engine import Engine, Handle
from gradsync.transport.comm import Comm
from gradsync.transport.frame import signature_of
import forked_jobs
from test_executor import HeldTake


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


def _engine(way: str) -> Engine:
    """An engine over ``_World``; ``compiled``: with its compiled inline run (which records,
    so it has a track)."""
    if way == "python":
        return Engine(_World())
    engine = Engine(_World(), recorder.track("numpy:test-claim", "numpy API", [0, 1],
                                             "numpy", 60.0, None))
    assert engine.inline is not None, ("the compiled module is not built: pip install -e . "
                                       "(a C compiler and Python's headers)")
    return engine


def _run(engine: Engine, way: str, fn, name: str):
    """``fn()`` through ``Engine.run``'s inline path: in Python, or compiled
    (``Engine.inline``, which calls ``fn(call)``)."""
    if way == "python":
        return engine.run(fn, name, "barrier")
    return engine.inline(lambda call: fn(), name, None, None, 0)


def test_claim_is_refused_while_anything_is_queued_or_running():
    engine = Engine(_World())
    assert engine.claim()
    assert not engine.claim()  # running
    engine.release()
    release = threading.Event()
    handle = engine.submit(release.wait, "blocker", "barrier")
    assert not engine.claim()  # queued or running on the progress thread
    release.set()
    handle.wait(10)
    engine.drain()
    assert engine.claim()
    engine.release()
    engine.stop()


def test_release_wakes_a_drain():
    engine = Engine(_World())
    assert engine.claim()
    drained = threading.Event()
    waiter = threading.Thread(target=lambda: (engine.drain(), drained.set()))
    waiter.start()
    assert not drained.wait(0.2)  # the claimed operation is still running
    engine.release()
    assert drained.wait(10)
    waiter.join()
    engine.stop()


@pytest.mark.parametrize("way", ["python", "compiled"])
def test_an_inline_run_wakes_a_drain_when_it_ends(way):
    # Engine.run writes the executor's release out in place: its end must wake a waiter
    # as ``release`` does (drain waits with no limit here: a lost wake-up hangs it).
    engine = _engine(way)
    running, finish, drained = threading.Event(), threading.Event(), threading.Event()
    caller = threading.Thread(target=lambda: _run(
        engine, way, lambda: (running.set(), finish.wait(10)), "inline"))
    caller.start()
    assert running.wait(10)
    waiter = threading.Thread(target=lambda: (engine.drain(), drained.set()), daemon=True)
    waiter.start()
    deadline = time.monotonic() + 10
    while not engine._sleepers:  # the drain is waiting
        assert time.monotonic() < deadline
        time.sleep(0.001)
    finish.set()
    assert drained.wait(10)
    caller.join()
    engine.stop()


@pytest.mark.parametrize("way", ["python", "compiled"])
def test_an_inline_run_is_refused_while_the_progress_thread_takes_an_item_off_the_queue(way):
    # Engine.run's claim in place, as ``Serial.claim``'s test holds the take: with the queue
    # empty and the asynchronous item taken but not yet run, a synchronous run must queue
    # behind it rather than run first.
    taking, tried = threading.Event(), threading.Event()
    engine = _engine(way)
    engine._queue = HeldTake(taking, tried)
    ran: list[str] = []
    first = engine.submit(lambda: ran.append("asynchronous"), "first", "barrier")
    assert taking.wait(10) and not engine._queue
    submitted, submit = threading.Event(), engine.submit

    def submitting(*args):  # the claim was refused: the call queues (after the held take)
        submitted.set()
        return submit(*args)

    engine.submit = submitting  # type: ignore[method-assign]
    caller = threading.Thread(target=lambda: _run(
        engine, way, lambda: ran.append("synchronous"), "second"))
    caller.start()
    deadline = time.monotonic() + 10
    while not submitted.is_set() and not ran:  # refused, or (wrongly) run at once
        assert time.monotonic() < deadline
        time.sleep(0.001)
    tried.set()
    caller.join(10)
    first.wait(10)
    assert ran == ["asynchronous", "synchronous"]
    engine.stop()


@pytest.mark.parametrize("way", ["python", "compiled"])
def test_an_inline_run_is_refused_while_an_item_waits_in_the_queue(way):
    # The other half of Engine.run's claim in place: the running lock is free, but an item
    # waits in the queue (pushed, the progress thread not yet awake to take it), so a
    # synchronous run must queue behind it. Holding the executor's lock keeps the item there.
    engine = _engine(way)
    ran: list[str] = []
    engine.submit(lambda: ran.append("first"), "first", "barrier").wait(10)  # the thread runs
    queued = Handle("queued")
    submitted, submit = threading.Event(), engine.submit

    def submitting(*args):
        submitted.set()
        return submit(*args)

    engine.submit = submitting  # type: ignore[method-assign]
    with engine._lock:
        engine._queue.append((queued, lambda: ran.append("asynchronous"), None, None))
        caller = threading.Thread(target=lambda: _run(
            engine, way, lambda: ran.append("synchronous"), "second"))
        caller.start()
        deadline = time.monotonic() + 10
        while not submitted.is_set() and len(ran) < 2:  # refused, or (wrongly) run at once
            assert time.monotonic() < deadline
            time.sleep(0.001)
    caller.join(10)
    queued.wait(10)
    assert ran == ["first", "asynchronous", "synchronous"]
    engine.stop()


class _SegmentWorld:
    """A World of two ranks on one host, as ``api`` and ``operations`` see it, whose host
    segment is a stand-in: each call of its compiled one-step road (``small_road``, what a
    prepared allreduce calls) or of its ``shm`` algorithm (``host_allreduce``, the full road's)
    is recorded in ``calls`` with the collective the Comm began, then doubles the data."""

    size, rank, shares_host = 2, 0, True

    def __init__(self):
        self.config = load_config({}, environ={})
        self.comm = Comm(0, 2, {}, self.config.timeout)
        self.plans = planner.Plans(2, self.config, True, None, announce=False)
        self.descriptions: dict = {}
        self.failure: "GradsyncError | None" = None
        self.calls: list[tuple] = []
        self.kernel_error: "BaseException | None" = None
        self.compiled = False

    def small_road(self, op, dtype, nbytes):
        ok = dtype in (np.float32, np.float64, np.int32, np.int64) and 0 < nbytes <= 1024
        return (self._kernel, 1) if ok else None  # (a valid kernel code, never run)

    def small_run(self, description, signature, code, divisor):
        """The compiled prepared run over ``_SegmentSlots`` (``compiled``), else None: the
        Python closure calls ``small_road``'s kernel."""
        if not self.compiled:
            return None
        module = _native.load("_shmfast", build=False)
        assert module is not None, ("the compiled module is not built: pip install -e . "
                                    "(a C compiler and Python's headers)")
        return module.Prepared(_SegmentSlots(self), self.comm, description, signature, code,
                               divisor, self.on_group_idle)

    def _kernel(self, flat, code, divisor, deadline, on_idle, signature):
        assert flat.ndim == 1 and code == 1 and deadline > time.monotonic()
        self._called("prepared", signature)
        if self.kernel_error is not None:
            raise self.kernel_error
        flat *= 2

    def host_allreduce(self, flat, reducer, finish, op, divisor, trunc):
        self._called("full", self.comm.signature)
        flat *= 2

    def _called(self, road: str, signature: int) -> None:
        comm = self.comm
        assert signature == comm.signature
        self.calls.append((road, threading.current_thread().name, comm.seq, comm.description,
                           signature))

    def on_group_idle(self, waited: float) -> None:
        pass

    def fail(self, exc: GradsyncError) -> GradsyncError:
        if self.failure is None:
            self.failure = exc
        return self.failure


class _SegmentSlots:
    """The host segment as a compiled prepared run sees it (its slots) with no compiled group
    (``_fast_group`` None), so that the run's C begins the collective and hands the call to
    ``allreduce_express``: the stand-in's kernel."""

    __slots__ = ("_failed", "_segment", "moved", "_seq", "_fast_group", "world")

    def __init__(self, world: _SegmentWorld):
        self._failed = self._fast_group = None
        self._segment, self.moved, self._seq, self.world = "mapped", 0, 0, world

    def allreduce_express(self, data, code, divisor, deadline, on_idle, signature):
        self.world._kernel(data.reshape(-1), code, divisor, deadline, on_idle, signature)


@pytest.fixture(params=["python", "compiled"])
def segment(request, monkeypatch):
    """A ``_SegmentWorld`` installed as the job's World, with its Engine: the fast case's
    steps in Python (no compiled prepared run, no ``Engine.inline``) or compiled."""
    world = _SegmentWorld()
    engine = Engine(world, recorder.track("numpy:test-express", "numpy API", [0, 1], "numpy",
                                          world.config.timeout, world))
    world.compiled = request.param == "compiled"
    if world.compiled:
        assert engine.inline is not None, "Engine.inline was not made"
    else:
        engine.inline = None
    current = job.Job.__new__(job.Job)  # a job's slots, without a start
    current.world, current.engine, current.pace = world, engine, None
    monkeypatch.setattr(job, "_job", current)
    yield world, engine
    engine.stop()


def test_the_fast_case_and_the_full_road_begin_with_the_same_words(segment, monkeypatch):
    world, engine = segment
    issued = []
    for road in ("prepared", "full"):
        if road == "full":  # nothing prepared from here on: every call takes the full road
            monkeypatch.setattr(operations, "prepare_allreduce", lambda *args: None)
            engine.prepared.clear()
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        assert gs.allreduce_(x, op=gs.Sum, name="g") is x and (x == 2 * np.arange(6).reshape(
            2, 3)).all()
        y = np.ones(4, np.int64)
        z = gs.allreduce(y, op=gs.Max)  # unnamed, out of place
        assert z is not y and (z == 2).all() and (y == 1).all()
        issued.append(world.calls[-2:])
    (named_fast, unnamed_fast), (named_full, unnamed_full) = issued
    assert [c[0] for c in (named_fast, unnamed_fast, named_full, unnamed_full)] == [
        "prepared", "prepared", "full", "full"]
    assert named_fast[3:] == named_full[3:]  # the same description and signature
    assert named_fast[3].startswith("allreduce 'g' float32[2, 3] op=SUM")
    # Unnamed: each draws the next name from one count, and signs the description with it.
    first = int(unnamed_fast[3].split("'")[1].rsplit(".", 1)[1])
    assert unnamed_full[3] == unnamed_fast[3].replace(f".noname.{first}'",
                                                      f".noname.{first + 1}'")
    for call in (unnamed_fast, unnamed_full):
        assert call[4] == signature_of(call[3]) != 0
    seqs = [c[2] for c in (named_fast, unnamed_fast, named_full, unnamed_full)]
    assert seqs == list(range(seqs[0], seqs[0] + 4))  # one begin each, on either road


def test_a_small_call_behind_a_queued_one_runs_prepared_on_the_progress_thread(segment):
    world, engine = segment
    x = np.ones(8, np.float32)
    gs.allreduce_(x, op=gs.Sum, name="s")  # prepared, and run at once on this thread
    assert world.calls[-1][:2] == ("prepared", threading.current_thread().name)
    release = threading.Event()
    blocker = engine.submit(release.wait, "blocker", "barrier")
    done = threading.Event()
    caller = threading.Thread(target=lambda: (gs.allreduce_(x, op=gs.Sum, name="s"),
                                              done.set()))
    caller.start()
    deadline = time.monotonic() + 10
    while len(engine.pending()) < 2:  # the blocker running, the small call queued behind it
        assert time.monotonic() < deadline, engine.pending()
        time.sleep(0.001)
    assert not done.is_set() and len(world.calls) == 1
    release.set()
    assert done.wait(10)
    caller.join()
    blocker.wait(10)
    assert world.calls[-1][:2] == ("prepared", "gradsync-progress")
    assert (x == 4).all()
    newest = recorder.newest()
    assert newest is not None and newest.name == "s" and newest.state == COMPLETED


def test_an_error_of_the_kernel_fails_the_record_and_a_gradsync_error_the_world(segment):
    world, engine = segment
    gs.allreduce_(np.ones(4, np.float32), op=gs.Sum, name="e")
    world.kernel_error = RuntimeError("the kernel broke")
    with pytest.raises(RuntimeError, match="the kernel broke"):
        gs.allreduce_(np.ones(4, np.float32), op=gs.Sum, name="e")
    newest = recorder.newest()
    assert newest is not None and newest.name == "e" and newest.state == FAILED
    assert "the kernel broke" in newest.error and world.failure is None
    lost = PeerLostError("rank 1 is gone")
    world.kernel_error = lost
    with pytest.raises(PeerLostError, match="rank 1 is gone"):
        gs.allreduce_(np.ones(4, np.float32), op=gs.Sum, name="e")
    assert world.failure is lost
    calls = len(world.calls)
    with pytest.raises(PeerLostError):  # the World's failure, raised before the call begins
        gs.allreduce_(np.ones(4, np.float32), op=gs.Sum, name="e")
    assert len(world.calls) == calls
    newest = recorder.newest()
    assert newest is not None and newest.state == FAILED


def test_the_callers_time_blocked_is_its_records_life_or_its_own_clock_without_one(segment):
    # Engine.run counts the caller's time blocked in the pace meter from the record's own
    # clock reads (issued, done or failed), and reads the clock itself only with no record.
    world, engine = segment
    x = np.ones(4, np.float32)
    gs.allreduce_(x, op=gs.Sum, name="b")  # prepared
    kernel = world._kernel

    def slow(*args):
        time.sleep(0.02)
        kernel(*args)

    world._kernel = slow
    engine.prepared.clear()  # prepared again, over the slow kernel
    for error in (None, PeerLostError("rank 1 is gone")):
        world.kernel_error = error
        before = meter.blocked_ns
        if error is None:
            gs.allreduce_(x, op=gs.Sum, name="b")
        else:
            with pytest.raises(PeerLostError):
                gs.allreduce_(x, op=gs.Sum, name="b")
        newest = recorder.newest()
        assert newest is not None and newest.state == (COMPLETED if error is None else FAILED)
        assert meter.blocked_ns - before == newest.ended_ns - newest.created_ns >= 20_000_000
    world.failure = world.kernel_error = None
    engine.track = None
    before, began = meter.blocked_ns, time.monotonic_ns()
    gs.allreduce_(x, op=gs.Sum, name="b")
    assert 20_000_000 <= meter.blocked_ns - before <= time.monotonic_ns() - began
