"""The data servers a worker takes its batches from: connected, lost, and taken back.

``ServerSet`` is the part of the ``Loader`` (its base, ``loader.py``) that keeps the worker's
links to the job's data servers. The constructor connects to every data server
(``connect/server_links.py``), says hello (the dataset's length, the batch size, the seed,
the order, the prefetch, the collate) and maps each stream's slots, to be polled where the
server is on this host (``slots.py``) and read by takes elsewhere (``roads.py``). While the
connections form, a server gets ``LINK_UP_S`` (30 s) to answer; then the timeout.

A data server that dies, stops or is cut off is *lost* (``_lose``; ``liveness.py`` watches
the live ones, and ``look_at_servers`` looks once without waiting): its connection is shut,
and the epoch's batches of it go to the live servers once theirs are taken (``_adopt``), each
sample still exactly once. In an elastic job the loss is first written to the job's store, so
that a recovery knows this worker may have taken batches out of its plan's order.

In an elastic job the launcher starts a lost data server again, and every worker takes the
new process back at the start of an epoch they agreed on (``returns.py``: ``server_report``
and ``agree_on_servers`` in every ``state_dict()`` collective; ``_choose_servers`` and
``_redial`` as an epoch starts): until then it is left out (in ``lost``) on every worker, a
new worker connected to it included.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from ..errors import GradsyncError, PeerLostError
from ..liveness.heartbeat import LINK_UP_S
from .epoch import Epoch
from .layout import Layout
from .plan import Batch
from .returns import Return, agree, read_ready, ready_key, wanted
from .slots import poller

__all__ = ["ServerSet"]

_ADOPT_PIECE = 256  # batches handed to a data server per control message

log = logging.getLogger("gradsync.data")


class ServerSet:
    """The worker's data servers (a base of ``Loader``): the links to them, which are lost,
    which came back, and the requests that every live one answers (``stats``)."""

    # Set by ``Loader.__init__``, which says what each holds: its options, the job's shape,
    # and the state of the links.
    rank: int
    servers: int
    elastic: bool
    samples: int
    batch_size: int
    seed: int
    order: str
    prefetch: int
    collate: Any
    lost: set[int]
    returns: dict[int, Return]
    _pending: set[int]
    _seq: list[int]
    _lost_lock: threading.Lock
    _silence: float | None
    _connect_timeout: float
    _watch: Any
    _closed: bool
    _active: Epoch | None

    _losses = None  # the store this worker's losses are written to: an elastic job's only

    # ------------------------------------------------------------------ connecting
    def _connect(self, env, config) -> None:
        from ..connect.server_links import connect_servers, open_store, unique_id

        store = open_store(config, env)
        # The id the data servers know this worker by: its rank, or in an elastic job (where
        # ranks change and new workers come) a number no other worker of the job has had.
        self.ident = unique_id(store, "data") if self.elastic else env.rank
        # In an elastic job, where each loss is written (``_lose``): over a connection of
        # its own, so that a loss found by any thread never waits behind another's request.
        self._losses = store.clone_private() if self.elastic else None
        # A data server lost while this worker connects is lost as one lost in the training
        # loop (``_lose``): the others serve its batches from the first epoch on. One that
        # cannot be reached at all has no connection here (None in ``peers``).
        # While the connections form, a server gets ``LINK_UP_S`` (30 s) to answer
        # (``_forming``); then the timeout.
        self.endpoint, self.peers = connect_servers(config, env, store, "data", env.size,
                                                    self.servers, "data server", self.ident,
                                                    lost=self._lose, silence=self._forming)
        # Per server: its slots, and the poll road (same host) or None (take over the region
        # connection). A lost server keeps None in both: no batch is asked of it again.
        # ``incarnations``: which process of that index the connection reaches (0: none).
        self.slots: list = [None] * self.servers
        self.pollers: list = [None] * self.servers
        self.incarnations: list[int] = [0] * self.servers
        try:
            replies = self._greet(range(self.servers))
            if not replies or len(self.lost) == self.servers:
                raise self._none_left()
        except BaseException:
            self.close()
            raise
        first = replies[min(replies)]  # every server describes the same dataset
        # The stack's layout, or the collate's spec (``collate.py``).
        self.spec = first["layout"]
        self.layout = Layout(self.spec) if self.collate is None else None
        self.slot_bytes = first["slot_bytes"]

    @property
    def _forming(self) -> float | None:
        """The silence allowed while a connection forms (the dial, the hello, the read of
        the slots): ``LINK_UP_S`` (30 s), as a heartbeat link gets to form, since the ranks
        of a job start seconds apart on a crowded machine and a server still starting is
        not a silent one. Then the timeout (``_silence``)."""
        return None if self._silence is None else max(self._silence, LINK_UP_S)

    def _greet(self, servers) -> dict[int, dict]:
        """Says hello to each of ``servers`` reached and maps its slots; a server lost
        meanwhile is set aside, as in the training loop. Returns the hellos' replies."""
        hello = {"batch_size": self.batch_size, "seed": self.seed, "samples": self.samples,
                 "order": self.order, "prefetch": self.prefetch,
                 "collate": None if self.collate is None else self.collate.describe()}
        calls = {d: self.peers[d].call_async("hello", **hello) for d in servers
                 if d not in self.lost}
        replies = {}
        for d, handle in calls.items():
            try:
                replies[d] = handle.wait()
            except PeerLostError as exc:
                self._lose(d, exc)
        for d in list(replies):
            peer = self.peers[d]
            try:
                # Reads the server's region table again (the hello allocated the slots).
                self.slots[d] = peer.region(f"slots.{self.ident}")
                self.pollers[d] = poller(peer, self.ident, self.prefetch, self.batch_size,
                                         replies[d]["slot_bytes"])
            except PeerLostError as exc:
                self._lose(d, exc)
                del replies[d]
                continue
            self.incarnations[d] = int(replies[d].get("incarnation", 1))
            peer.set_silence(self._silence)
        return replies

    def _none_left(self) -> GradsyncError:
        """The error of a worker that has lost every data server."""
        message = (f"worker {self.rank} lost every data server ({self.servers}); no one is "
                   "left to serve the data")
        if self.elastic:
            # Not a lost worker: re-forming the job would not bring data back.
            return GradsyncError(message)
        return PeerLostError(message, peer=None)

    # ------------------------------------------------------------------ servers back
    def _choose_servers(self, epoch: int) -> None:
        """(``__iter__``, an elastic job's.) Uses in ``epoch`` exactly the data servers
        every worker uses in it: of each, the incarnation that the agreed table wants
        (``returns.wanted``), connected to now when this worker has an older one (a server
        that came back); every other server is left out for the epoch, its batches handed
        to the others (``_adopt``), as on every other worker."""
        for d in range(self.servers):
            want = wanted(self.returns, d, epoch)
            if want is not None and self.incarnations[d] < want:
                self._redial(d, self.returns[d])
            with self._lost_lock:
                given_up = d in self.lost and d not in self._pending
                if want is not None and self.incarnations[d] == want and not given_up:
                    self.lost.discard(d)
                    self._pending.discard(d)
                elif d not in self.lost:  # alive, but not the process the epoch uses
                    self.lost.add(d)
                    self._pending.add(d)

    def _redial(self, server: int, back: Return) -> None:
        """Connects to data server ``server`` again, to the process its address names now,
        which the table wants (``back``) from this epoch on: this worker gave its last
        process up, or that process has exited since. A worker that cannot reach ``back``
        writes its loss in the store, as any worker that gives up a server (``_lose``):
        every worker of the epoch is meant to use it, so a recovery must know that this
        one did not."""
        store = self._losses
        assert store is not None  # ``_choose_servers`` runs in an elastic job only
        with self._lost_lock:
            # From here on, a failure of the old connection is no news (``_lose`` ignores a
            # server in ``lost``).
            self.lost.add(server)
            self._pending.discard(server)
        old = self.peers[server]
        if old is not None:  # an older process, which has exited: the launcher started
            old.abandon()    # ``back`` only then (shut first: nothing waits on it)
            old.close()
        label = f"data server {server} (incarnation {back.incarnation})"
        try:
            info = json.loads(store.get(f"data/server/{server}", self._connect_timeout))
            peer = self.endpoint.connect(int(info["ident"]), info["addr"], int(info["port"]),
                                         time.monotonic() + self._connect_timeout, label,
                                         listening=True, silence=self._forming)
        except (RuntimeError, OSError) as exc:  # PeerLostError, a timeout, the store's
            # Not reached: the process of ``back`` is given up for good (this worker will
            # not dial it again: its incarnation counts as the one it has, lost).
            self._record_loss(server, _process_key(server, back.host, back.pid))
            self.incarnations[server] = back.incarnation
            log.warning("worker %d could not reach %s again: %s", self.rank, label, exc)
            return
        # The new connection replaces the old one before ``server`` leaves ``lost``: the
        # liveness watch, which looks at the servers not lost, must not judge the new
        # process by the old one's beat (nor give it up for a ping of the old one).
        self.peers[server], self.pollers[server], self.slots[server] = peer, None, None
        self.incarnations[server], self._seq[server] = 0, 0
        if self._watch is not None:
            self._watch.forget(server)
        with self._lost_lock:
            self.lost.discard(server)
            self._pending.discard(server)
        if self._greet([server]) and self.incarnations[server] == back.incarnation:
            log.info("worker %d takes data server %d back (incarnation %d, pid %d on %s) "
                     "from epoch %d", self.rank, server, back.incarnation, back.pid,
                     back.host, back.epoch)
            return
        # Lost in its hello (``_greet`` wrote so), or the address names a newer process:
        # the one wanted has exited too.
        if server not in self.lost:
            self._record_loss(server, _process_key(server, back.host, back.pid))
            with self._lost_lock:
                self.lost.add(server)
                self._pending.add(server)

    def server_report(self) -> dict:
        """What this worker adds to a collective that agrees on the data servers
        (``returns.agree``): the table it holds, and each server it does not use whose ready
        record names a newer process that nobody has given up (no store request when every
        server is in use, or in a job that is not elastic)."""
        ready = {}
        store = self._losses
        for d in sorted(self.lost) if store is not None else ():
            found = self._ready(store, d)
            if found is not None:
                ready[d] = found
        return {"returns": dict(self.returns), "ready": ready}

    def _ready(self, store, server: int) -> tuple[int, str, int] | None:
        """(incarnation, host, pid) of the latest process of data server ``server`` in
        ``store`` if it is newer than the table's and not recorded lost; else None."""
        known = self.returns.get(server)
        try:
            if not store.check(ready_key(server)):
                return None
            incarnation, host, pid = read_ready(store.get(ready_key(server)))
            if incarnation <= (1 if known is None else known.incarnation):
                return None
            if store.check(_process_key(server, host, pid)):
                return None
        except (RuntimeError, OSError, GradsyncError) as exc:  # the launcher's store
            log.warning("worker %d could not read data server %d's ready record: %s",
                        self.rank, server, exc)
            return None
        return incarnation, host, pid

    def agree_on_servers(self, reports: list[dict], epoch: int) -> None:
        """Takes the table every member of a collective computes from the same ``reports``
        (``returns.agree``): a data server that came back serves every worker from
        ``epoch`` on, the first epoch no member can have started."""
        table = agree(reports, epoch)
        for d, back in sorted(table.items()):
            if self.returns.get(d) != back:
                log.info("worker %d: data server %d (incarnation %d) serves every worker "
                         "from epoch %d", self.rank, d, back.incarnation, back.epoch)
        self.returns = table

    # ------------------------------------------------------------------ servers lost
    def _lose(self, server: int, error: BaseException) -> None:
        """(The fetch thread, ``__iter__``, the connection, ``stats`` or the liveness watch.)
        Data server ``server`` is gone, or silent: its batches go elsewhere.

        In an elastic job the loss is first written to the job's store (``_loss_key``), and
        only then can this worker take a batch out of its plan's order: a recovery that
        finds a lost worker's record (``look_at_servers``) knows that it may have, even when
        the server is only stopped or cut off, which no survivor can see for itself."""
        with self._lost_lock:
            if server in self.lost:
                return
        self._record_loss(server)
        with self._lost_lock:
            if server in self.lost:
                return
            self.lost.add(server)
        log.warning("worker %d lost data server %d (%s); the servers left (%s) serve its "
                    "batches", self.rank, server, error,
                    [d for d in range(self.servers) if d not in self.lost])
        peers = getattr(self, "peers", None)  # None while the connections are made
        if peers is not None and peers[server] is not None:
            # Shut, so that a request waiting on it ends now and a server that wakes (a
            # stopped one continued) finds this worker gone; ``close`` frees the rest.
            peers[server].abandon()

    def look_at_servers(self) -> None:
        """Looks once, without waiting, at every data server this worker has not lost: one
        whose process has exited (a same-host server) or whose end of the connection is
        closed (any: the kernel closes a killed process's sockets) is lost now, as if this
        worker had asked it for a batch; so is one that another worker of an elastic job
        has given up (its record in the store: ``_lose``), dead, stopped or cut off. An
        elastic recovery looks before it trusts the plan's order
        (``elastic.LoaderState.resumable``): a server killed while this worker still read
        the batches it had published is otherwise found only at its next wait, and one that
        only the lost worker found silent, never."""
        from .slots import check_open

        for d, peer in enumerate(getattr(self, "peers", [])):
            if peer is None or d in self.lost:
                continue
            try:
                road = self.pollers[d]
                if road is not None:
                    road.check_alive()
                else:
                    check_open(peer.sock, peer.label, peer.ident)
                if self._losses is not None and any(
                        self._losses.check(key) for key in (_loss_key(d, peer),
                                                            _loss_key(d, None))):
                    raise PeerLostError(f"another worker of the job gave up data server {d}",
                                        peer=None)
            except PeerLostError as exc:
                self._lose(d, exc)

    def _record_loss(self, server: int, key: str | None = None) -> None:
        """Writes that this worker gave up data server ``server`` (an elastic job's only):
        the process it is connected to, or the one ``key`` names."""
        if self._losses is None:
            return
        peers = getattr(self, "peers", None)  # None while the connections are made
        try:
            self._losses.set(key or _loss_key(server, peers[server] if peers else None),
                             str(self.ident))
        except (RuntimeError, OSError, GradsyncError) as exc:  # the launcher's store: it
            # is gone only with the job, whose end this worker then meets anyway
            log.warning("worker %d could not record the loss of data server %d: %s",
                        self.rank, server, exc)

    def _adopt(self, epoch: int, orphans: list[Batch]) -> list[tuple[Batch, int]]:
        """(The fetch thread.) Hands ``orphans``, batches of lost data servers, to the live
        ones, dealt by batch index; returns them as (batch, server) in the order to take:
        the order in which they joined each server's stream."""
        handed: list[tuple[Batch, int]] = []
        remaining = sorted(orphans, key=lambda b: b.index)
        while remaining:
            live = [d for d in range(self.servers) if d not in self.lost]
            if not live:
                raise self._none_left()
            first = len(handed)
            chosen: dict[int, list[Batch]] = {}
            for b in remaining:
                chosen.setdefault(live[b.index % len(live)], []).append(b)
            remaining = []
            for d, mine in chosen.items():
                items = [[b.index, b.ids.tolist()] for b in mine]
                try:
                    # In pieces, so that a control message stays far below its 1 MiB limit.
                    for a in range(0, len(items), _ADOPT_PIECE):
                        self.peers[d].call("start", epoch=epoch, items=items[a:a + _ADOPT_PIECE])
                except PeerLostError as exc:
                    self._lose(d, exc)
                    remaining.extend(mine)  # the next round deals them to the servers left
                    continue
                handed.extend((b, d) for b in mine)
            handed[first:] = sorted(handed[first:], key=lambda bd: bd[0].index)
            remaining.sort(key=lambda b: b.index)
        # Round by round, each in index order: a server that got batches in two rounds holds
        # the first round's first, and the worker takes them in that order.
        return handed

    # ------------------------------------------------------------------ the servers
    def stats(self) -> list[dict]:
        """Each live data server's counters: ``server`` (its index), batches prepared, cache
        hits, misses, samples, bytes. A server found lost by this call is left out (and its
        batches go to the others from then on)."""
        calls = {d: p.call_async("stats") for d, p in enumerate(self.peers)
                 if d not in self.lost}
        counters = []
        for d, handle in calls.items():
            try:
                counters.append(handle.wait())
            except PeerLostError as exc:
                self._lose(d, exc)
        return counters

    def close(self) -> None:
        """Disconnects from the data servers (they end when every worker has; in an elastic
        job, when the launcher says the job is over)."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.stop()  # before the connections close: a closed one is no loss
        if self._active is not None:
            self._active.stop()
        for peer in getattr(self, "peers", []):
            if peer is not None:  # None: a data server lost before it was reached
                peer.close()
        if hasattr(self, "endpoint"):
            self.endpoint.close()


def _loss_key(server: int, peer) -> str:
    """The store key of a loss of data server ``server``: of the process this worker is
    connected to (``peer``: its host and pid), so that a data server started again in its
    place (``run/data_servers.py``) is not taken for the lost one; with no connection (lost
    before it was reached) of every process of that index."""
    if peer is None or not peer.pid:
        return f"data/lost/{server}/any"
    return _process_key(server, peer.host, peer.pid)


def _process_key(server: int, host: str, pid: int) -> str:
    """The store key of a loss of the process ``pid`` on ``host`` serving as ``server``."""
    return f"data/lost/{server}/{host}/{pid}"
