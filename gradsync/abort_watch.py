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
- A blocked request cannot be cancelled through torch's API, and no key can wake it but the
  record's own: a TCPStore wait ends when *all* its keys exist, never at the first of two,
  and writing the record to wake one rank's watch would abort every rank. So ``stop`` (a
  World's ``close``) wakes its thread by shutting the watch's own connection down under it
  (``_wake``): the blocked ``get`` fails at once, the thread sees the watch stopped and ends,
  within milliseconds. Without this, a World closed without a record in a process that goes
  on (``shutdown()`` then ``init()``, a process set's or a torch group's World) kept its
  thread and connection blocked in the store for up to ``rearm`` seconds.
- torch logs the failed request with a C++ stack (about 20 lines on stderr), so the process's
  stderr is muted while the woken thread comes back (milliseconds; at most ``_WAKE_JOIN_S``
  at a close): whatever another thread writes to stderr in those milliseconds is lost too.
  The connection's descriptor is found when it is made (``private_connection``) and
  checked against the socket's addresses before the shutdown; a watch whose descriptor is
  not known never blocks, so there is nothing to wake.
- A Python thread that comes back from a C++ call while the interpreter finalizes is ended
  by CPython 3.11 in a way that aborts the process (``terminate called without an active
  exception``), and a blocked request comes back when the store's host exits. So at exit
  (``atexit``, after ``gradsync.shutdown``) every watch still blocked is woken the same way.
- Until the wait is in place (``armed``), and for a store that cannot be cloned (not a
  TCPStore), callers read the record themselves (``read_abort`` does), as before.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref

from .errors import GradsyncTimeoutError, PeerLostError
from .rendezvous import Store

__all__ = ["AbortWatch", "REARM", "private_connection"]

log = logging.getLogger("gradsync")

REARM = 300.0
"""Seconds one blocked request waits for the record before it is asked again."""

# The record's key in the job's namespace: Store.post_abort writes it, Store.read_abort reads
# it; the watch blocks on it. (rendezvous.Store has no public blocking read of the record.)
_ABORT_KEY = "abort"

_blocked: "weakref.WeakSet[AbortWatch]" = weakref.WeakSet()  # watches whose thread may block
_clone_lock = threading.Lock()


def private_connection(store: Store) -> "tuple[Store, int | None]":
    """A view of ``store``'s job over a new connection (``Store.clone_private``), and that
    connection's file descriptor, or None where it cannot be told apart (a store that cannot
    be cloned, or another thread connecting to the same store at the same moment)."""
    with _clone_lock:
        before = _store_sockets()
        private = store.clone_private()
        after = _store_sockets()
    base = private.base
    while not hasattr(base, "port") and hasattr(base, "underlying_store"):
        base = base.underlying_store  # a PrefixStore, as torch hands a backend
    # New sockets to the store's port (a store served by this process adds its own end too).
    new = [fd for fd, (_, peer) in after.items()
           if fd not in before and peer[1] == getattr(base, "port", None)]
    if private.base is store.base or len(new) != 1:
        return private, None
    return private, new[0]


