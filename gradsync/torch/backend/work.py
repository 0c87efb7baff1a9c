"""Works and the progress threads that complete them.

A collective of the backend returns at once with a ``Work``; a *lane* (one thread, one queue)
runs the operations of one World in the order they were issued (MPI's rule, which
torch.distributed shares: every rank issues the same collectives in the same order), then
completes each Work: first its ``torch.futures.Future`` (made only if someone asked for it),
with the operation's result (the list of output tensors, which is what DDP reads from
``get_future().value()``) or with the ``BackendError``, then the event ``wait()`` waits on.
Never an exception as a value, and never not at all: a lane that stops fails what is still
queued.

A Work may carry its flight recorder's record (``flight_recorder.py``; the group issues it on
its track): the lane marks it started, completed or failed around the operation.

Why our own ``Work`` subclass rather than ``_create_work_from_future``: that wrapper's
``wait()`` returns normally when its future holds an error (torch 2.13), so a failed
synchronous ``dist.all_reduce`` would pass silently.
"""

from __future__ import annotations

import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from ...liveness.pace import meter
from ...pipeline.executor import Serial
from .backward import backward
from .errors import BackendError, to_backend_error

if TYPE_CHECKING:
    from ...flight_recorder import Record

__all__ = ["Work", "Lane"]


class Work(dist._Work):
    """One operation of the backend; ``wait()`` raises its ``BackendError`` if it failed."""

    def __init__(self, what: str, result):
        super().__init__()
        self.what = what
        self._result = result
        # Done, and the event a waiter sleeps on: made only by a ``wait`` that comes before
        # the end. Most Works end before anyone waits (a synchronous call runs inline), and
        # an Event (a Condition and its lock), set and looked at, costs microseconds a call.
        self._done = False
        self._event: threading.Event | None = None
        self._error: BaseException | None = None
        self._src = -1  # the rank a receive took its message from (``_source_rank()``)
        self._finisher: threading.Thread | None = None
        # The future is made on first ``get_future()`` (DDP asks, ``dist.all_reduce`` does
        # not): two futures per collective cost tens of microseconds.
        self._lock = threading.Lock()
        self._source: torch.futures.Future | None = None
        self._future: torch.futures.Future | None = None
        self.record: Record | None = None  # the flight recorder's record of the operation, if any

    # ------------------------------------------------------------------ torch's interface
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Blocks until the operation is done; raises its error. ``timeout`` 0: no limit."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout / 1e3
        # Not from a callback of this Work's own future, run by ``_finish`` before it sets
        # ``_done``: the outcome is known there.
        if not self._done and self._finisher is not threading.current_thread():
            with self._lock:  # ``_finish`` sets ``_done`` and reads ``_event`` under it
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = None if self._done else self._event
            if event is not None:
                began = time.monotonic_ns()
                done = event.wait(seconds if seconds > 0 else None)
                meter.blocked(began, time.monotonic_ns())  # the caller's time blocked (pace.py)
                if not done:
                    raise BackendError(f"{self.what} still in flight after {seconds:.1f}s "
                                       "(wait timeout)")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is None:
                # Failures reach the future through a callback that raises (``_deliver``):
                # torch then stores a C++ copy of the error. ``Future.set_exception`` would
                # store the Python exception itself, and DDP's reducer, which rethrows it in
                # C++ without the GIL, crashes the process (torch 2.13: a segfault in
                # backward).
                self._source = torch.futures.Future()
                self._future = self._source.then(self._deliver)
                done = self._finisher is not None  # _finish has begun without a future
            else:
                return self._future
        if done:
            self._source.set_result(None)
        return self._future

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._result

    def source_rank(self) -> int:
        return self._src

    # torch's name (``dist.recv`` without ``src``, ``work._source_rank()``); the C++ method it
    # binds would not reach this Python class.
    _source_rank = source_rank

    def __repr__(self) -> str:
        state = "in flight" if not self._done else \
            ("failed" if self._error is not None else "done")
        return f"<gradsync Work {self.what} {state}>"

    # ------------------------------------------------------------------ the lane's side
    def _finish(self, error: BaseException | None = None) -> None:
        # The future first, then the event: a waiter must not return (and its process exit)
        # while this thread is still inside torch's C++ completing the future, where the
        # interpreter's shutdown would kill it ("terminate called without an active
        # exception"). A future callback that waits on this Work is let through.
        with self._lock:
            if self._finisher is not None:
                return  # finished already (``Lane.fail_current``): the first outcome stands
            self._error = error
            self._finisher = threading.current_thread()
            source = self._source
        if source is not None:
            source.set_result(None)
        with self._lock:
            self._done, event = True, self._event
        if event is not None:
            event.set()

    def _deliver(self, _source):
        if self._error is not None:
            raise self._error
        return self._result

    @classmethod
    def completed(cls, what: str, result) -> "Work":
        work = cls(what, result)
        work._finish()
        return work


