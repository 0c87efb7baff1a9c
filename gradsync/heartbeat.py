"""Heartbeats: a rank that is alive but silent is a lost rank.

A peer that dies closes its sockets, and a same-host peer's pid vanishes, so the waits notice
at once. A peer that is *stopped* (SIGSTOP, a debugger, a kernel stuck in uninterruptible
I/O) or cut off by a partitioned network shows none of that: its sockets stay open and its
pid exists, and without heartbeats the others would wait for the collective timeout (300 s).

The scheme, per World (so each generation of an elastic job has its own):

- **Beat.** A daemon thread of every rank adds 1 to its counter ``hb/<rank>`` in the
  rendezvous store every ``heartbeat_interval`` seconds, on a store connection of its own (a
  wait on the main connection must never delay a beat). The thread runs while the process
  runs Python or waits in C code that releases the GIL, so a busy rank keeps beating; a
  stopped process stops every thread, the beater included.
- **Watch.** The same thread reads the counters of a few *watched* peers: the ranks 1 and 2
  places before and after it on the ring of ranks (at most four, whatever the job's size, so
  the store serves O(size) reads per interval, not O(size²)). Every rank is watched by up to
  four others. A peer whose counter has not moved for ``heartbeat_timeout`` seconds of this
  watcher's own time is lost, unless it said goodbye (``hb/<rank>/bye``, written by a clean
  ``World.close``).
- **Report.** The watcher posts the job's abort record (a ``PeerLostError`` naming the silent
  rank, ``silent: true``) and keeps the error for its own World; every rank that waits polls
  the record (``World.on_idle``) and raises it. ``gradsync run`` in elastic mode reads
  ``silent`` and kills that rank, which cannot clean up after itself.

Worked example, interval 1 s, timeout 10 s: rank 2 of 4 is stopped at t = 0.3 s; its last
beat was at t = 0. Ranks 0, 1 and 3 watch it (1 and 3 as neighbours, 0 as rank 2's
"two after"). A watcher's clock for it starts when it first reads that last value: at the
latest t = 1 (its reads are an interval apart). The first check more than 10 s later (at the
latest t = 12, one interval after t = 11) declares it lost: detection within
``timeout + 2 * interval`` of the last beat, and no earlier than ``timeout`` after it.

A watcher that was itself stalled (it was the stopped one, or the machine was starved) must
not blame its peers for its own gap: when its own loop ran late by more than half the
timeout, it restarts every peer's clock instead of judging.
"""

from __future__ import annotations

import logging
import threading
import time

from .errors import PeerLostError
from .rendezvous import Store

__all__ = ["Heartbeat", "watched_peers"]

log = logging.getLogger("gradsync")


def watched_peers(rank: int, size: int) -> list[int]:
    """The ranks ``rank`` watches: 1 and 2 places before and after it on the ring of ranks.

    >>> watched_peers(0, 4), watched_peers(1, 2), watched_peers(0, 1)
    ([3, 1, 2], [0], [])
    """
    peers: list[int] = []
    for offset in (-1, 1, -2, 2):
        peer = (rank + offset) % size
        if peer != rank and peer not in peers:
            peers.append(peer)
    return peers


class Heartbeat:
    """The beating and watching thread of one World.

    Args:
        store: the World's job-scoped ``rendezvous.Store``; the thread uses its own clone of
            the underlying connection.
        rank, size: this rank and the World's size.
        interval: seconds between beats (and between looks at the watched peers).
        timeout: seconds without a beat after which a watched peer is lost.
        describe: ``describe(rank)`` names a peer in messages (host, pid).
        root: for a sub-world, the job id of the World at the root of its tree and the root
            rank of each rank here (``World.root``). A silent peer is then also reported in
            the root World's abort record, in root ranks. The launcher watches only that
            record: an elastic job whose silent worker is noticed first by a sub-world's
            heartbeat (the Horovod API's global process set runs on one) must still
            kill that worker and form the next generation, not wait for it for ever.
    """

    def __init__(self, store, rank: int, size: int, interval: float, timeout: float,
                 describe=lambda rank: f"rank {rank}",
                 root: "tuple[str, list[int]] | None" = None):
        self.rank, self.size = rank, size
        self.interval, self.timeout = interval, timeout
        self.describe = describe
        self.lost: PeerLostError | None = None
        self._store = store.clone_private()
        self._root = None
        if root is not None and root[0] != store.job:
            self._root = (Store.over(self._store.base, root[0], self._store.timeout),
                          root[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"gradsync-heartbeat-{rank}")

    def start(self) -> "Heartbeat":
        self._beat()
        self._thread.start()
        return self

    def check(self) -> None:
        """Raises the PeerLostError of a silent peer once one was found (called by waits)."""
        if self.lost is not None:
            raise self.lost

    def stop(self, goodbye: bool = True) -> None:
        """Stops the thread; ``goodbye`` tells the watchers that this rank left on purpose."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval + 1.0)
        if goodbye:
            try:
                self._store.set(f"hb/{self.rank}/bye", "1")
            except (RuntimeError, OSError):
                pass  # the store is gone: nobody is left to watch us

    # ------------------------------------------------------------------ the thread
    def _beat(self) -> int:
        return self._store.add(f"hb/{self.rank}", 1)

    def _loop(self) -> None:
        watched = watched_peers(self.rank, self.size)
        last_seen = {peer: -1 for peer in watched}
        since = {peer: time.monotonic() for peer in watched}
        previous = time.monotonic()
        try:
            while not self._stop.wait(self.interval):
                now = time.monotonic()
                if now - previous > self.timeout / 2:
                    # This process was stalled itself: its peers' silence is not evidence.
                    since = {peer: now for peer in watched}
                previous = now
                self._beat()
                for peer in list(watched):
                    count = self._store.add(f"hb/{peer}", 0)
                    if count != last_seen[peer]:
                        last_seen[peer], since[peer] = count, now
                    elif now - since[peer] > self.timeout:
                        if self._store.check(f"hb/{peer}/bye"):
                            watched.remove(peer)  # it left on purpose
                            continue
                        self._report(peer, now - since[peer])
                        return
        except (RuntimeError, OSError) as exc:
            # The store is gone: the waits report that themselves (World.on_idle).
            log.debug("rank %d: heartbeat thread ends: %s", self.rank, exc)

    def _report(self, peer: int, silent_for: float) -> None:
        message = (f"{self.describe(peer)} sent no heartbeat for {silent_for:.1f}s (stopped, "
                   f"stuck or cut off?); heartbeat_timeout is {self.timeout:g}s")
        self.lost = PeerLostError(f"rank {self.rank}: {message}", peer=peer)
        record = {"kind": "PeerLostError", "rank": self.rank, "message": message,
                  "peer": peer, "silent": True}
        try:
            self._store.post_abort(record)
            if self._root is not None:
                store, ranks = self._root
                store.post_abort(dict(record, rank=ranks[self.rank], peer=ranks[peer],
                                      message=f"in sub-world {self._store.job}: {message}"))
        except (RuntimeError, OSError):
            pass
        log.warning("rank %d: %s", self.rank, message)
