"""The engine: runs collectives in the order ranks issue them, in the background when asked.

Collectives follow MPI semantics: every rank issues the same collectives in the same order,
so the engine never reorders them. It is an ``executor.Serial`` (the torch backend's lanes are
the other): asynchronous operations go to a queue served by one background thread (the
*progress thread*), and the caller gets a ``Handle`` to ``synchronize`` or ``poll``; a
synchronous call made while nothing is queued or running runs inline on the caller's thread
(about a microsecond of the executor's for a small collective).

Fusion is not guessed here from timing (what happens to be queued differs between ranks, so
fusing it would need a negotiation round per cycle); callers that know a group of tensors
(``grouped_allreduce``, gradient buckets) fuse it themselves, identically on every rank.

Every operation of a job's engine is recorded in the flight recorder (``flight_recorder.py``)
on the engine's *track* (the NumPy API on this World, given by ``job.Job``): the caller issues
the record, the engine marks it started, completed or failed around ``fn``.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ..errors import GradsyncError
from ..flight_recorder import Record, Track
from ..liveness.pace import meter
from .executor import Serial

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


class Engine(Serial["tuple[Handle, Callable, Record | None]"]):
    """Executes operations of one World, in issue order (``executor.Serial``: the queue, the
    progress thread, the inline claim)."""

    def __init__(self, world, track: "Track | None" = None):
        super().__init__("gradsync-progress")
        self.world = world
        self.track = track
        """The NumPy API's track in the flight recorder (``api`` and the express lane issue
        its records), or None."""

    def run(self, fn: Callable, name: str, record: "Record | None" = None):
        """Runs ``fn`` after every earlier operation and returns its result; ``record`` is
        its flight recorder's record (``track.issue``), if any."""
        if not self.claim():
            return self.submit(fn, name, record).wait()
        began = time.monotonic_ns()
        try:
            return self._execute(fn, record)
        finally:
            self.release()
            meter.blocked(began, time.monotonic_ns())  # the caller's time blocked (pace.py)

    claim_inline = Serial.claim
    """Marks the engine busy for an operation the caller runs inline (``Serial.claim``): the
    express lane (``express.py``) uses the pair around its own call."""
    end_inline = Serial.release
    """Ends what ``claim_inline`` began."""

    def submit(self, fn: Callable, name: str, record: "Record | None" = None) -> Handle:
        """Queues ``fn`` for the progress thread; returns its Handle."""
        handle = Handle(name)
        if self.push((handle, fn, record)) is not None:
            raise RuntimeError("gradsync is shutting down")
        return handle

    def _run(self, item: "tuple[Handle, Callable, Record | None]") -> None:
        handle, fn, record = item
        try:
            handle.finish(result=self._execute(fn, record))
        except BaseException as exc:  # delivered to whoever synchronizes the handle
            handle.finish(error=exc)

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

    def stop(self) -> None:
        """Runs what is queued, then ends the progress thread; later submits raise."""
        self.shut(RuntimeError("gradsync is shutting down"))
        self.join()
