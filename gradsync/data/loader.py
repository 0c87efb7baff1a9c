"""The worker's side of the data servers: an iterable used as a ``DataLoader`` is.

Every rank of the job runs the same script and builds the same ``Loader``. On a data-server
rank the constructor serves (``server.py``) and ends the process; on a worker it connects to
every data server and returns. Each ``iter(loader)`` is one epoch: the worker computes the
epoch's plan (``plan.py``), tells each server to queue its share, and takes the batches in plan
order, each into a fresh buffer that the yielded tensors view (or, with ``copy=False``, lending
the loop the server's slot itself). From a server on this host a batch comes without a
message, in the loop's own ``next()``: it polls the stream's slot table in shared memory and
acks with a one-sided write (``slots.py``), the servers having prepared ``prefetch`` batches
ahead. From a server on another host the batches come by ``take`` calls, whose replies carry
the batches' bytes: ``data_takes`` of them (by default one) in flight per server on the one
connection (more are pipelined, answered in order), together asking for up to
``data_window`` batches, each take bringing the one it asks for and those after it that the
server has ready (a take sent while the worker holds batches waits there until all but one
of them are); the next take is sent as soon as a reply is in, so its round trip runs while
the batches in hand are used (``_Epoch._call``). Small batches are taken so by the loop's
own ``next()``; larger ones (a window of more than ``INLINE_REPLY_BYTES``) by a fetch thread
up to ``prefetch`` ahead of the loop, whose receipt of the bytes overlaps the training step.
An ``iter()`` while an epoch is unfinished (a loop left with ``break``) goes on with that
epoch where it stopped.

Exactly once. Within an epoch every sample is in exactly one batch and every batch goes to
exactly one worker (``plan.py``). A batch counts as *delivered* (acknowledged) once the
training loop has finished with it: when it asks for the next batch, when the epoch's loop
ends, or when ``state_dict()`` is called while it holds the batch (a checkpoint taken after
a step covers that step's batch). ``state_dict()`` gathers every worker's delivered samples
(it is a collective: every worker calls it at the same step) and ``load_state_dict()`` on a
new job makes that epoch serve only the samples not yet delivered, in the same order, at any
number of workers and data servers. ``reset()`` does the same within a job whose workers
re-formed (elastic mode): each data server cuts the worker's stream where it stands and plans
the rest of the epoch for the new generation (``server.py``). In ``hvd.elastic``'s loop the
Loader is part of the elastic state (``TorchState(model, optimizer, loader=loader)``), which
calls ``state_dict()`` at each commit and ``reset()`` at each re-formation (``elastic.py``).

A data server that dies, stops or is cut off is *lost* (``liveness.py`` watches the live
ones): its batches go to the others, each sample still exactly once (``_lose``, ``_adopt``).
In an elastic job the launcher starts it again, and every worker takes the new process back
at the start of an epoch they agreed on (``returns.py``, ``_choose_servers``): until then it is
left out (in ``lost``) on every worker, a new worker connected to it included.
"""

from __future__ import annotations

import atexit
import collections
import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ConfigError, GradsyncError, GradsyncTimeoutError, PeerLostError
from ..liveness.heartbeat import LINK_UP_S
from ..liveness.pace import meter
from .layout import Layout
from .plan import ORDERS, STATE_VERSION, Batch, pack_mask, plan, unpack_mask, worker_batches
from .returns import Return, agree, read_ready, ready_key, wanted
from .slots import poller

if TYPE_CHECKING:
    from ..transport.region_peer import Posted

__all__ = ["Loader", "STATE_VERSION"]

_END = object()  # the fetch thread's last item of an epoch
_ADOPT_PIECE = 256  # batches handed to a data server per control message
_TRANSFERS_KEPT = 4096  # batches whose fetch times ``transfers()`` keeps
# A take's reply of at most this many bytes (a window of batches) is taken by the training
# loop itself, without a fetch thread (``_Epoch``): it fits in the socket's receive buffer as
# the kernel grants it from the start (Linux's tcp_rmem default, 128 KiB, of which half
# holds data), so it arrives there while the loop trains, and the loop's receive is a copy.
INLINE_REPLY_BYTES = 64 << 10

log = logging.getLogger("gradsync.data")