class Lane(Serial["tuple[Work, Callable[[], None]]"]):
    """A progress thread that runs operations one after another, in submission order
    (``pipeline/executor.Serial``, the same machinery as the NumPy API's engine).

    A synchronous call (``run_now``) made while nothing is queued or running runs on the
    caller's thread instead: that saves the two thread hand-offs (tens of microseconds each
    under the GIL) that would dominate a small collective, and keeps the order, because
    "nothing queued or running" means every earlier operation has finished.

    Args:
        name: the thread's name.
        on_error: maps an operation's exception to the ``BackendError`` its Work fails with
            (and may record it, e.g. post the World's abort record).
    """

    def __init__(self, name: str, on_error: Callable[[BaseException, str], BackendError]):
        super().__init__(name)
        self.on_error = on_error

    def _started(self) -> None:
        _running.add(self)

    def submit(self, work: Work, fn: Callable[[], None]) -> Work:
        """Queues ``fn``; ``work`` completes when it has run (or failed)."""
        closed = self.push((work, fn))
        if closed is not None:
            if work.record is not None:
                work.record.fail(closed)
            work._finish(to_backend_error(closed, work.what))
        return work

    def run_now(self, work: Work, fn: Callable[[], None]) -> Work:
        """Runs ``fn`` on this thread if the lane is idle, else queues it; returns ``work``."""
        if not self.claim_open((work, fn)):
            return self.submit(work, fn)
        try:
            self._execute(work, fn)
        finally:
            self.release()
        return work

    def _run(self, item: "tuple[Work, Callable[[], None]]") -> None:
        self._execute(*item)

    def _execute(self, work: Work, fn: Callable[[], None]) -> None:
        record = work.record
        if record is not None:
            record.start()
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - every failure completes the Work
            if record is not None:
                record.fail(exc)  # before on_error: its World.fail dumps the recorder
            try:
                error = self.on_error(exc, work.what)
            except BaseException as inner:  # noqa: BLE001
                error = to_backend_error(inner, work.what)
            backward.done_ns = time.monotonic_ns()  # (as below)
            work._finish(error)
        else:
            if record is not None:
                record.done()
            # Where a backward pass waits for this Work's Future in torch's C++, the wait ends
            # now (backward.py); stamped before the Future completes, so that the waiter,
            # woken by it, never reads an older stamp.
            backward.done_ns = time.monotonic_ns()
            work._finish()

    def in_flight(self) -> str:
        """What is queued or running, in words ("nothing", "all_reduce and 2 more")."""
        works = [work for work, _ in self.pending()]
        if not works:
            return "nothing"
        return works[0].what + (f" and {len(works) - 1} more" if len(works) > 1 else "")

    def fail_current(self, reason: BaseException) -> None:
        """Fails the Work running now, without waiting for its function (which may go on)."""
        item = self.current()
        if item is not None:
            work = item[0]
            work._finish(to_backend_error(reason, work.what))

    def close(self, reason: BaseException, wait: bool = True) -> None:
        """Stops the thread once the queue is empty (``wait``) or fails what is queued."""
        for work, _ in self.shut(reason, drop=not wait):
            work._finish(to_backend_error(reason, work.what))
        if wait:
            self.join()


# Lanes whose thread has started (see ``close_lanes``).
_running: "weakref.WeakSet[Lane]" = weakref.WeakSet()


def close_lanes(grace: float) -> None:
    """Closes every lane (what is queued fails) and gives their threads ``grace`` seconds in
    all to leave. At the interpreter's exit a daemon thread still inside torch's C++
    (completing a future whose waiter has already returned, as DDP's backward does when its
    allreduce fails) is killed mid-frame and the process aborts. Called at exit
    (``group._release_at_exit``)."""
    lanes = list(_running)
    reason = BackendError("the process is exiting")
    for lane in lanes:
        lane.close(reason, wait=False)
    deadline = time.monotonic() + grace
    for lane in lanes:
        lane.join(max(0.0, deadline - time.monotonic()))
