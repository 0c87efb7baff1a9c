"""The engine: runs collectives in the order ranks issue them, in the background when asked.

Collectives follow MPI semantics: every rank issues the same collectives in the same order,
so the engine never reorders them. It is an ``executor.Serial`` (the torch backend's lanes are
the other): asynchronous operations go to a queue served by one background thread (the
*progress thread*), and the caller gets a ``Handle`` to ``synchronize`` or ``poll``; a
synchronous call made while nothing is queued or running runs inline on the caller's thread
(about a microsecond of the executor's for a small collective).

An operation is a function: a closure over the call, run as ``fn()`` (the NumPy API's
``operations`` functions, which work out the plan and description per call), or a
``Prepared`` allreduce's ``run``, worked out once per distinct call (``prepared`` keeps them)
and run as ``fn(call)`` with the call's own inputs. (One argument, not ``fn(*args)``: a call
through ``*`` re-enters the interpreter, about 1,800 machine instructions on a small call.)
Both take the same steps: ``run`` claims the engine or queues, issues the flight recorder's
record, then (as ``_execute`` does on the progress thread) raises the World's failure if there
is one, runs the operation, fails its record and the World on an error (``_failed``, shared:
``World.fail``) and records its end. So the small-call fast case is this pipeline's inline
path with a prepared operation, not a road of its own: it keeps the engine's order, failure
check and records by construction. On the caller's thread ``run`` writes these steps out in
place (the executor's claim and release, ``_execute``'s, the pace meter's ``blocked``) and
times the caller's wait by its record's own clock reads, none of its own: on a call of a few
microseconds each Python call and clock read shows. The same inline path is also compiled
(``Engine.inline``, ``_shmfast.c``'s Inline: the claim, the record, the failure check, the
operation, the end and the release in one C call), which the fast case takes where the module
is built; it hands a refused claim and every error to the steps here.

Fusion is not guessed here from timing (what happens to be queued differs between ranks, so
fusing it would need a negotiation round per cycle); callers that know a group of tensors
(``grouped_allreduce``, gradient buckets) fuse it themselves, identically on every rank.

Every operation of a job's engine is recorded in the flight recorder (``flight_recorder.py``)
on the engine's *track* (the NumPy API on this World, given by ``job.Job``): issued when the
caller makes the call (already started when it runs at once), then marked started,
completed or failed around the operation.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, NoReturn

from .. import _native
from ..errors import GradsyncError
from ..flight_recorder import COMPLETED, SCHEDULED, STARTED, Record, Track
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

    def ended(self, timeout: float | None = None) -> bool:
        """Waits up to ``timeout`` seconds for the operation to end; whether it did. Never
        raises: a watcher that polls must not read a TimeoutError that the operation itself
        raised as "still in flight", nor the reverse."""
        began = time.monotonic_ns()
        done = self._done.wait(timeout)
        meter.blocked(began, time.monotonic_ns())  # the caller's time blocked (pace.py)
        return done

    def wait(self, timeout: float | None = None):
        if not self.ended(timeout):
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


def _compiled_inline(engine: "Engine"):
    """``Engine.inline`` for ``engine``: ``_shmfast.Inline`` over it, or None (no module
    built, no track). Loaded, never built here: a job's World built it before its engine."""
    if engine.track is None:
        return None
    module = _native.load("_shmfast", build=False)
    if module is None:
        return None
    return module.Inline(engine, meter, Record, (SCHEDULED, STARTED, COMPLETED), "all_reduce")


