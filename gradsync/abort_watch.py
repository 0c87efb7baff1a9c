"""The abort watch: one blocked store request per World instead of a poll per waiting rank.

Every World has an *abort record* in the rendezvous store (``Store.post_abort``): the first
failure any rank reported. A rank that waits in a collective must see it within about
``abort_poll_interval`` (0.1 s) and raise the same error. Asking the store every 0.1 s from
every waiting rank costs the one store 10 requests per second per rank: 273,600 per second at
27,360 ranks, more than one TCPStore serves.

Instead, one daemon thread per World asks the store once and waits for the answer: a
``get`` of the record on a store connection of its own blocks in the store server until the
record exists (the server wakes every waiter the moment the record is written; measured 0.2 ms
on one host). The thread then keeps the record, and the World's waits read it from memory
(``World.on_idle``: no store request at all). The blocked request is re-armed every
``rearm`` seconds, so the store serves N / rearm requests per second for the whole job
(N / 300 by default: 91 per second at 27,360 ranks), whatever the ranks do.

Why a connection of its own: a torch TCPStore client runs one request at a time, so the
blocked ``get`` would hold up every other request on its connection (a barrier, a sub-world's
rendezvous) until the record appears.

Costs and limits, as torch 2.13 behaves:

- A ``get`` that times out leaves the client connection usable (torch cancels the wait with
  the server and drains a late answer before it raises; checked by
  ``tests/test_heartbeat.py``), but torch's C++ socket layer logs two warning lines each time
  (``waitForInput ... likely a timeout``). Hence the long ``rearm``: two lines per rank every
  five minutes, not ten per second.
- A blocked request cannot be interrupted from Python. ``stop`` only marks the watch stopped;
  the thread ends when the record appears, at its next re-arm, or with the process, and holds
  its store connection until then. A clean shutdown ends with the process, and an elastic
  generation usually ends with a record (the failure that ended it), so in practice only a
  World closed in a process that goes on without a record (``shutdown()`` then ``init()``)
  keeps a thread and a connection for up to ``rearm`` seconds.
- Until the wait is in place (``armed``), and for a store that cannot be cloned (not a
  TCPStore), callers read the record themselves (``read_abort`` does), as before.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from .errors import GradsyncTimeoutError, PeerLostError
from .rendezvous import Store

__all__ = ["AbortWatch", "REARM"]

log = logging.getLogger("gradsync")

REARM = 300.0
"""Seconds one blocked request waits for the record before it is asked again."""

# The record's key in the job's namespace: Store.post_abort writes it, Store.read_abort reads
# it; the watch blocks on it. (rendezvous.Store has no public blocking read of the record.)
_ABORT_KEY = "abort"


class AbortWatch:
    """A thread that blocks in the store until the World's abort record exists.

    Args:
        store: a job-scoped store over a connection that nobody else uses
            (``Store.clone_private``); the watch takes it over once started.
        fallback: the World's own store, read directly while the watch is not armed.
        rearm: seconds each blocked request waits before it is made again.
    """

    def __init__(self, store: Store, fallback: Store, rearm: float = REARM):
        self._store, self._fallback, self.rearm = store, fallback, rearm
        self._record: dict | None = None
        self._error: PeerLostError | None = None
        self._armed = False
        self._stop = threading.Event()
        # A private connection is one the store could clone; a shared one must not block.
        self._blocking = store.base is not fallback.base
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"gradsync-abort-watch-{store.job}")

    def start(self) -> "AbortWatch":
        if self._blocking:
            self._thread.start()
        return self

    @property
    def armed(self) -> bool:
        """True once the record is watched by the thread (reads then cost no request)."""
        return self._armed

    def read_abort(self) -> dict | None:
        """The job's abort record, or None; from memory once armed, else from the store.

        Raises:
            PeerLostError: the store is gone (its host, usually rank 0 or the launcher, died).
        """
        if self._record is not None:
            return self._record
        if self._error is not None:
            raise self._error
        if self._armed:
            return None
        return self._fallback.read_abort()

    def stop(self) -> None:
        """Marks the watch stopped (the thread cannot be woken: see the module docstring)."""
        self._stop.set()

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        try:
            # Armed only after a first look: a record posted before the wait began is seen.
            record = self._store.read_abort()
            self._armed = True
            while record is None and not self._stop.is_set():
                started = time.monotonic()
                try:
                    record = json.loads(self._store.get(_ABORT_KEY, self.rearm))
                except GradsyncTimeoutError:
                    # A timeout, or a store that went away (Store.get reports both the same
                    # way): a plain look tells them apart, raising PeerLostError for the latter.
                    record = self._store.read_abort()
                    if record is None and time.monotonic() - started < self.rearm / 2:
                        time.sleep(min(1.0, self.rearm))  # never spin on a failing store
            self._record = record
        except PeerLostError as exc:
            self._error = exc
        except (RuntimeError, OSError, ValueError) as exc:
            self._error = PeerLostError(f"lost the rendezvous store: {exc} (its host, usually "
                                        f"rank 0 or the launcher, has probably died)")
        finally:
            if self._record is None and self._error is None:
                self._armed = False  # stopped: readers fall back to the store
            log.debug("abort watch of %s ends", self._store.job)
