"""``pipeline/executor.Serial``, the one queue-and-thread machinery under every front door: the
NumPy API's engine, the torch backend's lanes and the Horovod API's controller (one process,
threads: nothing here needs another rank). Its users are tested through their own interfaces
in test_express.py (the engine's inline claim and the express lane), test_backend_work.py
(Works, run_now, close) and test_negotiation*.py (the controller's cycles); here, the
controller only as far as it is a Serial."""

from __future__ import annotations

import collections
import threading
import types

from gradsync.pipeline.executor import Serial
from gradsync.pipeline.negotiation import Controller, Request


class Log(Serial):
    """Runs items by appending them, with the thread that ran them, to ``ran``; an item that
    is an Event is waited on first (so a test can hold the progress thread)."""

    def __init__(self):
        super().__init__("test-serial")
        self.ran: list = []

    def _run(self, item) -> None:
        if isinstance(item, threading.Event):
            item.wait(10)
        self.ran.append((item, threading.current_thread().name))


def test_items_run_in_push_order_on_the_progress_thread():
    serial = Log()
    for i in range(50):
        assert serial.push(i) is None
    assert serial.drain(10)
    assert [item for item, _ in serial.ran] == list(range(50))
    assert {name for _, name in serial.ran} == {"test-serial"}
    serial.shut(RuntimeError("done"))
    assert serial.join(10)


def test_a_claim_holds_the_progress_thread_and_is_refused_while_anything_runs_or_waits():
    serial = Log()
    assert serial.claim_open("mine") and serial.current() == "mine" and serial.busy()
    assert not serial.claim()  # running (inline)
    serial.push(1)
    assert not serial.drain(0.2)  # the progress thread waits for the claim's release
    assert serial.ran == [] and serial.pending() == ["mine", 1]
    serial.release()
    assert serial.drain(10) and [item for item, _ in serial.ran] == [1]
    gate = threading.Event()
    serial.push(gate)
    assert not serial.claim()  # queued or running on the progress thread
    gate.set()
    assert serial.drain(10) and serial.claim()
    serial.release()
    serial.shut(RuntimeError("done"))
    serial.join(10)


def test_try_run_runs_on_the_callers_thread_only_when_idle_and_open():
    serial = Log()
    assert serial.try_run(lambda: threading.current_thread().name) == \
        (True, threading.current_thread().name)
    assert serial.claim()
    assert serial.try_run(lambda: 1) == (False, None)
    serial.release()
    serial.shut(RuntimeError("shut"))
    assert serial.try_run(lambda: 1) == (False, None)
    assert serial.claim()  # a plain claim does not look at the shut (the engine's inline run)
    serial.release()


def test_shut_runs_what_is_queued_or_hands_it_back_and_refuses_later_pushes():
    serial = Log()
    gate = threading.Event()
    serial.push(gate)
    serial.push(1)
    serial.push(2)
    reason = RuntimeError("closing")
    assert serial.shut(reason) == []
    assert serial.push(3) is reason and serial.closed is reason
    gate.set()
    assert serial.join(10)
    assert [item for item, _ in serial.ran] == [gate, 1, 2]

    dropping = Log()
    gate = threading.Event()
    dropping.push(gate)
    dropping.push(1)
    dropping.push(2)
    for _ in range(2000):  # until the progress thread has taken the gate (10 s at most)
        if dropping.current() is gate:
            break
        threading.Event().wait(0.005)
    assert dropping.shut(reason, drop=True) == [1, 2]
    gate.set()
    assert dropping.join(10)
    assert [item for item, _ in dropping.ran] == [gate]


class Ticking(Log):
    """A policy that wakes on its own: after ``patience`` seconds with nothing queued, its
    progress thread runs ``_run_idle``, which logs None and waits for items again."""

    def __init__(self, patience: float):
        super().__init__()
        self.patience: float | None = patience
        self.ticked = threading.Event()

    def _patience(self):
        return self.patience

    def _run_idle(self) -> None:
        self.ran.append((None, threading.current_thread().name))
        self.patience = None  # once: then it waits for items, as the default does
        self.ticked.set()


def asleep(serial: Serial) -> None:
    """Returns once the progress thread waits (10 s at most)."""
    for _ in range(2000):
        with serial._cv:
            if serial._sleepers:
                return
        threading.Event().wait(0.005)
    raise AssertionError("the progress thread never waited")