class Engine(Serial["tuple[Handle, Callable, object, Record | None]"]):
    """Executes operations of one World, in issue order (``executor.Serial``: the queue, the
    progress thread, the inline claim)."""

    __slots__ = ("world", "track", "prepared", "inline")  # (``track``: read by ``inline``)

    def __init__(self, world, track: "Track | None" = None):
        super().__init__("gradsync-progress")
        self.world = world
        self.track = track
        """The NumPy API's track in the flight recorder, where ``run`` and ``submit`` record
        each operation; None for none."""
        self.prepared: dict = {}
        """The ``Prepared`` allreduces of this World (``operations.prepare_allreduce``), or
        None for a call that cannot be prepared, per distinct call (``api`` keys them)."""
        self.inline = _compiled_inline(self)
        """``run``'s inline path for an allreduce, compiled (``_shmfast.Inline``), called as
        ``inline(fn, name, shape, dtype, call)``: ``run(fn, name, "all_reduce", shape, dtype,
        None, call)`` in one C call, ``fn``'s own steps too where it is a compiled prepared
        run (``_shmfast.c``, "The engine's inline run, compiled"). None where the module is not
        built or nothing is recorded (no track): callers then call ``run``."""

    def run(self, fn: Callable, name: str, kind: str, shape=None, dtype=None, out_shape=None,
            call=None):
        """Runs the operation ``fn`` (``fn()``, or ``fn(call)`` when ``call`` is not None)
        after every earlier operation and returns its result (or raises its error): on the
        caller's thread when nothing is queued or running, else queued (``submit``) while the
        caller waits.

        Args:
            fn, call: the operation and, for a prepared one, its call's inputs.
            name: its name (a Handle's, the record's).
            kind, shape, dtype, out_shape: its record (``Track.issue``): torch's name of the
                collective, its input's shape and dtype (None for a barrier or an object),
                its output's shape where it differs.

        ``inline`` is this method's inline path compiled (``_shmfast.c``'s Inline, the same
        steps): a change here is one there.
        """
        if self._queue or not self._running.acquire(False):  # ``claim``, inline
            return self.submit(fn, name, kind, shape, dtype, out_shape, call).wait()
        # What ``_execute`` and the meter's ``blocked`` do, written out: on a call of a few
        # microseconds each Python call taken shows (``Record.done`` does the same for the
        # meter's ``op_done``).
        record = None
        try:
            track = self.track
            if track is None:
                began = time.monotonic_ns()
            else:  # the record's clock reads are the pace meter's too (no read of our own)
                record = track.issue(kind, name, shape, dtype, out_shape, None, True, True)
                began = record.created_ns
            world = self.world
            if world.failure is not None:
                raise world.failure
            result = fn() if call is None else fn(call)
        except BaseException as exc:
            self._failed(record, exc)
        else:
            if record is not None:
                record.done()
            return result
        finally:
            # ``release``, inline (``claim`` set no ``_current``).
            self._running.release()
            if self._sleepers:
                with self._lock:
                    self._cv.notify_all()
            # The caller's time blocked (``Meter.blocked``), to its record's end (done or
            # failed), or to now without a record.
            end = time.monotonic_ns() if record is None else record.ended_ns
            until = meter.blocked_until
            if end > until:
                meter.blocked_ns += end - (began if began > until else until)
                meter.blocked_until = end

    def submit(self, fn: Callable, name: str, kind: str, shape=None, dtype=None,
               out_shape=None, call=None) -> Handle:
        """Queues the operation ``fn`` for the progress thread (the arguments as for
        ``run``); returns its Handle."""
        track = self.track
        record = None if track is None else track.issue(kind, name, shape, dtype, out_shape)
        handle = Handle(name)
        if self.push((handle, fn, call, record)) is not None:
            raise RuntimeError("gradsync is shutting down")
        return handle

    def _run(self, item: "tuple[Handle, Callable, object, Record | None]") -> None:
        handle, fn, call, record = item
        if record is not None:
            record.start()
        try:
            handle.finish(result=self._execute(record, fn, call))
        except BaseException as exc:  # delivered to whoever synchronizes the handle
            handle.finish(error=exc)

    def _execute(self, record: "Record | None", fn: Callable, call):
        """Runs an operation on the thread that holds the engine (its record started);
        ``run`` writes the same steps out in place."""
        world = self.world
        try:
            if world.failure is not None:
                raise world.failure
            result = fn() if call is None else fn(call)
        except BaseException as exc:
            self._failed(record, exc)
        if record is not None:
            record.done()
        return result

    def _failed(self, record: "Record | None", exc: BaseException) -> NoReturn:
        """Raises what the operation's error ``exc`` becomes: its record failed, and a
        gradsync error failing the World first (``World.fail``: the World's first failure
        is what every operation raises from then on)."""
        if record is not None:
            record.fail(exc)  # before World.fail, whose flight recorder dump shows it
        if not isinstance(exc, GradsyncError):
            raise exc
        error = self.world.fail(exc)
        if error is exc:
            raise exc
        raise error from exc

    def stop(self) -> None:
        """Runs what is queued, then ends the progress thread; later submits raise."""
        self.shut(RuntimeError("gradsync is shutting down"))
        self.join()
