"""Replicated shards: primary-backup copies, numbered views, fencing, and silence detection.

With ``ps_replicas = R`` (``gradsync run --servers S --ps-replicas R``) the model is cut into
``S / R`` shards and shard ``k`` lives on the R servers ``k, k + S/R, k + 2 S/R, ...`` (spread
that way so that servers placed host after host put the copies of a shard on different hosts).

**Primary-backup.** A shard's *view* is a numbered list of the servers that hold it, its
*members*; the first is the *primary*, the others are *backups*. Workers push to and pull from
the primary only. When the primary applies an update (a ``sync`` round, one ``async``
gradient, ...), it writes the combined gradient it is about to apply into every backup's
``update`` region and calls ``apply`` on each; each backup runs the same optimizer on the same
gradient in the same order, so the copies hold the same bits. The primary answers the workers'
pushes only after every backup of its view has answered: an *acknowledged* update is on every
live member. Why not have the workers write every copy: in ``backup``, ``async`` and ``ssp``
mode the order of updates and the set of gradients in a round are decided by one server; two
copies deciding them apart would hold different parameters. The primary decides, the backups
follow, and the cost is one shard-sized write per update, not per worker.

**Views and epochs.** View ``e`` of shard ``k`` is the store key ``ps/view/<k>/<e>`` (view 0,
all R servers in order, is never written). Whoever finds a member lost (a worker whose primary
vanished, a primary whose backup did) proposes view ``e + 1`` without it; the store's atomic
``add`` on ``ps/claim/<k>/<e>`` lets exactly one proposal win, and every other proposer reads
the winner's. A view never grows back: a server dropped from a view has missed updates.

**Fencing.** Every push carries the worker's view number and every forwarded update the
primary's. A server answers a push of an older view with ``{"stale": e}`` (the worker reads the
newer view and pushes to its primary) and adopts a newer one. A primary that was stopped or
cut off while the others moved on is fenced at the write: a server raises its regions' fence
to each view it enters (``Endpoint.raise_fence``), the primary's write of an update into a
backup's ``update`` region carries its view, and a backup in a newer view refuses it
(``StaleWriteError``) before a byte lands, as it refuses the ``apply`` that follows. A new
primary's settling of its view (``_reconcile``) takes every backup into that view first, so
no copy of a settled view takes anything from an older one. The stale primary stops serving
and ends with an error saying it was excluded. A server that learns (through any message, or
its own look at the store) that it is no longer a member does the same, and so does one that
finds a view that left it out behind a newer one that holds its index again: a view never takes
a member back, so that index is a replacement process that joined since (the launcher starts
one without waiting for a silent server's process to end, ``run/server_watch.py``).

**Silence.** A killed server's connections close and its peers notice at once. A stopped or
cut-off one says nothing, so each server adds 1 to ``ps/beat/<server>`` every
``heartbeat_interval``; a peer waiting on it declares it lost when that counter has not moved
for ``heartbeat_timeout`` seconds (a counter, not a time stamp: the hosts' clocks need not
agree). A server that is merely slow (a long ``sync`` round) keeps beating. The launcher reads
the same views and counters (``run/server_watch.py``): a server fenced out of its shard whose
counter stands still would end only once woken, so it kills it and starts its replacement.

**The end.** A server ends once every worker has disconnected from it, but a replacement that
joined is reached only by the workers that moved to a view holding it (or looked at every
copy), and one still joining by none: such a server learns that the workers are done from the
store (``workers_done``). Each worker adds 1 to ``ps/closed`` when it closes its client; a
worker that dies first never does, so a server that every worker reached, saw them all go and
is still a member of its shard's newest view (no worker dropped it for a newer view) sets
``ps/finished`` as it ends, whatever its status: every worker has ended, whether or not it
closed.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import weakref
from dataclasses import dataclass

from ..errors import GradsyncError, PeerLostError

__all__ = ["View", "Views", "Beats", "Fenced", "shard_of", "members_of", "wait_watched",
           "abandon", "beat_key", "workers_done", "FINISHED"]

log = logging.getLogger("gradsync.ps")

_LOCK = threading.Lock()


class Fenced(GradsyncError):
    """This server is not a member of its shard's newest view: it must not serve."""


FINISHED = "ps/finished"
"""Set by a server that every worker reached and saw go, still a member of its shard's newest
view, as it ends (``serve``): every worker has ended (see "The end" above)."""


def workers_done(store, workers: int) -> bool:
    """Whether the job's ``workers`` are done, for a server that not every worker reaches: each
    closed its client (``ps/closed``), or a server that they all reached saw them all go
    (``FINISHED``: a worker that died never closed its client)."""
    return int(store.add("ps/closed", 0)) >= workers or store.check(FINISHED)


def beat_key(server: int) -> str:
    """The store key of server ``server``'s liveness counter (``Beats``; the launcher reads it
    too, ``run/server_watch.py``)."""
    return f"ps/beat/{server}"


