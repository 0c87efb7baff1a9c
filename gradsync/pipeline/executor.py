"""One thread, one queue: what runs a World's operations, with the policy of their front door.

Collectives follow MPI's rule, which torch.distributed shares: every rank issues the same
collectives in the same order, so whatever runs them must never reorder them. ``Serial`` is
that rule's whole machinery, shared by every front door: the NumPy API's engine
(``engine.Engine``) and the torch backend's lanes (``torch/backend/work.Lane``) run their
items one by one in issue order, and differ only in what an operation is (a ``Handle`` or a
``Work``) and how its outcome is delivered (``_run``); the Horovod API's controller
(``negotiation.Controller``) runs its items, the requests, in cycles agreed by name (a cycle
announces every request queued since the last):

- ``push``: queues an item for the *progress thread*, started at the first push (or by
  ``start``), which runs the items in order;
- ``claim`` / ``release``: an operation issued while nothing is queued or running may run on
  the caller's thread instead, holding the executor meanwhile. That saves the two thread
  hand-offs (tens of microseconds under the GIL) that would dominate a small collective, and
  keeps the order, because "nothing queued or running" means every earlier operation has
  finished. Whoever runs an item, the progress thread or a claiming caller, holds the
  *running lock*; a claim is a look at the queue and that lock's non-blocking acquire, and a
  release notifies only when a thread waits (``_sleepers``): about 0.2 us for a small
  synchronous call (the engine's fast case, a prepared small allreduce, runs between them),
  where the executor's lock, taken twice, cost 0.55 us;
- ``shut``: no new item is taken (``push`` answers the reason instead); the thread runs what
  is queued, or the queue is handed back undone, and leaves.

The idle policy. With nothing queued, the progress thread of the engine and the lanes sleeps
until an item comes. A policy with work of its own (the negotiation's cycles: its requests wait
for the other ranks' announcements, and the others' cycles wait for its ballot) says how
long the thread may wait (``_patience``, asked with the lock held each time it would sleep)
and what it runs when the wait ends with nothing queued (``_run_idle``, holding the executor
as an item does). A push or ``wake`` ends the wait early; ``_take`` hands the progress thread
every item queued behind the one it runs, for a policy that runs them together.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Generic, TypeVar, cast

__all__ = ["Serial"]

T = TypeVar("T")
_CLOSED = object()  # ``_next``'s answer to a shut executor with nothing queued


class Serial(Generic[T]):
    """Runs items of type ``T`` in push order, one at a time (see the module docstring);
    subclasses say how one runs (``_run``, never raising) and, for a policy that wakes on its
    own, how long the progress thread may wait for one (``_patience``, ``_run_idle``).

    Args:
        name: the progress thread's name.
        lock: the executor's lock; by default a plain one (the fastest ``claim``). A policy
            that changes its own state together with the queue passes an ``RLock`` and pushes
            while holding it (the negotiation: a name's check, its registration and its
            request's push are one step).
    """

    # Slots for what the engine's compiled inline run (``_shmfast.c``'s Inline) reads per
    # call at their offsets (``_queue``, ``_sleepers``); a policy's own attributes, and a
    # test's stand-ins for methods, still go in the instance's dict.
    __slots__ = ("name", "_queue", "_lock", "_cv", "_sleepers", "_running", "_current",
                 "_closed", "_thread", "__dict__", "__weakref__")

    def __init__(self, name: str, lock: "threading.Lock | threading.RLock | None" = None):
        self.name = name
        self._queue: collections.deque[T] = collections.deque()
        # The lock is kept apart too: ``with self._lock`` runs in C, ``with self._cv`` does not.
        self._lock = threading.Lock() if lock is None else lock
        self._cv = threading.Condition(self._lock)
        self._sleepers = 0  # threads waiting on self._cv: the only ones a notify can concern
        # Held while an item runs, on the progress thread or claimed by a caller: its
        # non-blocking acquire is the one test-and-set that makes an item run alone.
        self._running = threading.Lock()
        self._current: T | None = None  # the item the progress thread runs now
        self._closed: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _run(self, item: T) -> None:
        """Runs one item and delivers its outcome; must not raise."""
        raise NotImplementedError

    def _started(self) -> None:
        """Called (with the lock held) when the progress thread has just started."""

    def _patience(self) -> float | None:
        """Seconds the progress thread waits, nothing being queued, before it runs
        ``_run_idle`` (0: at once); None (the default) waits for an item. Called with the
        lock held, each time the thread would wait."""
        return None

    def _run_idle(self) -> None:
        """Runs on the progress thread when its wait (``_patience``) ended with nothing
        queued; holds the executor as an item does; must not raise."""

    def _take(self) -> list[T]:
        """Takes every queued item off the queue (in push order), for the progress thread to
        run with the one it runs now: for a policy that runs items together. Call with the
        lock held."""
        items = list(self._queue)
        self._queue.clear()
        return items

    # ------------------------------------------------------------------ the caller's side
    def busy(self) -> bool:
        """True while an item runs or waits in the queue (read without the lock: a snapshot,
        exact when the caller is the only thread that issues operations)."""
        return self._running.locked() or bool(self._queue)

    @property
    def closed(self) -> BaseException | None:
        """Why it was shut (``shut``); None while it is open."""
        return self._closed

    def claim(self) -> bool:
        """Marks the executor busy for an operation the caller runs on its own thread; False
        (nothing changed) when something is queued or running, so the caller must push
        instead. Every True is followed by one ``release()``.

        The inline path's pair, on every small synchronous call, without the executor's lock:
        a look at the queue and the running lock's non-blocking acquire, each one step under
        the GIL. The progress thread takes the running lock before it takes an item off the
        queue, so a claim that finds the queue empty and the lock free runs after everything
        pushed before it and beside nothing. (With the executor's lock, as before, the pair
        took 0.55 us of a 3.2 us small call's Python; now 0.2 us.) ``Engine.run`` writes this
        pair out in place, in the same steps."""
        return not self._queue and self._running.acquire(False)

    def claim_open(self, item: T | None = None) -> bool:
        """``claim``, refused also when shut; ``item``, if given, is ``current()`` until the
        ``release()``."""
        with self._lock:
            if self._queue or self._closed is not None or not self._running.acquire(False):
                return False
            self._current = item
            return True

    def release(self) -> None:
        """Ends what ``claim`` (or ``claim_open``) began; wakes the threads waiting for the
        executor. A waiter counts itself in ``_sleepers`` before it looks at the running
        lock, so one that this reads as absent will find the lock free."""
        self._current = None
        self._running.release()
        if self._sleepers:
            with self._lock:
                self._cv.notify_all()

    def try_run(self, fn: Callable[[], object]) -> tuple[bool, object]:
        """``fn()`` on the caller's thread, holding the executor, if it is idle and open:
        ``(True, fn())``; ``(False, None)`` without running it otherwise. ``fn``'s
        exceptions go to the caller."""
        if not self.claim_open():
            return False, None
        try:
            return True, fn()
        finally:
            self.release()

    def push(self, item: T) -> BaseException | None:
        """Queues ``item`` for the progress thread; returns why not (the shut's reason)
        when shut, without queueing it."""
        with self._lock:
            if self._closed is not None:
                return self._closed
            self._queue.append(item)
            if self._thread is None:
                self._start()
            if self._sleepers:
                self._cv.notify_all()
        return None

    def start(self) -> None:
        """Starts the progress thread now rather than at the first push: for a policy with
        work of its own from the start (``_run_idle``)."""
        with self._lock:
            if self._thread is None:
                self._start()

    def wake(self) -> None:
        """Ends the progress thread's wait now: a timed one (``_patience``) as if its time had
        passed (the next item runs, or ``_run_idle``), one without a limit asks ``_patience``
        again. For a policy whose reason to run came early: change what ``_patience`` reads
        under the lock first, so that a thread not waiting yet sees the change instead."""
        with self._lock:
            self._cv.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Waits (up to ``timeout`` seconds; None: no limit) until nothing is queued or
        running; True then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._sleepers += 1  # before the look at the running lock (``release``)
            try:
                while self._queue or self._running.locked():
                    if deadline is None:
                        self._cv.wait()
                    else:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            return False
                        self._cv.wait(left)
                return True
            finally:
                self._sleepers -= 1

    def pending(self) -> list[T]:
        """The item running now (``current``), if any, then those queued."""
        with self._lock:
            current = self._current
            running = [current] if current is not None and self._running.locked() else []
            return running + list(self._queue)

    def current(self) -> T | None:
        """The item running now (on the progress thread, or claimed with it), or None."""
        with self._lock:
            return self._current if self._running.locked() else None

    def shut(self, reason: BaseException, drop: bool = False) -> list[T]:
        """From now on ``push`` refuses with ``reason``; the progress thread leaves once the
        queue is empty. With ``drop`` the queue is emptied at once and its items returned
        (undone, for the caller to fail)."""
        with self._lock:
            self._closed = reason
            dropped = list(self._queue) if drop else []
            if drop:
                self._queue.clear()
            self._cv.notify_all()
        return dropped

    def join(self, timeout: float | None = None) -> bool:
        """Waits (up to ``timeout`` seconds) for a shut executor's thread; True once it is
        gone (or never started, or is the caller)."""
        if self._thread is None or self._thread is threading.current_thread():
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ------------------------------------------------------------------ the progress thread
    def _start(self) -> None:
        """Starts the progress thread; call with the lock held."""
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        self._started()

    def _loop(self) -> None:
        running = self._running
        while True:
            with self._lock:
                self._sleepers += 1  # before any look at the running lock (``release``)
                try:
                    idle, item = self._next(running)
                finally:
                    self._sleepers -= 1
            if item is _CLOSED:
                return
            try:
                if idle:
                    self._run_idle()
                else:
                    self._run(cast(T, item))
            finally:
                self._current = None
                running.release()
                if self._sleepers:
                    with self._lock:
                        self._cv.notify_all()

    def _next(self, running: threading.Lock) -> tuple[bool, object]:
        """(The progress thread, the lock held.) Waits for what to run next and takes the
        running lock for it: ``(False, item)``, the next item off the queue; ``(True, None)``,
        ``_run_idle`` (the policy's wait ended with nothing queued); ``(False, _CLOSED)``, shut
        with nothing queued: the thread leaves."""
        while True:
            if self._queue and running.acquire(False):
                item = self._queue.popleft()
                self._current = item
                return False, item
            if self._closed is not None and not self._queue:
                return False, _CLOSED
            patience = None if running.locked() else self._patience()
            if patience is None:  # until an item comes (or a claim ends)
                self._cv.wait()
                continue
            if patience > 0:
                self._cv.wait(patience)  # a push, a claim's release or wake() ends it sooner
            if not (self._queue or self._closed is not None) and running.acquire(False):
                return True, None
