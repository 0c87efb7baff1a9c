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

**Sub-worlds** (the Horovod API's process sets, the torch backend's lanes) have records of
their own, and a watch each would cost a thread and a store connection per sub-world per
process: with K process sets, 2 + K connections per rank at the store. So one ``Doorbell``
per root World per process keeps them all: a sub-world's view of the store *rings* its root's
bell when a record it posts wins (``Store.rings``: an ``add`` of the root's ring count and a
``set`` of ring number n, which holds the sub-world's job id), and the bell's thread waits
blocked on the next ring's key, then reads the record of the job that rang for the watches
that follow it here. A watch registers before its first look, so a record is found by that
look or rings after it. A ring whose poster died between its two requests would hold the bell
for good: at a re-arm that finds such a ring counted, the bell goes on from the count and
reads every record it keeps. A re-arm costs what a watch's does: the blocked ``get`` and one
look (the count), however many sub-worlds the bell keeps.

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

from ..cluster.rendezvous import BELL_COUNT, Store, bell_key
from ..errors import GradsyncTimeoutError, PeerLostError

__all__ = ["AbortWatch", "Doorbell", "REARM", "private_connection"]

log = logging.getLogger("gradsync")

REARM = 300.0
"""Seconds one blocked request waits for the record before it is asked again."""

# The record's key in the job's namespace: Store.post_abort writes it, Store.read_abort reads
# it; the watch blocks on it. (rendezvous.Store has no public blocking read of the record.)
_ABORT_KEY = "abort"

# The watches and bells whose thread may block in the store.
_blocked: "weakref.WeakSet[AbortWatch | Doorbell]" = weakref.WeakSet()
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
            descriptor (None: the watch never blocks, and readers look themselves); (None,
            None) for a watch that its ``bell`` keeps.
        fallback: the World's own store, read directly while the watch is not armed.
        rearm: seconds each blocked request waits before it is made again.
    """

    def __init__(self, connection: "tuple[Store | None, int | None]", fallback: Store,
                 rearm: float = REARM, *, bell: "Doorbell | None" = None):
        self._store, self._fd = connection
        self._fallback, self.rearm = fallback, rearm
        self._bell = bell
        self._record: dict | None = None
        self._error: PeerLostError | None = None
        self._armed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"gradsync-abort-watch-{fallback.job}")

    @classmethod
    def following(cls, bell: "Doorbell", fallback: Store) -> "AbortWatch":
        """A sub-world's watch, kept by its root World's ``bell``: no thread or connection of
        its own (module docstring, "Sub-worlds").

        Args:
            bell: the root World's ``Doorbell`` in this process.
            fallback: the sub-world's own store (its record's namespace).
        """
        return cls((None, None), fallback, bell=bell)

    @property
    def job(self) -> str:
        """The job id whose record this watch keeps."""
        return self._fallback.job

    def start(self) -> "AbortWatch":
        if self._bell is not None:
            self._bell.follow(self)
        elif self._fd is not None and not self._thread.is_alive() and not _exiting.is_set():
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
        if self._bell is not None:
            self._bell.unfollow(self)
        elif self._thread.is_alive() and self._thread is not threading.current_thread():
            _wake([self], _WAKE_JOIN_S)

    def _unarm(self) -> None:
        """Stops answering from memory (the thread or the bell ended): readers look in the
        store themselves, which reports a lost store."""
        if self._record is None and self._error is None:
            self._armed = False

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        store = self._store
        assert store is not None  # start() runs the thread only on a connection of its own
        try:
            # Armed only after a first look: a record posted before the wait began is seen.
            record = store.read_abort()
            self._armed = True
            while record is None and not self._stop.is_set() and not _exiting.is_set():
                started = time.monotonic()
                try:
                    record = json.loads(store.get(_ABORT_KEY, self.rearm))
                except GradsyncTimeoutError:
                    if self._stop.is_set() or _exiting.is_set():
                        break  # woken on purpose (_wake): no request on the shut connection
                    # A timeout, or a store that went away (Store.get reports both the same
                    # way): a plain look tells them apart, raising PeerLostError for the latter.
                    record = store.read_abort()
                    if record is None and time.monotonic() - started < self.rearm / 2:
                        self._stop.wait(min(1.0, self.rearm))  # never spin on a failing store
            self._record = record
        except (PeerLostError, RuntimeError, OSError, ValueError) as exc:
            if not (self._stop.is_set() or _exiting.is_set()):  # else: woken on purpose
                self._error = exc if isinstance(exc, PeerLostError) else PeerLostError(
                    f"lost the rendezvous store: {exc} (its host, usually rank 0 or the "
                    f"launcher, has probably died)")
        finally:
            self._unarm()  # stopped: readers fall back to the store
            log.debug("abort watch of %s ends", self.job)


class Doorbell:
    """One thread on one private connection that keeps the abort records of every sub-world
    of one root World in this process (module docstring, "Sub-worlds").

    Args:
        root: the root World's job-scoped store; the bell's keys live in its namespace.
        rearm: seconds each blocked request waits before it is made again.
    """

    def __init__(self, root: Store, rearm: float = REARM):
        self._store, self._fd = private_connection(root)
        self.rearm = rearm
        self._followers: dict[str, list[AbortWatch]] = {}  # job -> its watches here
        self._views: dict[str, Store] = {}  # job -> its namespace over the bell's connection
        self._lock = threading.Lock()
        self._next = 0  # the number of the next ring to wait for
        self._ended = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"gradsync-abort-bell-{root.job}")

    def follow(self, watch: AbortWatch) -> None:
        """Keeps ``watch``'s record from now on: registers it, then looks once (a record
        posted before the registration is found by that look, one posted after it rings)."""
        with self._lock:
            if self._ended or self._fd is None or _exiting.is_set():
                return  # the watch stays unarmed: its readers look themselves
            if not self._thread.is_alive():
                # Where the rings stand, before any watch looks (so no ring falls between),
                # asked here: the thread, once started, holds the connection.
                self._next = self._store.add(BELL_COUNT, 0) + 1
                self._address = _store_sockets().get(self._fd)
                _blocked.add(self)
                self._thread.start()
            self._followers.setdefault(watch.job, []).append(watch)
        try:
            record = watch._fallback.read_abort()
        except PeerLostError as exc:
            watch._error = exc
            return
        if record is not None and watch._record is None:
            watch._record = record
        watch._armed = True

    def unfollow(self, watch: AbortWatch) -> None:
        with self._lock:
            watches = self._followers.get(watch.job, [])
            if watch in watches:
                watches.remove(watch)
        watch._unarm()

    def stop(self) -> None:
        """Ends the thread (woken as a watch is, ``_wake``); the watches still following fall
        back to reading the store."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            _wake([self], _WAKE_JOIN_S)
        self._end()

    def _end(self) -> None:
        with self._lock:
            self._ended = True
            watches = [w for ws in self._followers.values() for w in ws]
        for watch in watches:
            watch._unarm()

    # ------------------------------------------------------------------ the thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set() and not _exiting.is_set():
                started = time.monotonic()
                try:
                    job = self._store.get(bell_key(self._next), self.rearm).decode()
                except GradsyncTimeoutError:
                    if self._stop.is_set() or _exiting.is_set():
                        break  # woken on purpose (_wake)
                    # A re-arm, or a lost store (the request below raises). A ring counted
                    # a whole re-arm ago whose key is still missing (its poster died between
                    # the two) would hold the line for good: go on from the count, and look
                    # at every record kept here instead.
                    count = self._store.add(BELL_COUNT, 0)
                    if count >= self._next:
                        self._next = count + 1
                        self._look(None)
                    if time.monotonic() - started < self.rearm / 2:
                        self._stop.wait(min(1.0, self.rearm))  # never spin on a failing store
                    continue
                self._next += 1
                self._look(job)
        except (PeerLostError, RuntimeError, OSError, ValueError) as exc:
            # Stopped, or the store is gone: the watches' readers look themselves and report it.
            log.debug("abort bell of %s ends: %s", self._store.job, exc)
        finally:
            self._end()

    def _look(self, job: "str | None") -> None:
        """Reads the record of ``job`` (None: of every job followed) for its watches here."""
        with self._lock:
            watches = [w for j, ws in self._followers.items() if job in (None, j) for w in ws
                       if w._record is None]
        for watch in watches:
            view = self._views.get(watch.job)
            if view is None:
                view = self._views[watch.job] = Store.over(self._store.base, watch.job,
                                                           self._store.timeout)
            record = view.read_abort()
            if record is not None:
                watch._record = record


_exiting = threading.Event()
_EXIT_JOIN_S = 30.0  # the longest the exit waits for the woken threads (usually milliseconds)
_WAKE_JOIN_S = 2.0  # the longest a close waits for its woken thread (usually milliseconds)
_wake_lock = threading.Lock()  # one wake at a time: each mutes and restores the process's stderr


def _wake(watches: "list[AbortWatch | Doorbell]", join_s: float) -> None:
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
                # (A watch or bell without a descriptor of its own never starts its thread.)
                fd = watch._fd
                if fd is not None and _store_sockets().get(fd) == watch._address:
                    sock = socket.socket(fileno=os.dup(fd))
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