def test_an_idle_policy_runs_on_the_progress_thread_when_its_wait_ends_with_nothing_queued():
    # From start(), without any push: the thread runs its own work when the wait ends.
    ticking = Ticking(0.001)
    ticking.start()
    assert ticking.ticked.wait(10)
    assert ticking.ran == [(None, "test-serial")]
    ticking.push(1)  # an item still runs as an item
    assert ticking.drain(10) and ticking.ran == [(None, "test-serial"), (1, "test-serial")]
    ticking.shut(RuntimeError("done"))
    assert ticking.join(10)

    # A push ends a long wait at once, and runs the item, not the idle work.
    patient = Ticking(3600.0)
    patient.start()
    asleep(patient)
    patient.push(1)
    assert patient.drain(10) and patient.ran == [(1, "test-serial")]
    # wake() ends it too: the policy's reason to run came early (changed under the lock)
    asleep(patient)
    with patient._cv:
        patient.patience = 0.0
    patient.wake()
    assert patient.ticked.wait(10) and patient.ran[-1] == (None, "test-serial")
    patient.shut(RuntimeError("done"))
    assert patient.join(10)


def test_take_hands_the_progress_thread_every_queued_item_for_a_policy_that_runs_them_together():
    class Together(Log):
        def _run(self, item) -> None:
            item.wait(10)  # the gate: meanwhile the others are queued
            with self._lock:
                self.ran.append([item, *self._take()])

    serial = Together()
    gate = threading.Event()
    serial.push(gate)
    for i in range(5):
        serial.push(i)
    gate.set()
    assert serial.drain(10) and serial.ran == [[gate, 0, 1, 2, 3, 4]]
    serial.shut(RuntimeError("done"))
    assert serial.join(10)


class HeldTake(collections.deque):
    """An executor's queue whose take is held: once the progress thread has taken an item
    off it (its running lock held, the item not yet run), ``taking`` is set, and the take
    returns only once ``tried`` is (tests/test_express.py holds ``Engine.run``'s claim with it
    too)."""

    def __init__(self, taking: threading.Event, tried: threading.Event):
        super().__init__()
        self.taking, self.tried = taking, tried

    def popleft(self):
        item = super().popleft()
        self.taking.set()
        self.tried.wait(10)
        return item


def test_a_claim_is_refused_while_the_progress_thread_takes_an_item_off_the_queue():
    """A claim does not take the executor's lock: it looks at the queue, then tries the
    running lock. The progress thread takes that lock before it takes an item off the queue,
    so in between, with the queue empty and the item not yet run, a claim is refused (were it
    taken after, the claim would run first: the caller's synchronous operation ahead of its
    own asynchronous one). The moment is held here until the test has tried its claim."""
    taking, tried = threading.Event(), threading.Event()
    serial = Log()
    serial._queue = HeldTake(taking, tried)
    serial.push("asynchronous")
    assert taking.wait(10) and not serial._queue  # taken off, not run yet
    claimed = serial.claim()
    tried.set()
    assert not claimed and serial.busy()
    assert serial.drain(10) and [item for item, _ in serial.ran] == ["asynchronous"]
    assert serial.claim()
    serial.release()
    serial.shut(RuntimeError("done"))
    assert serial.join(10)


class OneRank(types.SimpleNamespace):
    """What a Controller reads of a one-rank World (weakly referable, as the flight
    recorder's tracks refer to their World)."""


def test_the_horovod_apis_controller_is_a_serial_whose_progress_thread_runs_its_operations():
    config = types.SimpleNamespace(stall_warning=60.0, timeout=60.0, stall_report=0.0,
                                   abort_poll_interval=0.1)
    world = OneRank(rank=0, size=1, config=config, shares_host=False, fail=lambda exc: exc,
                    env=types.SimpleNamespace(job_id="executor-controller"))
    ctl = Controller(world, "executor-test", [0], 1 << 20)
    try:
        assert isinstance(ctl, Serial)
        handle = ctl.submit(Request("where", "barrier", "none", (),
                                    run=lambda w: threading.current_thread()))
        ran_on = handle.wait(10)
        # its progress thread, named as the controller's thread was; no other of its own
        assert ran_on is ctl._thread and ran_on.name == "gradsync-negotiate-executor-test"
        assert [t for t in threading.enumerate() if t.name == ran_on.name] == [ran_on]
    finally:
        ctl.stop(10)
    assert not ctl.running and isinstance(ctl.closed, RuntimeError)
    try:
        ctl.submit(Request("late", "barrier", "none", (), run=lambda w: None))
    except RuntimeError as exc:
        assert "has been shut down" in str(exc), exc
    else:
        raise AssertionError("a stopped controller took a request")