def _store_sockets() -> "dict[int, tuple]":
    """This process's TCP sockets: descriptor -> (local address, peer address)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # closed meanwhile
        try:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET,
                                                                   socket.AF_INET6):
                found[int(name)] = (sock.getsockname(), sock.getpeername())
        except OSError:
            pass  # a listener, or not connected
        finally:
            sock.close()
    return found


class AbortWatch:
    """A thread that blocks in the store until the World's abort record exists.

    Args:
        connection: ``private_connection``'s answer: a job-scoped store over a connection
            that nobody else uses, which the watch takes over once started, and its file
            descriptor (None: the watch never blocks, and readers look themselves).
        fallback: the World's own store, read directly while the watch is not armed.
        rearm: seconds each blocked request waits before it is made again.
    """

    def __init__(self, connection: "tuple[Store, int | None]", fallback: Store,
                 rearm: float = REARM):
        self._store, self._fd = connection
        self._fallback, self.rearm = fallback, rearm
        self._record: dict | None = None
        self._error: PeerLostError | None = None
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"gradsync-abort-watch-{self._store.job}")

    def start(self) -> "AbortWatch":
        if self._fd is not None and not self._thread.is_alive() and not _exiting.is_set():
            self._address = _store_sockets().get(self._fd)
            _blocked.add(self)
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

    def held(self) -> dict | None:
        """The record if the thread already holds it; never a store request."""
        return self._record

    def stop(self) -> None:
        """Stops the watch and ends its thread: a thread blocked in the store is woken by
        shutting its connection down (module docstring), and joined for a moment."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            _wake([self], _WAKE_JOIN_S)

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        try:
            # Armed only after a first look: a record posted before the wait began is seen.
            record = self._store.read_abort()
            self._armed = True
            while record is None and not self._stop.is_set() and not _exiting.is_set():
                started = time.monotonic()
                try:
                    record = json.loads(self._store.get(_ABORT_KEY, self.rearm))
                except GradsyncTimeoutError:
                    if self._stop.is_set() or _exiting.is_set():
                        break  # woken on purpose (_wake): no request on the shut connection
                    # A timeout, or a store that went away (Store.get reports both the same
                    # way): a plain look tells them apart, raising PeerLostError for the latter.
                    record = self._store.read_abort()
                    if record is None and time.monotonic() - started < self.rearm / 2:
                        self._stop.wait(min(1.0, self.rearm))  # never spin on a failing store
            self._record = record
        except (PeerLostError, RuntimeError, OSError, ValueError) as exc:
            if not (self._stop.is_set() or _exiting.is_set()):  # else: woken on purpose
                self._error = exc if isinstance(exc, PeerLostError) else PeerLostError(
                    f"lost the rendezvous store: {exc} (its host, usually rank 0 or the "
                    f"launcher, has probably died)")
        finally:
            if self._record is None and self._error is None:
                self._armed = False  # stopped: readers fall back to the store
            log.debug("abort watch of %s ends", self._store.job)


_exiting = threading.Event()
_EXIT_JOIN_S = 30.0  # the longest the exit waits for the woken threads (usually milliseconds)
_WAKE_JOIN_S = 2.0  # the longest a close waits for its woken thread (usually milliseconds)
_wake_lock = threading.Lock()  # one wake at a time: each mutes and restores the process's stderr


def _wake(watches: "list[AbortWatch]", join_s: float) -> None:
    """Wakes the threads of ``watches`` (each marked stopped or exiting) out of their blocked
    requests by shutting their connections down, and waits up to ``join_s`` for them to end,
    with stderr muted meanwhile (the module docstring says why)."""
    with _wake_lock:
        watches = [w for w in watches if w._thread.is_alive()]
        if not watches:
            return
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            quiet = os.open(os.devnull, os.O_WRONLY)
            os.dup2(quiet, 2)
            os.close(quiet)
            for watch in watches:
                # The thread is alive, so it holds its connection: the descriptor is still
                # its own, unless the addresses say otherwise.
                if _store_sockets().get(watch._fd) == watch._address:
                    sock = socket.socket(fileno=os.dup(watch._fd))
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    sock.close()
            # Until each thread is back in Python and done, torch's log of the failed request
            # included. At exit that is required as well: a thread that comes back after the
            # interpreter began to finalize aborts the process (SIGABRT at the end of a job
            # that succeeded). Woken threads need only a few milliseconds of CPU, but on a
            # loaded host (64 ranks on 2 cores at the end of an elastic job) 2 s were not
            # always enough at exit.
            end = time.monotonic() + join_s
            for watch in watches:
                watch._thread.join(max(0.0, end - time.monotonic()))
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@atexit.register
def _wake_all() -> None:
    """Ends every blocked request before the interpreter finalizes (module docstring)."""
    _exiting.set()
    _wake(list(_blocked), _EXIT_JOIN_S)