class Loader:
    """Batches of ``dataset`` served by the job's data servers (see ``gradsync.data``).

    Args:
        dataset: a map-style dataset (``len()`` and ``dataset[i]``); only the data servers
            index it, the workers only take its length.
        batch_size: samples per batch; each data server's last batch of an epoch may be short.
        transform: ``transform(sample, rng) -> sample``, run on the data servers after the
            cache, with a ``numpy.random.Generator`` seeded by (seed, epoch, sample id); or
            ``transform(sample)``, for one that draws nothing (it skips the generator,
            most of a cheap sample's cost).
        seed: fixes each epoch's order and the transform's randomness.
        prefetch: batches in flight per data server and in this worker's queue (default: the
            ``data_prefetch`` setting).
        order: how an epoch's batches are cut (``plan.ORDERS``): ``"servers"`` (each data
            server cuts its own share of the samples, which it prepares, and caches, every
            epoch) or ``"global"`` (batch ``g`` is samples ``[g * batch_size, (g + 1) *
            batch_size)`` of the epoch's permutation: the same batches at any number of
            workers and data servers).
        collate: makes batches of samples whose shapes vary, on the data servers
            (``collate.Pad``, ``collate.Pack`` or a ``collate.Collate`` of your own); None:
            every sample has the first one's shapes and a batch is their stack.
        copy: True (the default): each batch's tensors view a fresh buffer of their own,
            kept as long as the loop likes. False: from data servers on this host they view
            the stream's slot itself, with no copy on the worker, and are valid only until
            the loop takes the next batch (which frees the slot for the server): ``.clone()``
            what must outlive the step. (From another host a batch is read into a fresh
            buffer either way.)

    Raises:
        ConfigError: the job has no data servers (``gradsync run --data-servers D``).
    """

    _losses = None  # the store this worker's losses are written to: an elastic job's only
    inline_reply_bytes = INLINE_REPLY_BYTES  # (a test sets 0: the fetch thread, any batch)

    def __init__(self, dataset, batch_size: int, transform=None, seed: int = 0,
                 prefetch: int | None = None, order: str = "servers", collate=None,
                 copy: bool = True):
        from .. import api, job
        from ..cluster.launch_env import detect
        from ..config import load_config

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        env = detect(data_server=True)
        if env.is_data_server:
            from .cache import Cache
            from .server import Source, serve

            config = load_config()
            source = Source(dataset, transform, seed, Cache(config.data_cache_bytes), collate)
            raise SystemExit(serve(config, env, source, batch_size, seed, order))
        if env.data_servers == 0:
            raise ConfigError("this job has no data servers: start it with 'gradsync run -np W "
                              "--data-servers D ...' or export GRADSYNC_DATA_SERVERS=D on every "
                              "rank (the last D ranks serve data)")
        api.init()
        world = job.world()
        config = world.config
        self.samples, self.batch_size, self.seed = len(dataset), batch_size, seed
        self.order, self.collate = order, collate
        self.copy = bool(copy)
        self.prefetch = config.data_prefetch if prefetch is None else int(prefetch)
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {self.prefetch}")
        # Batches in flight per data server on another host (``_Epoch._call``): a server
        # never has more than ``prefetch`` of a stream prepared ahead, so no more can come.
        self.window = max(1, min(config.data_window, self.prefetch))
        # Takes in flight per data server on another host, sharing the window (``_post``).
        self.takes = max(1, min(config.data_takes, self.window))
        self.rank, self.workers, self.servers = env.rank, env.workers, env.data_servers
        self.elastic = env.elastic_id is not None
        self.generation = 0  # of the job's membership: ``reset``
        if self.elastic:
            # An elastic worker's place is its generation's (``init()`` joined one); the
            # launch variables only say how the process was started. Its generation is the
            # job's, so that a new worker and the survivors name the same one.
            from ..elastic import worker

            self.rank, self.workers = world.rank, world.size
            self.generation = worker.generation()
        self.epoch = 0
        self._resume: dict[int, np.ndarray] = {}
        self._active: _Epoch | None = None
        self._finished: tuple[int, list[np.ndarray]] | None = None  # last epoch: (e, ids)
        self._seq = [0] * self.servers  # next sequence number of this worker's stream
        self.lost: set[int] = set()  # data servers this worker does not use now
        # Of ``lost``, the servers left out for the epoch though this worker's connection
        # lives: a process the agreed table does not want yet (``returns.py``).
        self._pending: set[int] = set()
        # The agreed returns of data servers started again (``returns.py``): from which
        # epoch each serves every worker, updated at each commit and re-formation.
        self.returns: dict[int, Return] = {}
        # (poll or take seconds, of which waited, read seconds, bytes) of the latest batches
        self._transfers: collections.deque = collections.deque(maxlen=_TRANSFERS_KEPT)
        self._closed = False
        self._timeout = config.timeout
        self._connect_timeout = config.connect_timeout
        self._lost_lock = threading.Lock()
        # A reply silent this long is a stopped or cut-off server (``liveness.py``); a take
        # waits at most a quarter of it on the server, then answers "pending".
        self._silence = config.heartbeat_timeout if config.heartbeat_timeout > 0 else None
        self._take_wait = None if self._silence is None else self._silence / 4
        self._watch = None
        self._connect(env, config)
        if self._silence is not None:
            from .liveness import Watch

            self._watch = Watch(self, config.heartbeat_interval, self._silence).start()
        atexit.register(self.close)

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

    @property
    def ids(self) -> np.ndarray | None:
        """The sample ids of the batch the current epoch's loop last received (None outside
        an epoch), in the batch's order."""
        return self._active.ids if self._active is not None else None

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Makes the next ``iter()`` serve ``epoch`` (else epochs follow one another from 0)."""
        if self._active is not None:
            raise RuntimeError(f"set_epoch({epoch}) while epoch {self._active.epoch} is being "
                               "iterated; finish it first")
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Batches this worker gets in the next (or current) epoch."""
        return self.lengths()[self.rank]

    def lengths(self) -> list[int]:
        """Batches each worker gets in the next (or current) epoch, by worker (computed from
        the plan: no message)."""
        if self._active is not None:
            epoch, done = self._active.epoch, self._active.done
        else:
            epoch, done = self.epoch, self._resume.get(self.epoch)
        batches = plan(self.samples, self.batch_size, self.seed, epoch, self.servers,
                       self.workers, done, self.order)
        return [len(batches[w::self.workers]) for w in range(self.workers)]

    def _my_batches(self, epoch: int, done: np.ndarray | None) -> list[Batch]:
        return worker_batches(plan(self.samples, self.batch_size, self.seed, epoch,
                                   self.servers, self.workers, done, self.order), self.rank)

    def __iter__(self):
        if self._closed:
            raise RuntimeError("the Loader is closed")
        if self._active is not None:
            # A loop left early (break) goes on where it stopped: the epoch's batches are
            # queued on the data servers once, and starting another would skip the rest.
            return self._active
        epoch = self.epoch
        done = self._resume.get(epoch)
        batches = self._my_batches(epoch, done)
        text = pack_mask(done) if done is not None else None
        if self._losses is not None:  # an elastic job, whose data servers may come back
            self._choose_servers(epoch)
        live = [d for d in range(self.servers) if d not in self.lost]
        # ``seq``: where this worker's stream goes on, for a server that learns of a new
        # generation from this start (``reset``).
        start = {"epoch": epoch, "done": text, "generation": self.generation,
                 "workers": self.workers, "index": self.rank, "wait": self._take_wait}
        started = {d: self.peers[d].call_async("start", seq=self._seq[d], **start)
                   for d in live}
        deadline = time.monotonic() + self._timeout
        for d, handle in started.items():
            try:
                # "pending": a server still writing a batch of the old generation's plan
                # into this stream changed nothing and is asked again (``take``'s rule).
                while handle.wait().get("pending"):
                    if time.monotonic() > deadline:
                        raise GradsyncTimeoutError(f"data server {d} did not start epoch "
                                                   f"{epoch} within {self._timeout:.0f}s")
                    handle = self.peers[d].call_async("start", seq=self._seq[d], **start)
            except PeerLostError as exc:  # its batches are handed to the others
                self._lose(d, exc)
        self._resume.pop(epoch, None)
        work = [(b, b.server) for b in batches if b.server not in self.lost]
        orphans = [b for b in batches if b.server in self.lost]
        self._active = _Epoch(self, epoch, work, orphans, done)
        return self._active

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

    def _ended(self, run: "_Epoch") -> None:
        """(The epoch's iterator.) Every batch of ``run`` has been delivered."""
        self._finished = (run.epoch, run.delivered)
        self._active = None
        self.epoch = run.epoch + 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Where the job's data stands: the epoch and the samples delivered in it, gathered
        from every worker. A collective: every worker calls it at the same step; the batch
        each holds counts as delivered. The result is the same dict on every worker and
        holds only plain types (``json.dumps`` and ``torch.save`` take it)."""
        from .. import api

        mine = {"epoch": self.epoch if self._active is None else self._active.epoch,
                "ids": [], "previous": None}
        if self._active is not None:
            self._active.acknowledge()
            mine["ids"] = _ids(self._active.delivered)
        elif self.epoch in self._resume:  # loaded but not started: carry the loaded state
            mine["ids"] = np.flatnonzero(self._resume[self.epoch]).tolist()
        if self._finished is not None:
            mine["previous"] = [self._finished[0], _ids(self._finished[1])]
        # The same gather agrees on the data servers that came back (``returns.py``).
        mine["servers"] = self.server_report()
        views = api.allgather_object(mine, name="gradsync.data.state_dict")
        epoch = min(v["epoch"] for v in views)
        done = np.zeros(self.samples, dtype=bool)
        for v in views:
            if v["epoch"] == epoch:
                done[v["ids"]] = True
            elif v["previous"] is not None and v["previous"][0] == epoch:
                done[v["previous"][1]] = True  # this worker already finished the epoch
            else:
                raise ValueError(f"state_dict: worker {views.index(v)} is in epoch "
                                 f"{v['epoch']} while another is in epoch {epoch}; call it at "
                                 "the same step on every worker")
        # No worker has started the epoch after the furthest one's: a server back serves
        # from it on every worker.
        self.agree_on_servers([v["servers"] for v in views],
                              max(v["epoch"] for v in views) + 1)
        if done.all():
            epoch, done[:] = epoch + 1, False
        return {"version": STATE_VERSION, "samples": self.samples,
                "batch_size": self.batch_size, "seed": self.seed, "epoch": epoch,
                "done": pack_mask(done) if done.any() else None}

    def load_state_dict(self, state: dict) -> None:
        """Continues from ``state`` (from ``state_dict``): the next ``iter()`` serves the rest
        of its epoch. Call it on every worker, before iterating."""
        if self._active is not None:
            raise RuntimeError("load_state_dict while an epoch is being iterated")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"a data state of version {state.get('version')}; this gradsync "
                             f"reads version {STATE_VERSION}")
        mine = {"samples": self.samples, "batch_size": self.batch_size, "seed": self.seed}
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if diff:
            raise ValueError(f"the state was saved by another Loader: (saved, this) {diff}")
        self.epoch = int(state["epoch"])
        self._resume = {}
        if state["done"]:
            self._resume[self.epoch] = unpack_mask(state["done"], self.samples)

    def transfers(self) -> list[tuple[float, float, float, int]]:
        """How the latest batches (up to 4,096) came, oldest first: per batch the seconds
        spent asking for it (polling the slot table from a same-host server, else the
        ``take`` call), the part of them the batch was still being prepared (the rest is the
        transport's: the poll's look, or its wake-up after the publish, or the control
        message's round trip), the seconds its bytes took to read into the worker's buffer,
        and their number."""
        return list(self._transfers)

    def reset(self, rank: int, workers: int, state: dict, generation: int | None = None
              ) -> None:
        """The job's membership changed (an elastic job re-formed): this worker is now
        ``rank`` of ``workers``, and the data go on from ``state``: the ``state_dict()`` of
        the last commit, or the live state a recovery without roll-back agreed on
        (``elastic.py``).

        What this worker had taken and not delivered in ``state`` is dropped, and the next
        ``iter()`` re-plans the rest of ``state``'s epoch for the new number of workers:
        every sample not delivered in ``state``, a lost worker's share included, goes to
        exactly one worker of the new generation. Every worker of the new generation calls
        it, with the same ``state`` and ``generation``, before iterating.

        Args:
            generation: the new generation's number, above every earlier one (default: this
                worker's last plus one; ``hvd.elastic`` passes the job's).
        """
        if self._active is not None:
            # Stop the fetch thread before reading where the streams stand: it moves them
            # on as it takes in replies. The takes it leaves in flight released only what
            # it had received, where the next start cuts the stream.
            self._active.stop()
            self._active.join(self._timeout)
            self._active = None
        self.rank, self.workers = int(rank), int(workers)
        self.generation = self.generation + 1 if generation is None else int(generation)
        self._finished = None
        self.load_state_dict(state)

    def position(self) -> dict:
        """Where this worker stands (no message): the epoch, the batches of it delivered
        (``acked``, their samples as a mask in ``delivered``), the samples of the batch in
        hand (``hand``, or None), and the plan they come from (the samples done when the
        epoch started, ``start``; the number of ``workers`` and this worker's ``place``).
        A recovery without roll-back gathers every survivor's (``elastic.live_state``)."""
        run = self._active
        delivered = np.zeros(self.samples, dtype=bool)
        if run is None:
            start = self._resume.get(self.epoch)
            return {"epoch": self.epoch, "acked": 0, "delivered": pack_mask(delivered),
                    "hand": None, "start": pack_mask(start) if start is not None else None,
                    "workers": self.workers, "place": self.rank}
        delivered[_ids(run.delivered)] = True
        return {"epoch": run.epoch, "acked": len(run.delivered),
                "delivered": pack_mask(delivered),
                "hand": run.in_hand.tolist() if run.in_hand is not None else None,
                "start": pack_mask(run.done) if run.done is not None else None,
                "workers": self.workers, "place": self.rank}

    def local_state(self) -> dict:
        """``state_dict()`` of a worker that has not started iterating, without a message:
        the epoch it will serve and what a ``load_state_dict`` marked done in it. (An elastic
        state's first save, which a new worker makes while the others train.)"""
        if self._active is not None:
            raise RuntimeError("local_state() while an epoch is being iterated: use "
                               "state_dict(), a collective")
        done = self._resume.get(self.epoch)
        return {"version": STATE_VERSION, "samples": self.samples,
                "batch_size": self.batch_size, "seed": self.seed, "epoch": self.epoch,
                "done": pack_mask(done) if done is not None and done.any() else None}

    def elastic_handler(self):
        """The object that keeps this Loader's position in an elastic state: give the Loader
        to ``hvd.elastic.TorchState(model, optimizer, loader=loader)`` (or an ``ObjectState``)
        and its position commits, rolls back and goes on with the model (``elastic.py``)."""
        from .elastic import LoaderState

        return LoaderState(self)

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


def _ids(arrays: list[np.ndarray]) -> list[int]:
    return np.concatenate(arrays).tolist() if arrays else []


class _Epoch:
    """One epoch's iterator on a worker: where its batches come from, and the delivered ones.

    Two ways to run. When every live data server is on this host (each stream's slot table
    polled), the training loop's own ``next()`` polls for the next batch (*inline*): the
    servers already prepare ``prefetch`` batches ahead into their slots, so a thread between
    them and the loop would add only its hand-over (a queue, and the GIL passed back and
    forth) to every batch. So it does over TCP when a take's reply is small (a window of
    batches of at most ``INLINE_REPLY_BYTES``): the take for the next batches is sent as
    soon as a reply is in (``_call``), its reply lands in the socket's receive buffer while
    the loop trains, and the loop's own receive is a copy; the connection's thread watches
    the takes in flight for silence meanwhile, and receives a reply the loop has not asked
    for within two of its looks (a step longer than 50 ms: ``region_peer.LOOK_S``).
    Otherwise (larger batches, which would stream in while the loop waits) a *fetch thread*
    takes the batches ahead into the queue, ``prefetch`` of them, so that reads over TCP
    overlap the training step.

    *Borrowed* batches (``Loader(copy=False)``, inline only): the yielded tensors view the
    stream's slot itself, not a copy, and the slot is released (acked) when the loop asks for
    the next batch, ends the epoch, or the Loader is reset or closed. So a batch must be used
    before the next one is taken (``.clone()`` what is kept longer); in exchange the worker
    copies nothing at all.
    """

    def __init__(self, loader: Loader, epoch: int, work: list[tuple[Batch, int]],
                 orphans: list[Batch], done: np.ndarray | None):
        self.loader, self.epoch = loader, epoch
        self.done = done  # the samples delivered before the epoch started (a resumed one)
        self.work, self.orphans = collections.deque(work), orphans
        self.delivered: list[np.ndarray] = []
        self.in_hand: np.ndarray | None = None
        self.ids: np.ndarray | None = None  # the sample ids of the batch last yielded
        self._stopping = False
        # Batches of each server still in ``work``: how many more items to ask a remote one
        # for (``_post``); its takes in flight, (items asked for, take) in the order sent,
        # by server; the items a take brought beyond the one needed then, (seq, answer,
        # bytes) in stream order, by server.
        self._left = collections.Counter(s for _, s in work)
        self._posted: dict[int, collections.deque] = collections.defaultdict(
            collections.deque)
        self._got: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        # (poller, seq) of a borrowed slot, released at the next batch
        self._held: tuple[Any, int] | None = None
        self._failed: BaseException | None = None  # raised again by every later next()
        live = [d for d in range(loader.servers) if d not in loader.lost]
        self.inline = all(loader.pollers[d] is not None for d in live) \
            or loader.window * loader.slot_bytes <= loader.inline_reply_bytes
        self.borrow = self.inline and not loader.copy
        self._items = self._batches()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if not self.inline:
            self._queue = queue.Queue(maxsize=loader.prefetch)
            self._thread = threading.Thread(target=self._fetch, daemon=True,
                                            name="gradsync-data-fetch")
            self._thread.start()

    def _batches(self):
        """Yields (batch, buffer) for this worker's batches in plan order.

        The batches of a data server lost on the way (or before the epoch) are set aside and,
        once the live servers' batches are all taken, handed to the live servers and taken
        from them: so each server's stream is always taken in the order it was queued."""
        loader = self.loader
        while self.work or self.orphans:
            if not self.work:
                adopted = loader._adopt(self.epoch, self.orphans)
                self.work.extend(adopted)
                self._left.update(s for _, s in adopted)
                self.orphans = []
            batch, s = self.work.popleft()
            self._left[s] -= 1
            if s in loader.lost and not self._got[s]:
                # (A batch whose bytes came before the loss is received: it is handed on.)
                self.orphans.append(batch)
                continue
            try:
                buf = self._take(batch, s)
            except PeerLostError as exc:
                if self._stopping:  # the Loader is closing its connections: no loss
                    return
                loader._lose(s, exc)
                self.orphans.append(batch)
                continue
            if buf is None:  # stopped while waiting: the batch was not taken
                return
            yield batch, buf

    def _fetch(self) -> None:
        """(The fetch thread.) Takes the batches ahead of the loop into the queue."""
        try:
            for item in self._items:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the training loop, which raises it
            self._put(exc)

    def _take(self, batch: Batch, s: int) -> np.ndarray | None:
        """Batch ``batch`` from data server ``s``, in this worker's buffer or (borrowed) a
        view of the slot (None: the epoch was stopped before it came)."""
        loader = self.loader
        road = loader.pollers[s]
        if road is None:
            return self._call(batch, s)
        seq = loader._seq[s]
        start = time.perf_counter()
        header, waited = road.wait(seq, loader._timeout, lambda: self._stopping)
        if header is None:
            if self._stopping:
                return None
            # The server said a sample failed: its take raises the message (or answers, if
            # this item was published after all).
            return self._call(batch, s)
        polled = time.perf_counter()
        self._check(s, header.epoch, header.index, header.ids, batch)
        if header.generation != loader.generation:
            raise RuntimeError(f"data server {s} published item {seq} for generation "
                               f"{header.generation}; this worker is in generation "
                               f"{loader.generation}")
        if self.borrow:
            buf = road.view(header)
            self._held = (road, seq)
        else:
            # A fresh buffer each batch: the tensors handed to the loop view it for as long
            # as the loop keeps them, and the slot is rewritten as soon as it is acked.
            buf = np.empty(header.nbytes, dtype=np.uint8)
            road.read(header, buf)
        loader._seq[s] += 1
        loader._transfers.append((polled - start, waited, time.perf_counter() - polled,
                                  buf.nbytes))
        return buf

    def _check(self, s: int, epoch: int, index: int, ids, batch: Batch) -> None:
        # Both int64 arrays on the poll road: their bytes compare without NumPy's dispatch;
        # a take's list (JSON) against the plan's as a list, without making it an array.
        same = ids.tobytes() == batch.ids.tobytes() if isinstance(ids, np.ndarray) \
            and ids.dtype == batch.ids.dtype else list(ids) == batch.ids.tolist()
        if index != batch.index or epoch != self.epoch or not same:
            raise RuntimeError(f"data server {s} sent batch {index} of epoch {epoch} (samples "
                               f"{list(ids)[:8]}...) where the plan has batch {batch.index} "
                               f"of epoch {self.epoch} (samples {batch.ids.tolist()[:8]}...)")

    def _ask(self, s: int, seq: int | None, count: int, least: int = 1) -> "Posted":
        """Sends data server ``s`` a ``take`` and returns it in flight (``RemotePeer.post``):
        for item ``seq``, or without it for the item after those its takes in flight will
        have answered; with its bytes attached when its slots are not mapped here (they
        cross the connection once, into a fresh buffer), and then those of the next
        ``count - 1`` items that are ready, answered once ``least`` of them are. It
        releases the items received so far."""
        loader = self.loader
        peer = loader.peers[s]
        args = {"wait": loader._take_wait, "release": loader._seq[s]}
        if seq is not None:
            args["seq"] = seq
        if loader.slots[s].direct is not None:
            return peer.post_call("take", **args)

        def buffer(reply: dict) -> np.ndarray:
            return np.empty(reply["attached"], dtype=np.uint8)

        return peer.post_call_into("take", buffer, send=True, count=count, least=least,
                                   **args)

    def _call(self, batch: Batch, s: int) -> np.ndarray | None:
        """Batch ``batch`` by ``take`` calls (from another host, or a same-host server
        whose table is not polled); None: the epoch was stopped before it came.

        ``loader._seq[s]`` counts the items of the stream received (the next one to come).
        Up to ``takes`` takes of the server are in flight at once (``_post``), asking for
        up to ``window`` items together; their replies come in order, each checked against
        the item it should bring, and the items a reply brought beyond the one needed now
        wait in ``_got[s]`` for their batches' turn. As soon as a reply is in, the next
        take is sent, while the batches already here are checked and handed on, so a batch
        that the server makes ready finds a take waiting for it."""
        loader = self.loader
        start = time.perf_counter()
        waited = 0.0
        got, posted = self._got[s], self._posted[s]
        while not got:
            self._post(s, 1)
            if not posted:  # stopped, or given up meanwhile: nothing was asked
                if self._stopping:
                    return None
                raise PeerLostError(f"data server {s} was given up", peer=s)
            # Answered within ``_take_wait`` while the server runs: "pending" when the batch
            # is not ready yet, so that a slow batch is never a silent server.
            try:
                answer = posted[0][1].wait()
            except BaseException:
                # The takes behind it are received and dropped: the items they bring were
                # not released, and the server's stream goes on from what this worker holds.
                posted.clear()
                raise
            posted.popleft()
            info, attached = answer if isinstance(answer, tuple) else (answer, None)
            waited += float(info.get("waited", 0.0))
            if info.get("pending"):  # a take behind it asks for the same item
                if self._stopping:
                    return None
                if s in loader.lost:  # the liveness watch gave it up meanwhile
                    raise PeerLostError(f"data server {s} was given up", peer=s)
                if time.perf_counter() - start > loader._timeout:
                    raise GradsyncTimeoutError(f"data server {s} did not prepare this "
                                               f"worker's item {loader._seq[s]} within "
                                               f"{loader._timeout:.0f}s")
                continue
            self._received(s, info, attached)
        taken = time.perf_counter()
        _, info, buf = got.popleft()
        if buf is None:  # its slot is mapped here: read it before a take releases it
            buf = np.empty(info["nbytes"], dtype=np.uint8)
            loader.slots[s].read(buf, info["slot"] * loader.slot_bytes)
            loader._seq[s] += 1
        self._post(s, 0)  # the next takes go out while this batch is checked and handed on
        self._check(s, info["epoch"], info["index"], info["ids"], batch)
        # (The read's seconds include the next takes' sending, as they included the take
        # asked ahead before takes were pipelined: ``transfers()`` measures the same span.)
        loader._transfers.append((taken - start, waited, time.perf_counter() - taken,
                                  buf.nbytes))
        return buf

    def _received(self, s: int, info: dict, attached: np.ndarray | None) -> None:
        """Takes in a take's answer from data server ``s``: the items it brings, which
        must be the next ones of the stream, go into ``_got[s]``."""
        loader = self.loader
        first = loader._seq[s]
        if info.get("seq") != first:
            raise RuntimeError(f"data server {s} answered item {info.get('seq')} of this "
                               f"worker's stream where item {first} comes next")
        more = info.pop("more", [])
        got = self._got[s]
        if attached is None:  # no bytes: the worker reads the slot (``_call``)
            got.append((first, info, None))
            return
        at = info["nbytes"]
        got.append((first, info, attached[:at]))
        for k, extra in enumerate(more, 1):  # the items' bytes, one after the other
            got.append((first + k, extra, attached[at:at + extra["nbytes"]]))
            at += extra["nbytes"]
        loader._seq[s] += 1 + len(more)

    def _post(self, s: int, current: int) -> None:
        """Sends data server ``s`` takes for the items of it that this worker's work still
        needs (``current``: 1 while the batch being taken is not here yet), while fewer
        than ``takes`` are in flight and they ask for fewer than ``window`` items together.

        The first take of a run names its item; the ones sent behind it do not (the server
        answers the item after those the one before it answered, which a "pending" answer
        leaves where it was). Each releases the items received so far, so the items asked
        for and not yet released stay within the window, at most the stream's slots: the
        item a take waits for is always one the server may prepare."""
        loader = self.loader
        if self._stopping or s in loader.lost:
            return
        window, takes = loader.window, loader.takes
        if loader.pollers[s] is not None:  # polled: one take, for a failed sample's message
            if not current:
                return
            window = takes = 1
        elif loader.slots[s].direct is not None:  # a reply without bytes: one item each
            window = takes = min(takes, loader.prefetch)
        posted, got = self._posted[s], self._got[s]
        asked = sum(count for count, _ in posted)
        wanted = current + self._left[s] - len(got) - asked
        share = -(-window // takes)  # items a take asks for, at most
        while wanted > 0 and len(posted) < takes and asked < window:
            count = min(share, wanted, window - asked)
            # How many of its items the reply waits for (the server sends it once they are
            # ready): one, when the worker waits for this take with nothing in hand or in
            # flight (a run's first); else all but one. A reply sent as soon as its first
            # item is ready brings one batch whenever the server is the slower side, and
            # each batch then pays a take's request, reply and parse on both ends; one item
            # fewer than asked leaves the server a slot to prepare into while the reply
            # travels and the next take comes back, so its producer never waits for them.
            least = 1 if current and not posted else max(1, count - 1)
            posted.append((count, self._ask(s, None if posted else loader._seq[s], count,
                                            least)))
            asked += count
            wanted -= count

    def _put(self, item) -> bool:
        assert self._queue is not None  # only the fetching thread puts, and it has its queue
        while not self._stopping:
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self):
        return self

    def acknowledge(self) -> None:
        """The batch in hand is delivered (the loop finished with it)."""
        if self.in_hand is not None:
            self.delivered.append(self.in_hand)
            self.in_hand = None

    def _release(self) -> None:
        """Frees the borrowed slot of the batch last yielded (its ack)."""
        if self._held is not None:
            road, seq = self._held
            self._held = None
            road.table.ack(seq)

    def _next_item(self):
        if self._failed is not None:  # the batches stopped at an error: never a silent end
            return self._failed
        if self._queue is not None:
            return self._queue.get()
        try:
            return next(self._items)
        except StopIteration:
            return _END
        except BaseException as exc:
            return exc

    def __next__(self):
        self.acknowledge()
        self._release()
        began = time.monotonic_ns()
        item = self._next_item()
        # The loop's wait for this batch: its step's "data" (pace.py), not its compute.
        meter.waited_for_data(began, time.monotonic_ns())
        if item is _END:
            self.loader._ended(self)
            raise StopIteration
        if isinstance(item, BaseException):
            self._failed = item
            self.stop()
            raise item
        batch, buf = item
        self.in_hand = self.ids = batch.ids
        loader = self.loader
        if loader.collate is not None:
            return loader.collate.unpack(loader.spec, buf, len(batch.ids))
        assert loader.layout is not None  # a Loader without a collate has the samples' layout
        return loader.layout.unpack(buf, len(batch.ids))

    def stop(self) -> None:
        self._stopping = True
        self._release()

    def join(self, timeout: float) -> None:
        """Waits for the fetch thread to end (after ``stop``)."""
        if self._thread is None:
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"the data fetch thread did not stop within {timeout:.0f}s")
