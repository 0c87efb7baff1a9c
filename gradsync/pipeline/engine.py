"""The engine: runs collectives in the order ranks issue them, in the background when asked.

Collectives follow MPI semantics: every rank issues the same collectives in the same order,
so the engine never reorders them. Asynchronous operations go to a queue served by one
background thread (the *progress thread*); the caller gets a ``Handle`` to ``synchronize`` or
``poll``. A synchronous call made while nothing is queued or running runs inline on the
caller's thread: that saves the two thread hand-offs (tens of microseconds under the GIL) that
would otherwise dominate a small allreduce. Order is still kept, because "nothing queued"
means every earlier operation has finished. The inline path takes the engine's lock twice
and notifies only when a thread actually waits on it (``_sleepers``), so that a small
synchronous collective pays about a microsecond here.

Fusion is not guessed here from timing (what happens to be queued differs between ranks, so
fusing it would need a negotiation round per cycle); callers that know a group of tensors
(``grouped_allreduce``, gradient buckets) fuse it themselves, identically on every rank.

Every operation of a job's engine is recorded in the flight recorder (``flight_recorder.py``)
on the engine's *track* (the NumPy API on this World, given by ``job.Job``): the caller issues
the record, the engine marks it started, completed or failed around ``fn``.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from ..errors import GradsyncError
from ..flight_recorder import Record, Track
from ..liveness.pace import meter

__all__ = ["Engine", "Handle"]


class Handle:
    """An operation in flight; ``synchronize(handle)`` returns its result."""

    __slots__ = ("name", "_done", "_result", "_error", "on_synchronized")

    def __init__(self, name: str):
        self.name = name
        self._done = threading.Event()
        self._result = None
        self._error: BaseException | None = None
        self.on_synchronized: Callable[[], None] | None = None
        """Called once, by the first ``wait`` that returns or raises the outcome (the
        negotiation frees the operation's name then)."""

    def poll(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None):
        began = time.monotonic_ns()
        done = self._done.wait(timeout)
        meter.blocked(began, time.monotonic_ns())  # the caller's time blocked (pace.py)
        if not done:
            raise TimeoutError(f"operation '{self.name}' still in flight")
        self.release()
        if self._error is not None:
            raise self._error
        return self._result

    def release(self) -> None:
        """Gives up the right to synchronize later: the operation's name is free once it is
        done (for an owner that drops a handle it will never wait for)."""
        release, self.on_synchronized = self.on_synchronized, None
        if release is not None:
            release()

    def finish(self, result=None, error: BaseException | None = None) -> None:
        """Ends the operation with its result or error: called once, by whoever runs it (the
        engine, the negotiation, a region's peer), never by the caller that waits."""
        self._result, self._error = result, error
        self._done.set()

    def __repr__(self) -> str:
        return f"<gradsync.Handle {self.name!r} {'done' if self.poll() else 'in flight'}>"


class Engine:
    """Executes operations of one World, in issue order."""

    def __init__(self, world, track: "Track | None" = None):
        self.world = world
        self.track = track
        """The NumPy API's track in the flight recorder (``api`` and the express lane issue
        its records), or None."""
        self._queue: collections.deque[tuple[Handle, Callable, Record | None]] = \
            collections.deque()
        # The lock is kept apart too: ``with self._lock`` runs in C, ``with self._cv`` does not.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._sleepers = 0  # threads in self._cv.wait(): the only ones a notify can concern
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    def busy(self) -> bool:
        """True while an operation runs or waits in the queue (read without the lock: a
        snapshot, exact when the caller is the only thread that issues operations)."""
        return self._busy or bool(self._queue)

    def run(self, fn: Callable, name: str, record: "Record | None" = None):
        """Runs ``fn`` after every earlier operation and returns its result; ``record`` is
        its flight recorder's record (``track.issue``), if any."""
        if not self.claim_inline():
            return self.submit(fn, name, record).wait()
        began = time.monotonic_ns()
        try:
            return self._execute(fn, record)
        finally:
            self.end_inline()
            meter.blocked(began, time.monotonic_ns())  # the caller's time blocked (pace.py)

    def claim_inline(self) -> bool:
        """Marks the engine busy for an operation the caller runs inline; False (nothing
        changed) when something is queued or running, so the caller must queue instead.
        Every True must be followed by one ``end_inline()`` (the express lane, ``express.py``,
        uses the pair around its own call)."""
        with self._lock:
            if self._queue or self._busy:
                return False
            self._busy = True
            return True

    def end_inline(self) -> None:
        """Ends what ``claim_inline`` began; wakes the threads waiting for the engine to be idle."""
        with self._lock:
            self._busy = False
            if self._sleepers:
                self._cv.notify_all()

    def _sleep(self) -> None:
        """``self._cv.wait()``, counted in ``_sleepers``; call with the lock held."""
        self._sleepers += 1
        try:
            self._cv.wait()
        finally:
            self._sleepers -= 1

    def submit(self, fn: Callable, name: str, record: "Record | None" = None) -> Handle:
        """Queues ``fn`` for the progress thread; returns its Handle."""
        handle = Handle(name)
        with self._cv:
            if self._stopping:
                raise RuntimeError("gradsync is shutting down")
            self._queue.append((handle, fn, record))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="gradsync-progress",
                                                 daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return handle

    def _execute(self, fn: Callable, record: "Record | None" = None):
        if record is not None:
            record.start()
        try:
            if self.world.failure is not None:
                raise self.world.failure
            result = fn()
        except GradsyncError as exc:
            if record is not None:
                record.fail(exc)  # before World.fail, whose flight recorder dump shows it
            error = self.world.fail(exc)
            if error is exc:
                raise
            raise error from exc
        except BaseException as exc:
            if record is not None:
                record.fail(exc)
            raise
        if record is not None:
            record.done()
        return result

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue or self._busy:
                    if self._stopping and not self._queue:
                        return
                    self._sleep()
                handle, fn, record = self._queue.popleft()
                self._busy = True
            try:
                handle.finish(result=self._execute(fn, record))
            except BaseException as exc:  # delivered to whoever synchronizes the handle
                handle.finish(error=exc)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def drain(self) -> None:
        """Waits until every queued operation has finished."""
        with self._cv:
            while self._queue or self._busy:
                self._sleep()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
