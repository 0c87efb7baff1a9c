"""Heartbeats: a rank that is alive but silent is a lost rank.

A peer that dies closes its sockets, and a same-host peer's pid vanishes, so the waits notice
at once. A peer that is *stopped* (SIGSTOP, a debugger, a kernel stuck in uninterruptible
I/O) or cut off by a partitioned network shows none of that: its sockets stay open and its
pid exists, and without heartbeats the others would wait for the collective timeout (300 s).

The scheme, per World (so each generation of an elastic job has its own). Beats travel
between the ranks, never through the store, so the store's load does not grow with the job:

- **Links.** Each rank keeps one small authenticated TCP *link* to each of its two ring
  neighbours, rank - 1 and rank + 1 (one link in a World of two). Each rank connects to
  rank + 1 and accepts rank - 1 on a listening socket of its own, whose address it writes
  once in the store (``hb/<rank>/at``); once rank - 1 has connected the listener closes.
  The handshake is ``transport/tcp.py``'s HMAC challenge with the job's secret, bound to a job
  id of its own (``<job>/heartbeat``), so a link is never taken for a collective's pair.
  Store requests: three per rank for the whole job (a set, a check and a get; more checks
  if rank + 1 is late), four with the goodbye.
- **Beat.** A native thread of every rank (``beater.py``, in the compiled module) sends one
  byte (``BEAT``) on each link every ``heartbeat_interval`` seconds. It never takes the GIL,
  so a rank beats whatever its Python threads do: compute, wait, or sit in one long C call
  that holds the GIL (an ``import torch``). A stopped process stops every thread, the beater
  included. Without the compiled module (no C compiler) the heartbeat's Python thread sends
  the beats itself, with the limit below.
- **Read.** A daemon Python thread of every rank reads its neighbours' beats and judges them.
- **Watch.** A link that ends (closed or reset) without a ``BYE`` byte is a lost peer at once
  (the process died: its kernel closed the socket), unless the store holds the peer's goodbye
  (below). A link that stays open but silent for ``heartbeat_timeout`` seconds of this
  watcher's own time is a silent peer. A rank that closes its World on purpose says goodbye
  (below); its neighbours then stop watching it.
- **Report.** The watcher posts the job's abort record (a ``PeerLostError`` naming the rank,
  its host and pid; ``silent: true`` for a silent one) and keeps the error for its own World
  if its record won. Every waiting rank sees the record through its World's abort watch
  (``abort_watch.py``: one blocked store request per rank, not a poll) and raises it.
  ``gradsync run`` in elastic mode reads ``silent`` and kills that rank, which cannot clean up
  after itself.

Every rank is watched by both its neighbours. Whatever set of ranks stops (short of all), one
of them has a running neighbour, which reports it: the job never waits for its timeout.

Worked example, with the defaults (interval 0.25 s, timeout 2 s): rank 2 of 4 is stopped at
t = 0.3 s; its last beat left at t = 0.25. Ranks 1 and 3 hear nothing more. Each looks at its
links at least once an interval, so the first look more than 2 s after t = 0.25 comes at the
latest at t = 2.5: detection within ``timeout + interval`` of the last beat,
``timeout + 2 * interval`` of the stop, and no earlier than ``timeout`` after the last beat.
Every waiting rank raises it at its next look at the abort record (``abort_poll_interval``,
0.1 s): 2.6 s after the stop at worst. Had rank 2 been killed, its links would have closed at
t = 0.3 and ranks 1 and 3 would have reported it within milliseconds.

What keeps a live rank from looking silent, and what does not:

- A watcher that was itself stalled (it was the stopped one, the machine was starved, or
  its own main thread held the GIL) must not blame its peers for its own gap: when its own
  loop ran late by more than half the timeout, it restarts every peer's clock instead of
  judging. Beats that arrived meanwhile wait in its socket buffer and count when it reads
  them, so a late watcher alone is no evidence either way; and it reads every link at each
  look before it judges, not only those its last ``select`` found ready, since it may have
  waited for the GIL for seconds between that ``select`` and its judgement.
- The native beater beats through any GIL hold. Without it the beats come from the Python
  thread, which beats while the main thread runs Python (the GIL changes hands every 5 ms)
  or waits in C code that releases the GIL (torch and NumPy kernels, sockets, sleeps); one
  C call that holds the GIL longer than ``timeout - interval`` (1.75 s by default; an
  ``import torch`` on a loaded machine comes near, ``sum(range(10**9))`` passes it)
  silences it, and its neighbours report it lost.
- Until a link is up the neighbour cannot beat on it: the links get ``max(timeout,
  LINK_UP_S)`` (30 s) to form, so that the ranks of a large job on a crowded machine, which
  leave the connect barrier seconds apart, are not taken for silent ones (with 10 s, one
  rank of 64 on 2 cores was, while other jobs loaded the machine). A rank stopped before its
  links are up is found within that window.

**Leaving: the end of a job is a protocol, not a race.** The ranks of a job leave its last
barrier seconds apart on a crowded machine, so a rank that leaves is often the neighbour of one
still waiting. A neighbour must know it left, whatever the order in which sockets close, resets
arrive and the store answers. ``stop(goodbye=True)``, in this order:

1. writes ``hb/<rank>/bye`` in the store, while this rank still beats: the store may
   take seconds to answer (it stalls when many ranks exit at once: docs/troubleshooting.md),
   and a rank that fell quiet meanwhile would be reported silent. Once written, the key is the
   goodbye's evidence for a neighbour whose link was not up yet, or whose ``BYE`` was lost;
2. ends its thread, which hands the links to ``stop`` instead of closing them (before, the
   thread closed them while ``stop`` still waited for the store, so a neighbour saw the link
   end without ``BYE`` and found no key yet: a false "closed its heartbeat link" at the end
   of a 64-rank job in CI);
3. stops the native beats on each link (beater.py: before the ``BYE``, and before the close,
   so that the beater never writes a descriptor that the process reuses), sends ``BYE`` and
   half-closes it (``SHUT_WR``: the ``BYE``, then a FIN);
4. reads its neighbours' beats until each has closed its end (it does on reading ``BYE``), for
   up to ``BYE_WAIT_S``, and only then closes: a socket closed with bytes unread sends a reset
   (RST) instead of a FIN, and a reset discards whatever the sender had not yet had
   acknowledged, a ``BYE`` included. A neighbour not heard for half the timeout (stopped, cut
   off) is not waited for.

A watcher whose link ended without ``BYE`` asks the store for the key before it reports the
peer. A rank that left on purpose wrote the key before its link could end, so a store that
says "no key" means a crash; a store request that fails is no answer, and is asked again (at
growing intervals, with this rank's beats going on meanwhile) until it answers, or until
``link_up`` seconds have passed: then this rank raises the loss itself, as before. A crash is
still found at once: one store request.

**Sub-worlds** (the Horovod API's process sets, the torch backend's lanes) have the same
ranks as their root World, whose heartbeat in this process already watches every one of
them. A sub-world's Heartbeat therefore *follows* the root's (found in this process by the
root's job id and rank): it opens no links, watches only its own abort record, and raises a
lost peer that the root's heartbeat or record names, if that peer is one of its members.
Without a root heartbeat in this process it runs links of its own, and reports a silent peer
in the root World's abort record too, in root ranks: the launcher watches only that record.

Sockets per rank: two links, the abort watch's store connection, and the listener until
rank - 1 has connected; following sub-worlds add one store connection in all, however many
there are: their records are kept by the root's bell (``abort_watch.Doorbell``).
And a pipe, with which ``stop`` wakes the thread; with the native beater, a duplicate
descriptor of each link that it writes, and its thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import threading
import time
import weakref

from ..cluster.rendezvous import Store
from ..errors import AuthenticationError, GradsyncError, GradsyncTimeoutError, PeerLostError
from ..transport import tcp
from . import abort_watch, beater

__all__ = ["Heartbeat", "watched_peers", "BEAT", "BYE", "BYE_WAIT_S", "LINK_UP_S"]

log = logging.getLogger("gradsync")

BEAT = b"\x01"
"""The byte a rank sends on each link every interval."""
BYE = b"\x02"
"""The byte a rank sends on each link when it closes its World on purpose."""
LINK_UP_S = 30.0
"""Seconds the links get to form when the timeout is shorter (module docstring)."""
BYE_WAIT_S = 1.0
"""Seconds a leaving rank waits for its neighbours to close their ends after its ``BYE``."""

# The root World's heartbeat of each (job, rank) in this process, for its sub-worlds to follow.
_ROOTS: "weakref.WeakValueDictionary[tuple[str, int], Heartbeat]" = (
    weakref.WeakValueDictionary())


def watched_peers(rank: int, size: int) -> list[int]:
    """The ranks ``rank`` keeps links to and watches: its neighbours on the ring of ranks.

    >>> watched_peers(0, 4), watched_peers(1, 2), watched_peers(0, 1)
    ([3, 1], [0], [])
    """
    return list(dict.fromkeys(p for p in ((rank - 1) % size, (rank + 1) % size) if p != rank))


class _Stopped(Exception):
    """The World closed while its heartbeat was still setting up its links."""


class _Lost(Exception):
    """A neighbour is lost (``silent``: alive but quiet; otherwise its link broke). ``kind``:
    the error every rank raises for it, ``PeerLostError`` unless the neighbour's link failed
    its authentication (``AuthenticationError``: a wrong secret is no lost peer)."""

    def __init__(self, peer: int, message: str, silent: bool,
                 kind: type[GradsyncError] = PeerLostError):
        super().__init__(message)
        self.peer, self.message, self.silent, self.kind = peer, message, silent, kind


class _Link:
    """The link to one neighbour: its socket and when this rank last heard from it; with
    ``beats``, the native beater that beats on it (else the heartbeat's thread does)."""

    def __init__(self, peer: int, sock: socket.socket, beats: "beater.Beater | None" = None):
        self.peer, self.sock = peer, sock
        sock.setblocking(False)
        self.heard = time.monotonic()
        self.left = False  # it sent BYE
        self._beats = beats
        self._beat = None if beats is None else beats.add_socket(sock.fileno(), BEAT)

    def quiet(self) -> None:
        """Ends the native beats on this link: before its BYE (no beat after it) and before
        its socket closes (beater.py: the one rule)."""
        # Read once: a second closer may clear it between a check and a use (its remove
        # of the same beat, two closers at once, is harmless).
        beat, self._beat = self._beat, None
        if beat is not None:
            assert self._beats is not None  # a beat is one that the beater added
            self._beats.remove(beat)

    def close(self) -> None:
        self.quiet()
        self.sock.close()

    def send(self, byte: bytes) -> None:
        try:
            self.sock.send(byte)
        except (BlockingIOError, InterruptedError):
            pass  # 4 MiB of unread beats: the reader is stopped, and the timeout will say so
        except OSError:
            pass  # broken: the next read sees it and reports

    def read(self, now: float) -> bool:
        """Reads what arrived; False when the link closed."""
        try:
            data = self.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False
        if not data:
            return False
        if data.strip(BEAT + BYE):
            raise _Lost(self.peer, f"sent {len(data)} bytes that are no heartbeat on its link",
                        silent=False)
        self.heard = now
        self.left = self.left or BYE in data
        return True


class Heartbeat:
    """The links, beats and watch of one World, and the watch on its abort record.

    Args:
        store: the World's job-scoped ``rendezvous.Store``. The heartbeat makes one private
            connection from it (its links' set-up, then the abort watch) and writes its
            goodbye through it.
        rank, size: this rank and the World's size.
        interval: seconds between beats (and between looks at the links).
        timeout: seconds without a beat after which a neighbour is lost.
        describe: ``describe(rank)`` names a peer in messages (host, pid).
        root: for a sub-world, the job id of the World at the root of its tree and the root
            rank of each rank here (``World.root``): the sub-world follows the root's
            heartbeat, or reports a silent peer in the root's record too (module docstring).
        secret: the job's secret, which authenticates the links. None: a secret of the
            heartbeat's own, made by rank 0 in the store (as the job's is when no launcher
            gives one); the World passes its own.
        addr: the address this rank's listener binds and publishes. None: this host's
            address on the route to the store.
        link_up: seconds the links get to form; None: ``max(timeout, LINK_UP_S)``.
    """

    def __init__(self, store: Store, rank: int, size: int, interval: float, timeout: float,
                 describe=lambda rank: f"rank {rank}",
                 root: "tuple[str, list[int]] | None" = None, *,
                 secret: bytes | None = None, addr: str | None = None,
                 link_up: float | None = None):
        self.rank, self.size = rank, size
        self.interval, self.timeout = interval, timeout
        self.link_up = max(timeout, LINK_UP_S) if link_up is None else link_up
        self.describe = describe
        self.lost: GradsyncError | None = None  # a PeerLostError, or an AuthenticationError
        self._posted: dict | None = None  # this rank's post, if it is the job's record
        self._ended: GradsyncError | None = None  # end_waits
        self._main = store
        self._secret, self._addr = secret, addr
        self._root = root if root is not None and root[0] != store.job else None
        self._leader = (_ROOTS.get((self._root[0], self._root[1][rank]))
                        if self._root is not None else None)
        if self._leader is not None:
            # A follower's record is kept by its root's bell: no connection of its own.
            self._private = store
            self.abort = abort_watch.AbortWatch.following(self._leader.doorbell(), store)
        else:
            connection = abort_watch.private_connection(store)
            self._private = connection[0]
            self.abort = abort_watch.AbortWatch(connection, store)
        self._bell: "abort_watch.Doorbell | None" = None  # doorbell()
        # Not self._lock: making the bell connects to the store (seconds, when the store's
        # host is slow to resolve the new client), and the thread beats under that lock.
        self._bell_lock = threading.Lock()
        self._links: dict[int, _Link] = {}
        self._beater: "beater.Beater | None" = None  # start(): the native beats, if built
        self._next_beat = 0.0  # the next look at the links (and beat, without a beater)
        self._listener: tcp.Listener | None = None
        self._armed = False  # the abort watch started (_arm)
        self._lock = threading.Lock()  # the links and listener, between stop() and the thread
        self._stop = threading.Event()
        self._stopping = False  # stop() was called (it runs once)
        self._wake: "tuple[int, int] | None" = None  # a pipe: stop() -> _watch's select
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"gradsync-heartbeat-{rank}")

    @property
    def follows(self) -> bool:
        """True for a sub-world's heartbeat that follows its root World's (no links)."""
        return self._leader is not None

    def start(self) -> "Heartbeat":
        if self._leader is not None:
            self.abort.start()
            return self
        if self._root is None:
            _ROOTS[(self._main.job, self.rank)] = self
        self._beater = beater.start(self.interval)
        self._wake = os.pipe()
        self._thread.start()
        return self

    def doorbell(self) -> "abort_watch.Doorbell":
        """The bell that keeps the records of this (root) World's sub-worlds in this process,
        made at the first one's ask, ended with this heartbeat."""
        with self._bell_lock:
            if self._bell is None:
                self._bell = abort_watch.Doorbell(self._main)
                if self._stopping:  # stop() set it first, then looks for a bell: none yet
                    self._bell.stop()
            return self._bell

    def read_abort(self) -> dict | None:
        """The World's abort record, or None (``Store.read_abort``, without a store request
        once the abort watch is armed)."""
        return self.abort.read_abort()

    @property
    def won(self) -> bool:
        """Whether this rank's post of a lost peer is the job's abort record."""
        return self._posted is not None

    def known_record(self) -> dict | None:
        """The job's abort record if this process knows it without asking the store (its
        own post won, or the abort watch holds the record), else None."""
        return self._posted if self._posted is not None else self.abort.held()

    def check(self) -> None:
        """Raises the PeerLostError of a lost peer once one was found (called by waits), or
        the error given to ``end_waits``."""
        if self._ended is not None:
            raise self._ended
        if self.lost is not None:
            raise self.lost
        leader = self._leader
        if leader is None:
            return
        assert self._root is not None  # a leader is looked up only for a sub-world's root
        members = self._root[1]
        found = leader.lost
        if isinstance(found, PeerLostError) and found.peer is not None and found.peer in members:
            raise PeerLostError(str(found), peer=members.index(found.peer))
        record = leader.read_abort()
        if (record is not None and record["kind"] == "PeerLostError"
                and record.get("peer") in members):
            who = "the launcher" if record["rank"] < 0 else f"rank {record['rank']}"
            raise PeerLostError(f"{who} reported: {record['message']}",
                                peer=members.index(record["peer"]))

    def end_waits(self, error: GradsyncError) -> None:
        """Makes every wait of this World raise ``error`` at its next look (``check``).

        For a rank that ends its own World's collectives (the torch backend's ``abort``):
        it posts the abort record for its peers, but a wait does not raise a record that
        its own rank posted, since that rank raised the error where it found it."""
        self._ended = error

    def stop(self, goodbye: bool = True) -> None:
        """Stops beating; ``goodbye`` tells the neighbours that this rank left on purpose
        (module docstring, "Leaving"); without it the links just close, as in a crash."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        with self._bell_lock:
            bell = self._bell
        self.abort.stop()
        if bell is not None:
            bell.stop()
        if _ROOTS.get((self._main.job, self.rank)) is self:
            del _ROOTS[(self._main.job, self.rank)]
        if self._leader is not None:
            self._stop.set()
            return
        if goodbye:
            # Before any link can end, and while this rank still beats (the store may take
            # seconds): a neighbour that later finds no key can take a broken link for a crash.
            try:
                self._main.set(f"hb/{self.rank}/bye", "1")
            except (RuntimeError, OSError, GradsyncError):
                pass  # the store is gone: the BYE on the links still tells the neighbours
        with self._lock:  # the thread's exit reads _stop under the lock: it leaves us the links
            self._stop.set()
        if self._wake is not None:
            os.write(self._wake[1], b"\0")  # out of _watch's select at once
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            # Within milliseconds, unless the thread waits on the store for a lost peer: then
            # the links are taken from under it, which _drop and the stop checks allow for.
            self._thread.join(max(1.0, 2 * self.interval))
        with self._lock:
            links, self._links = list(self._links.values()), {}
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if goodbye:
            # A stopped neighbour is not waited for: a survivor of a stopped rank that raised
            # the job's record before its own watch judged that rank closes its World at once.
            _leave(links, BYE_WAIT_S, quiet=self.timeout / 2)
        else:
            for link in links:
                link.close()
        if self._beater is not None:
            # Every link of this World is quiet by now, and a thread that outlived its join
            # closes the links it still holds through _drop, which the beater allows for.
            self._beater.close()
        if self._wake is not None and not self._thread.is_alive():
            for end in self._wake:
                os.close(end)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            # While this thread sets the links up it may block for seconds (a handshake with a
            # neighbour that is slow to answer, a busy store): the links already up keep
            # beating meanwhile, so their other ends, already watching, do not take this rank
            # for silent (a false loss at 16 ranks on 2 cores without it).
            try:
                with self._pulsing():
                    lost = self._link_up()
            finally:
                self._arm()
            for each in lost:
                self._lost(each)
            self._watch()  # even after a loss: this rank is alive, its other link says so
        except _Stopped:
            pass
        except (GradsyncError, RuntimeError, OSError) as exc:
            # The store is gone: the waits report that themselves (World.on_idle).
            log.debug("rank %d: heartbeat thread ends: %s", self.rank, exc)
        finally:
            # A World that closes takes the links itself, to say goodbye on them: closed here,
            # they would end without BYE while stop() still writes the goodbye in the store.
            with self._lock:
                links = [] if self._stop.is_set() else list(self._links.values())
                if links:
                    self._links = {}
            for link in links:
                link.close()

    @contextlib.contextmanager
    def _pulsing(self):
        """Beats on the links already up from a thread of its own, while this thread is busy
        elsewhere (setting links up, asking the store about a lost peer); the native beater,
        where there is one, beats anyway."""
        if self._beater is not None:
            yield
            return
        done = threading.Event()
        pulse = threading.Thread(target=self._pulse, args=(done,), daemon=True,
                                 name=f"gradsync-heartbeat-pulse-{self.rank}")
        pulse.start()
        try:
            yield
        finally:
            done.set()
            pulse.join()

    def _arm(self) -> None:
        """Starts the abort watch once the link set-up is done with the store (the watch
        blocks on the same private connection); until then the waits poll the record."""
        if not self._stop.is_set() and not self._armed:
            self._armed = True
            self.abort.start()

    def _pulse(self, linked: threading.Event) -> None:
        """Beats on the links already up until ``linked`` is set (or the World closed)."""
        while not linked.wait(self.interval / 2) and not self._stop.is_set():
            self._beat(time.monotonic())

    def _alive(self) -> None:
        """Called about every 0.1 s while the links are set up: ends the set-up when the
        World closed, and beats on the links already up (their other ends may be watching)."""
        if self._stop.is_set():
            raise _Stopped
        self._beat(time.monotonic())

    def _beat(self, now: float) -> None:
        if now >= self._next_beat:
            if self._beater is None:  # else the native thread beats (beater.py)
                for link in list(self._links.values()):
                    link.send(BEAT)
            self._next_beat = now + self.interval

    def _link_up(self) -> "list[_Lost]":
        """Connects to rank + 1 and accepts rank - 1, each within ``timeout``; returns the
        neighbours lost on the way. One lost neighbour does not stop the other's link: a
        rank that never linked a live neighbour would be reported silent by it."""
        rank, size = self.rank, self.size
        succ, pred = (rank + 1) % size, (rank - 1) % size
        # In a World of two, both neighbours are the same rank: one link, rank 0 connects.
        connect_to = succ if size > 2 or rank < succ else None
        accept_from = pred if size > 2 or pred < rank else None
        deadline = time.monotonic() + self.link_up
        try:
            secret = self._secret or self._own_secret(deadline)
        except _Lost as exc:
            return [exc]  # rank 0 never made the links' secret
        job = f"{self._main.job}/heartbeat"
        lost: list[_Lost] = []
        if accept_from is not None:
            addr = self._addr or _route_address(self._main)
            # Each accepted link joins at once (on the handshake's thread), so that it beats
            # while this thread still waits for rank + 1: its other end is watching already.
            listener = tcp.Listener(addr, rank, secret, job, expect={accept_from},
                                    on_accept=self._accepted)
            with self._lock:
                self._listener = listener
            self._alive()
            self._private.set(f"hb/{rank}/at", f"{addr} {listener.port}")
        if connect_to is not None:
            try:
                self._add(connect_to, self._connect(connect_to, secret, job, deadline))
            except _Lost as exc:
                lost.append(exc)
        # The store is not needed to accept rank - 1: the watch starts now, not once rank - 1
        # is in. A rank whose rank - 1 died before linking waits here (up to ``link_up``);
        # polling the record meanwhile, it raised a job's failure 4-5 s late when the store
        # stalled (torch's store server resolves the address of each connection that closes,
        # with one DNS request, which a slow resolver makes a 5 s wait: docs/troubleshooting.md).
        self._arm()
        if accept_from is not None:
            try:
                listener.wait_for({accept_from}, deadline, self._alive)
            except GradsyncTimeoutError:
                lost.append(self._unlinked(accept_from))
            finally:
                with self._lock:
                    self._listener = None
                listener.close()
        return lost

    def _connect(self, peer: int, secret: bytes, job: str, deadline: float) -> socket.socket:
        host, port = self._await(f"hb/{peer}/at", peer, deadline).decode().rsplit(" ", 1)
        try:
            sock = tcp.connect(host, int(port), self.rank, peer, secret, job, deadline,
                               self._alive)
        except GradsyncTimeoutError:
            raise self._unlinked(peer) from None
        except PeerLostError as exc:
            raise _Lost(peer, f"{self.describe(peer)} broke its heartbeat link: {exc}",
                        silent=False) from None
        except AuthenticationError as exc:
            # Raised as what it is on every rank (the job's record keeps the kind): with the
            # first collective often racing this thread, a PeerLostError here made a wrong
            # secret look like a crash on the rank whose own connections had all proved.
            raise _Lost(peer, f"{self.describe(peer)} refused its heartbeat link: {exc}",
                        silent=False, kind=AuthenticationError) from None
        assert sock is not None  # tcp.connect answers None only to a crossing dial
        return sock

    def _accepted(self, peer: int, sock: socket.socket) -> None:
        try:
            self._add(peer, sock)
        except _Stopped:
            pass  # _add closed it

    def _add(self, peer: int, sock: socket.socket) -> None:
        with self._lock:
            if self._stop.is_set():
                sock.close()
                raise _Stopped
            self._links[peer] = _Link(peer, sock, self._beater)  # the beater beats at once
        self._next_beat = 0.0  # a first beat at once: the other end's clock has started

    def _await(self, key: str, peer: int, deadline: float) -> bytes:
        """The value of ``key`` once ``peer`` wrote it; _Lost as silent at ``deadline``.

        Looks, not a blocking get: the thread must notice ``stop`` (and a get that times
        out makes torch log warnings)."""
        delay = 0.005
        while not self._private.check(key):
            self._alive()
            if time.monotonic() > deadline:
                raise self._unlinked(peer)
            time.sleep(delay)
            delay = min(2 * delay, 0.1)
        return self._private.get(key)

    def _own_secret(self, deadline: float) -> bytes:
        if self.rank == 0:
            self._private.set("hb/secret", secrets.token_hex(32))
        return bytes.fromhex(self._await("hb/secret", 0, deadline).decode())

    def _watch(self) -> None:
        """Looks at every link each interval (and beats on it, without a native beater);
        reads beats as they come; judges silence."""
        wake = self._wake
        assert wake is not None  # start() made the pipe before it started this thread
        previous = time.monotonic()
        while not self._stop.is_set():
            links = [link for link in self._links.values() if not link.left]
            if not links:
                self._stop.wait()  # every neighbour left on purpose: nothing to watch
                return
            now = time.monotonic()
            if now - previous > self.timeout / 2:
                # This process was stalled itself: its peers' silence is not evidence.
                for link in links:
                    link.heard = now
            previous = now
            self._beat(now)
            watched: "list[socket.socket | int]" = [link.sock for link in links]
            select.select(watched + [wake[0]], [], [],
                          max(0.0, self._next_beat - now))
            if self._stop.is_set():
                return  # the World closes: stop() says goodbye on the links
            now = time.monotonic()
            for link in links:
                try:
                    # Every link is read, not only those that select found ready: this thread
                    # may have waited for the GIL for seconds after its select returned (the
                    # main thread in a long C call), and the beats that came meanwhile, unread
                    # in the socket, are what says that the peer is alive.
                    if not link.read(now) and not link.left:
                        raise _Lost(link.peer, f"{self.describe(link.peer)} closed its "
                                    f"heartbeat link (did it exit or crash?)", silent=False)
                    if not link.left and now - link.heard > self.timeout:
                        raise self._silent(link.peer, now - link.heard)
                except _Lost as lost:
                    self._lost(lost)
                    self._drop(link)
                if link.left:
                    self._drop(link)  # it said goodbye: nothing more to hear on this link

    def _drop(self, link: _Link) -> None:
        with self._lock:
            mine = self._links.get(link.peer) is link
            if mine:
                del self._links[link.peer]
        if mine:  # else stop() took it, and closes it
            link.close()

    def _unlinked(self, peer: int) -> _Lost:
        return _Lost(peer, f"{self.describe(peer)} did not open its heartbeat link within "
                           f"{self.link_up:g}s (stopped, stuck or cut off?)", silent=True)

    def _silent(self, peer: int, silent_for: float) -> _Lost:
        return _Lost(peer, f"{self.describe(peer)} sent no heartbeat for {silent_for:.1f}s "
                           f"(stopped, stuck or cut off?); heartbeat_timeout is "
                           f"{self.timeout:g}s", silent=True)

    def _lost(self, lost: _Lost) -> None:
        """Posts ``lost`` as the World's abort record (and the root World's, for a
        sub-world), unless the peer said goodbye; keeps the error if this post won."""
        if self._stop.is_set():
            return
        peer, message = lost.peer, lost.message
        record = {"kind": lost.kind.__name__, "rank": self.rank, "message": message,
                  "peer": peer, "silent": lost.silent}
        found = PeerLostError(f"rank {self.rank}: {message}", peer=peer, silent=lost.silent) \
            if lost.kind is PeerLostError else lost.kind(f"rank {self.rank}: {message}")
        if lost.silent and peer in self._links:
            # A linked peer that falls silent did not leave (it would have sent BYE): raise it
            # at once, not after the post on a new store connection. A closed link waits for
            # the post: it is often the echo of a failure already in the record (a rank that
            # raised it exits).
            self.lost = found
        # The store may take seconds, or fail and be asked again: the other link beats on.
        with self._pulsing():
            winner = self._post(peer, record)
        if winner is None:
            return  # it left on purpose, or this World closed meanwhile
        if winner == record:
            self.lost = found
            self._posted = record
        log.warning("rank %d: %s", self.rank, message)

    def _post(self, peer: int, record: dict) -> "dict | None":
        """Posts ``record`` unless ``peer`` wrote its goodbye; returns the job's record, or
        None when the peer left on purpose (or this World closed meanwhile).

        A store request that fails says nothing about the peer: asked again, at growing
        intervals, until the store answers or ``link_up`` seconds have passed; then the
        record is returned as if it had won (no store: this rank raises what it found)."""
        deadline = time.monotonic() + self.link_up
        delay, tries = 0.05, 0
        while True:
            tries += 1
            try:
                # A connection of its own: the private one is blocked in the abort watch.
                store = self._main.clone_private()
                if self.lost is None and store.check(f"hb/{peer}/bye"):
                    return None
                winner = store.post_abort(record)
                if self._root is not None:
                    job, ranks = self._root
                    Store.over(store.base, job, store.timeout).post_abort(
                        dict(record, rank=ranks[self.rank], peer=ranks[peer],
                             message=f"in sub-world {self._main.job}: {record['message']}"))
                return winner
            except (RuntimeError, OSError, GradsyncError) as exc:
                if time.monotonic() + delay > deadline:
                    log.warning("rank %d: the store did not answer about rank %d in %d tries "
                                "(%s); reporting it lost", self.rank, peer, tries, exc)
                    return record
                log.debug("rank %d: the store did not answer about rank %d (%s); asking "
                          "again in %.2fs", self.rank, peer, exc, delay)
            if self._stop.wait(delay):
                return None
            delay = min(2 * delay, 1.0)


def _leave(links: "list[_Link]", wait: float, quiet: float) -> None:
    """Says BYE on ``links`` and closes each once its neighbour closed its end (it does when
    it reads the BYE), or after ``wait`` seconds; a neighbour not heard for ``quiet`` seconds
    (stopped, cut off) would not answer, and is not waited for.

    Until then the neighbours' beats are read: a socket closed with bytes unread sends a reset
    instead of a FIN, and a reset drops whatever of this end's bytes the neighbour's kernel
    had not acknowledged yet, which may be the BYE (the store's key is then the evidence)."""
    for link in links:
        link.quiet()  # no beat from the native beater after the BYE, nor on a closed socket
        link.send(BYE)
        try:
            link.sock.shutdown(socket.SHUT_WR)  # the BYE, then a FIN
        except OSError:
            pass  # it broke already: the neighbour reads the store's key
    now = time.monotonic()
    waiting = {link.sock for link in links if now - link.heard <= quiet}
    deadline = now + wait
    while waiting and (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select(list(waiting), [], [], left)
        for sock in ready:
            if not _drained(sock):
                waiting.discard(sock)  # its end closed: nothing more will arrive
    for link in links:
        _drained(link.sock)  # what a neighbour not waited for sent meanwhile
        link.close()


def _drained(sock: socket.socket) -> bool:
    """Reads what ``sock`` holds, without blocking; False once its other end has closed."""
    while True:
        try:
            if not sock.recv(4096):
                return False
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            return False  # reset


def _route_address(store: Store) -> str:
    """This host's address on the route to the store's host (loopback for a local store)."""
    base = store.base
    while not hasattr(base, "host") and hasattr(base, "underlying_store"):
        base = base.underlying_store  # a PrefixStore, as torch hands a backend
    host = getattr(base, "host", None)
    if host is None or host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, getattr(base, "port", 1) or 1))
        return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()
