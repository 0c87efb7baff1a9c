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
  finished. The pair takes the lock once each and notifies only when a thread waits on it
  (``_sleepers``): about a microsecond for a small synchronous call (the engine's fast case,
  a prepared small allreduce, runs between them);
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
from typing import Callable, Generic, TypeVar

__all__ = ["Serial"]

T = TypeVar("T")


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

    def __init__(self, name: str, lock: "threading.Lock | threading.RLock | None" = None):
        self.name = name
        self._queue: collections.deque[T] = collections.deque()
        # The lock is kept apart too: ``with self._lock`` runs in C, ``with self._cv`` does not.
        self._lock = threading.Lock() if lock is None else lock
        self._cv = threading.Condition(self._lock)
        self._sleepers = 0  # threads in self._cv.wait(): the only ones a notify can concern
        self._busy = False
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
        return self._busy or bool(self._queue)

    @property
    def closed(self) -> BaseException | None:
        """Why it was shut (``shut``); None while it is open."""
        return self._closed

    def claim(self) -> bool:
        """Marks the executor busy for an operation the caller runs on its own thread; False
        (nothing changed) when something is queued or running, so the caller must push
        instead. Every True is followed by one ``release()``. (The inline path's pair, on
        every small synchronous call: kept to a lock and two reads.)"""
        with self._lock:
            if self._queue or self._busy:
                return False
            self._busy = True
            return True

    def claim_open(self, item: T | None = None) -> bool:
        """``claim``, refused also when shut; ``item``, if given, is ``current()`` until the
        ``release()``."""
        with self._lock:
            if self._queue or self._busy or self._closed is not None:
                return False
            self._busy, self._current = True, item
            return True

    def release(self) -> None:
        """Ends what ``claim`` (or ``claim_open``) began; wakes the threads waiting for the
        executor."""
        with self._lock:
            self._busy = False
            self._current = None
            if self._sleepers:
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
            while self._queue or self._busy:
                if deadline is None:
                    self._sleep()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._sleep(left)
            return True

    def pending(self) -> list[T]:
        """The item running now (``current``), if any, then those queued."""
        with self._lock:
            running = [self._current] if self._busy and self._current is not None else []
            return running + list(self._queue)

    def current(self) -> T | None:
        """The item running now (on the progress thread, or claimed with it), or None."""
        with self._lock:
            return self._current if self._busy else None

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

    def _sleep(self, timeout: float | None = None) -> None:
        """``self._cv.wait()``, counted in ``_sleepers``; call with the lock held."""
        self._sleepers += 1
        try:
            self._cv.wait(timeout)
        finally:
            self._sleepers -= 1

    def _loop(self) -> None:
        while True:
            with self._lock:
                idle = False
                while not self._queue or self._busy:
                    if self._closed is not None and not self._queue:
                        return
                    patience = None if self._busy else self._patience()
                    if patience is None:  # until an item comes (or a claim ends)
                        self._sleep()
                        continue
                    if patience > 0:
                        self._sleep(patience)  # a push, a claim's release or wake() ends it sooner
                    if not (self._queue or self._busy or self._closed is not None):
                        idle = True
                        break
                if idle:
                    self._busy = True
                else:
                    item = self._queue.popleft()
                    self._busy, self._current = True, item
            try:
                if idle:
                    self._run_idle()
                else:
                    self._run(item)
            finally:
                with self._lock:
                    self._busy, self._current = False, None
                    if self._sleepers:
                        self._cv.notify_all()