def shard_of(server: int, servers: int, replicas: int) -> int:
    """The shard that server ``server`` of ``servers`` holds."""
    return server % (servers // replicas)


def members_of(shard: int, servers: int, replicas: int) -> list[int]:
    """The servers of shard ``shard`` in view 0 (the first is the primary)."""
    shards = servers // replicas
    return [shard + j * shards for j in range(replicas)]


@dataclass(frozen=True)
class View:
    """One numbered membership of a shard: ``members[0]`` is the primary."""

    shard: int
    epoch: int
    members: tuple[int, ...]
    why: str = "the first view"

    @property
    def primary(self) -> int:
        return self.members[0]

    @property
    def backups(self) -> tuple[int, ...]:
        return self.members[1:]


class Views:
    """A shard's views in the rendezvous store: read the newest, propose the next.

    Args:
        store: the job's ``rendezvous.Store``.
        shard, servers, replicas: which shard, of how many servers and copies.
        timeout: seconds to wait for a winning proposal to be written.
    """

    def __init__(self, store, shard: int, servers: int, replicas: int, timeout: float):
        self.store, self.shard, self.timeout = store, shard, timeout
        self.first = View(shard, 0, tuple(members_of(shard, servers, replicas)))

    def _key(self, epoch: int) -> str:
        return f"ps/view/{self.shard}/{epoch}"

    def _read(self, epoch: int) -> View:
        record = json.loads(self.store.get(self._key(epoch), self.timeout))
        return View(self.shard, epoch, tuple(record["members"]), record["why"])

    def newest(self, known: View | None = None) -> View:
        """The newest view, walking forward from ``known`` (one store look per view)."""
        newer = self.after(known)
        return newer[-1] if newer else (known or self.first)

    def after(self, known: View | None = None) -> list[View]:
        """Every view newer than ``known`` (view 0 if None), oldest first: who joined and who
        left in each (the launcher's watch, ``run/server_watch.py``, needs every step)."""
        view, newer = known or self.first, []
        while self.store.check(self._key(view.epoch + 1)):
            view = self._read(view.epoch + 1)
            newer.append(view)
        return newer

    def held(self, server: int, after: int, upto: int) -> int | None:
        """The first view numbered ``after + 1 .. upto`` that holds ``server``, or None (one
        store read per view: a join request's check, join.py)."""
        for epoch in range(after + 1, upto + 1):
            if server in self._read(epoch).members:
                return epoch
        return None

    def left_out(self, server: int, after: int, upto: int) -> int | None:
        """The first view numbered ``after + 1 .. upto`` that does not hold ``server``, or None
        (one store read per view: a server that skipped views, ``Server._adopt``)."""
        for epoch in range(after + 1, upto + 1):
            if server not in self._read(epoch).members:
                return epoch
        return None

    def propose(self, current: View, lost: int, why: str) -> View:
        """Proposes ``current`` without server ``lost``; returns the view that won (maybe
        another proposer's, maybe already newer). Raises PeerLostError when no member is left.
        """
        members = tuple(m for m in current.members if m != lost)
        if not members:
            raise PeerLostError(f"shard {self.shard} has no live copy left: server {lost} was "
                                f"its last ({why})", peer=lost)
        return self.change(current, members, f"server {lost}: {why}")

    def change(self, current: View, members: tuple[int, ...], why: str) -> View:
        """Proposes view ``current.epoch + 1`` with ``members``; returns the view that won."""
        newest = self.newest(current)
        if newest.epoch > current.epoch:
            return newest  # someone already moved on; the caller looks again
        # Exactly one proposer gets 1 from the counter; only it writes view e + 1.
        if self.store.add(f"ps/claim/{self.shard}/{current.epoch}", 1) == 1:
            self.store.set(self._key(current.epoch + 1),
                           json.dumps({"members": list(members), "why": why}))
            log.warning("shard %d: view %d holds servers %s (%s); primary server %d",
                        self.shard, current.epoch + 1, list(members), why, members[0])
        return self._read(current.epoch + 1)


class Beats:
    """Servers' liveness counters in the store: ``beat`` (a server's thread) and ``silent``
    (a peer's question: has server s not beaten for ``timeout`` seconds?).

    Args:
        store: a store connection of its own (``Store.clone_private``): a beat must never wait
            behind another thread's blocking request.
        timeout: seconds without a beat that make a server silent; 0: never.
    """

    def __init__(self, store, timeout: float):
        self.store, self.timeout = store, timeout
        self._seen: dict[int, tuple[int, float]] = {}
        self._lock = threading.Lock()

    def beat(self, server: int) -> None:
        self.store.add(beat_key(server), 1)

    def silent(self, server: int) -> bool:
        """Whether ``server``'s counter has stood still for ``timeout`` seconds (the first
        look only starts the clock)."""
        if not self.timeout:
            return False
        with self._lock:
            count = self.store.add(beat_key(server), 0)
            now = time.monotonic()
            last = self._seen.get(server)
            if last is None or last[0] != count:
                self._seen[server] = (count, now)
                return False
            return now - last[1] >= self.timeout

    def forget(self, server: int) -> None:
        with self._lock:
            self._seen.pop(server, None)


def wait_watched(handle, beats: Beats, server: int, rank: int, abandon,
                 poll: float = 0.25):
    """``handle.wait()``, but if ``server`` (rank ``rank``) falls silent meanwhile,
    ``abandon()`` (which must make the handle end, e.g. by shutting its socket) and raise
    PeerLostError naming its rank."""
    while not handle.ended(poll):
        if beats.silent(server):
            abandon()
            try:
                handle.wait(beats.timeout or 1.0)
            except Exception:  # the abandoned request's own error: superseded by ours
                pass
            raise PeerLostError(f"parameter server {server} (rank {rank}) has been silent for "
                                f"{beats.timeout:g}s (stopped, hung or cut off)", peer=rank)
    return handle.wait()


_ABANDONED: "weakref.WeakSet" = weakref.WeakSet()


def abandon(peer) -> None:
    """Drops a connection to a server that may be stopped: the shutdown ends a request blocked
    on it at once (``close`` alone would wait for that request). Once per connection."""
    with _LOCK:
        if peer in _ABANDONED:
            return
        _ABANDONED.add(peer)
    try:
        peer.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    threading.Thread(target=peer.close, daemon=True).start()
