"""A parameter server: one shard of the model in memory regions, its optimizer, its clock.

A job started with ``GRADSYNC_SERVERS=S`` (``gradsync run -np N --servers S``) has its last S
ranks serve. ``gradsync run`` starts each of them as the server entry point, ``python -m
gradsync.ps`` (``__main__.py``), which calls ``serve_rank`` and exits when the workers are
done; under a launcher that starts every rank from the user's script (torchrun, srun, mpirun)
``gradsync.init()`` on such a rank calls ``serve_rank`` and ends the process. The server
knows nothing of the model until the workers say ``hello``: the first hello carries the
*spec* (tensor sizes, optimizer, mode), and the server then allocates its regions in shared
memory (``transport/regions.py``)::

    params      float32[n]    this server's slice of the flat parameter vector      (fenced)
    grad.<w>    float32[n]    worker w's gradient slot (written by worker w only)
    factors.<w> float32[...]  worker w's activations and errors of factored layers (factors.py)
    meta        int64[2]      [version, 0]: the version the parameters hold          (fenced)

A step, seen from worker w: it *writes* its gradient into ``grad.<w>`` (one-sided: a memcpy
into the server's memory on the same host, a stream into it over TCP otherwise), then
*calls* ``push(tag)``: a 60-byte control message saying "my gradient of version ``tag`` is in
my slot". The server's ``Clock`` (consistency.py) decides when to apply it; applying averages
the chosen slots stripe by stripe and runs the optimizer on each stripe of ``params`` under
that stripe's lock. The push returns when the worker may go on; it then *reads* ``params``.
No tensor is ever serialised, and the server's CPU never touches a worker's pull.

Failures: a worker whose connection drops without a ``bye`` is dropped from training
(``Clock.leave``), which in ``sync`` mode fails every other worker's push with PeerLostError
naming it. A worker that says ``bye`` has left training but may still pull, read counters and
save; the server ends when every worker has disconnected. ``save`` writes the shard, the
optimizer's state and the clock to an ``.npz``; a hello with ``restore`` loads one back.

Replicas (``ps_replicas`` R > 1, replication.py): each shard lives on R servers; the primary
forwards every update it applies to the backups of its view (``apply``) before it answers the
pushes, and a server fenced out of its shard's newest view stops serving and ends with status 1.
Every worker disconnecting ends a replicated server only once it has read the newest view
(``outcome``): the workers also drop a server that a newer view left out. A copy that joined
(join.py) is reached only by the workers that moved to a view holding it, so a replicated
server also ends once the store says the workers are done (``replication.workers_done``).

Fenced regions (``regions.py``): every region that another *server* writes (a primary's
forwards into ``update.<k>``, its copy into a joiner's ``params`` and ``copy.<name>``) or that
no peer should write (``meta``) takes only writes that carry a view number at or above this
server's, which it raises (``Endpoint.raise_fence``) whenever it enters a newer view: a
primary that others replaced is refused at the write, before a byte of its update lands in a
newer view's copy. Worker 0's one write of the initial ``params`` carries view 0. The workers'
``grad.<w>`` and ``factors.<w>`` stay unfenced, written straight into shared memory on one
host: each has one writer, and its bytes count only through a push that the primary of the
worker's view accepts (a worker's view names only a server that is still that shard's
primary or is fenced out, never a backup: a new view's primary is the first surviving member).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time

import numpy as np

from ..errors import CollectiveMismatchError, GradsyncError, GradsyncTimeoutError, PeerLostError
from ..transport.regions import STRIPE_BYTES, Endpoint, StaleWriteError
from . import factors as fc
from . import join
from . import optim
from .consistency import Clock
from .replication import (FINISHED, Beats, Fenced, View, Views, abandon, shard_of,
                          wait_watched, workers_done)
from .sharding import bounds

__all__ = ["Server", "StoreGate", "serve", "serve_rank", "checkpoint_path"]

log = logging.getLogger("gradsync.ps")

_STRIPE = STRIPE_BYTES // 4  # float32 elements per stripe
_EXIT_WAIT_S = 10.0  # how long a server's exit waits for its threads' store requests


def checkpoint_path(directory: str, shard: int) -> str:
    """Where ``save`` puts shard ``shard`` (the server's index when there are no replicas)."""
    return os.path.join(directory, f"server-{shard}.npz")


class Server:
    """One parameter server of a job.

    Args:
        index: this server's index, 0 .. servers-1.
        servers, workers: how many of each the job has.
        endpoint: this server's region endpoint (workers connect to it).
        timeout: seconds a push may wait for other workers.
        connect_timeout: seconds every worker has to say hello once the first has.
        replicas: servers per shard (replication.py); the others need ``views`` and ``beats``.
        views: this shard's ``replication.Views`` in the job's store.
        beats: the servers' liveness counters (``replication.Beats``).
        locate: ``locate(server) -> (addr, port)`` of another server's endpoint.
    """

    def __init__(self, index: int, servers: int, workers: int, endpoint: Endpoint,
                 timeout: float = 300.0, connect_timeout: float = 60.0, replicas: int = 1,
                 views: Views | None = None, beats: Beats | None = None, locate=None):
        self.index, self.servers, self.workers = index, servers, workers
        self.endpoint, self.timeout, self.connect_timeout = endpoint, timeout, connect_timeout
        self.replicas, self.shard = replicas, shard_of(index, servers, replicas)
        self.views, self.beats, self._locate = views, beats, locate
        self.view: View | None = views.first if views else None  # the fence starts at 0
        self.fenced: str | None = None
        self.joining = self.installed = False  # a replacement, before / after its copy
        self.joined = threading.Event()
        # Why a joiner could not take its copy (it then ends, and the launcher starts another:
        # its listener admits each peer once, so the primary could not try it again).
        self.join_error: BaseException | None = None
        self._copies: dict = {}  # backup server -> RemotePeer (the primary's forwards)
        self._last: dict | None = None  # the newest update's info (replicas: see _reconcile)
        self._settled = 0  # the view whose copies this primary has brought to one version
        self.spec: dict | None = None
        self.clock: Clock | None = None
        self._cv = threading.Condition()
        self._greeted: dict[int, dict] = {}
        self._mapped: set[int] = set()
        self._left: set[int] = set()
        self._lost: set[int] = set()   # disconnected without saying bye
        self._gone: set[int] = set()   # disconnected, either way
        self._factor_rows: dict[int, list[int]] = {}
        self.done = threading.Event()
        for method in ("hello", "ready", "push", "save", "stats", "bye", "follow", "newest"):
            endpoint.on_call(method, getattr(self, "_" + method))
        endpoint.on_call("install", lambda peer, args: join.install(self, peer, args))
        endpoint.on_disconnect(self._disconnected)

    # ------------------------------------------------------------------ set-up
    def _hello(self, worker: int, args: dict) -> dict:
        spec = args["spec"]
        with self._cv:
            if self.spec is None:
                self._setup(spec)
            elif spec != self.spec:
                first = min(self._greeted)
                diff = sorted(k for k in set(spec) | set(self.spec)
                              if spec.get(k) != self.spec.get(k))
                raise CollectiveMismatchError(
                    f"worker {worker}'s parameter client differs from worker {first}'s in "
                    f"{', '.join(diff)}: every worker must build the same model and pass the "
                    f"same settings (worker {worker}: "
                    f"{ {k: _short(spec.get(k)) for k in diff} }, worker {first}: "
                    f"{ {k: _short(self.spec.get(k)) for k in diff} })")
            self._greeted[worker] = spec
            self._cv.notify_all()
            self._barrier(self._greeted, "say hello")
            return {"version": self.clock.version, "restored": bool(spec.get("restore")),
                    "bounds": [self.lo, self.hi], "workers": self.workers, "shard": self.shard}

    def _setup(self, spec: dict) -> None:
        total = sum(spec["numels"])
        cuts = bounds(total, self.servers // self.replicas)
        self.lo, self.hi = cuts[self.shard], cuts[self.shard + 1]
        n = self.hi - self.lo
        ep = self.endpoint
        self.params = ep.allocate("params", (n,), np.float32, fenced=True)
        self.slots = [ep.allocate(f"grad.{w}", (n,), np.float32) for w in range(self.workers)]
        self.factored = fc.layout(spec.get("factored", []), spec["numels"], self.lo, self.hi)
        words = fc.slot_floats(self.factored)
        self.factor_slots = [ep.allocate(f"factors.{w}", (words,), np.float32)
                             for w in range(self.workers)] if words else []
        self.meta = ep.allocate("meta", (2,), np.int64, fenced=True)
        if self.replicas > 1:
            # The update that makes version v + 1 is combined (a primary) or received (a
            # backup) in ``update.<v % 2>``: the previous one stays whole while the next
            # arrives, for a new primary to bring its view's copies to one version with.
            # Fenced: a replaced primary's forward must not overwrite either.
            self.updates = [ep.allocate(f"update.{k}", (n,), np.float32, fenced=True)
                            for k in (0, 1)]
        self.optimizer = optim.make(spec["optimizer"], n, **spec["hyper"])
        self.clock = Clock(spec["mode"], self.workers, self._apply, backup=spec.get("backup"),
                           staleness=spec.get("staleness"), timeout=self.timeout)
        self._scratch = np.empty(min(n, _STRIPE) or 1, dtype=np.float32)
        self.spec = spec
        if spec.get("restore"):
            self._load(checkpoint_path(spec["restore"], self.shard))

    def _ready(self, worker: int, args: dict) -> dict:
        with self._cv:
            self._mapped.add(worker)
            self._cv.notify_all()
            self._barrier(self._mapped, "map the regions")
            # Every worker on this host has mapped the segments: their names can go, so a
            # crash from here on leaves nothing behind in /dev/shm.
            self.endpoint.unlink_segments()
            # The worker numbers its pushes on from its clock (a restored checkpoint's).
            return {"version": self.clock.version, "seq": self.clock.clocks[worker]}

    def _barrier(self, arrived, what: str) -> None:
        """Waits (holding ``_cv``) until every worker is in ``arrived``."""
        end = time.monotonic() + self.connect_timeout
        while len(arrived) < self.workers:
            gone = self._lost | (self._gone - set(arrived))
            if gone:
                raise PeerLostError(f"worker(s) {sorted(gone)} left before training started "
                                    f"(see their own errors)", peer=min(gone))
            left = end - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(self.workers)) - set(arrived))
                raise GradsyncTimeoutError(f"parameter server {self.index}: worker(s) {missing} "
                                           f"did not {what} within {self.connect_timeout:.0f}s")
            self._cv.wait(min(left, 0.5))

    # ------------------------------------------------------------------ training
    def _push(self, worker: int, args: dict) -> dict:
        if self.clock is None:
            raise ValueError(f"worker {worker} pushed before saying hello")
        if self.replicas > 1:
            refusal = self._refuse(int(args.get("epoch", 0)))
            if refusal is not None:
                return refusal
            try:
                settled = self._reconcile()
            except Fenced:
                settled = False
            if not settled:
                return {"stale": self.view.epoch}
        if self.factored:
            rows = [int(k) for k in args.get("rows", [])]
            if len(rows) != len(self.factored):
                raise ValueError(f"worker {worker} sent rows for {len(rows)} factored layers, "
                                 f"this server has {len(self.factored)}")
            self._factor_rows[worker] = rows
        seq = args.get("seq")
        try:
            return self.clock.push(worker, int(args["tag"]), None if seq is None else int(seq))
        except Fenced:
            return {"stale": self.view.epoch}

    def _apply(self, workers, average: bool) -> None:
        """Applies the gradients in ``workers``' slots (called by the Clock, under its lock)."""
        # Summed in worker order, not arrival order: the same gradients give the same bits,
        # so a restored checkpoint continues exactly as the original run did.
        workers = sorted(workers)
        for w in workers:
            if self.factored:
                fc.expand(self.factored, self.factor_slots[w], self._factor_rows[w],
                          self.slots[w], self.lo)
        scale = 1.0 / len(workers) if average else 1.0
        if self.replicas > 1 and self.view.backups:
            self._apply_replicated(workers, scale)
            return
        opt, stripes = self.optimizer, self.endpoint.region("params").stripes
        opt.begin_step()
        for a in range(0, self.hi - self.lo, _STRIPE):
            b = min(a + _STRIPE, self.hi - self.lo)
            if len(workers) == 1:
                g = self.slots[workers[0]][a:b]  # the optimizer only reads its gradient
            else:
                g = self._scratch[:b - a]
                np.add(self.slots[workers[0]][a:b], self.slots[workers[1]][a:b], out=g)
                for w in workers[2:]:
                    np.add(g, self.slots[w][a:b], out=g)
                g *= scale
            stripes.acquire(a * 4)
            try:
                opt.update(self.params[a:b], g, a, b)
            finally:
                stripes.release(a * 4)
        self.meta[0] = self.clock.version + 1

    def _step(self, g: np.ndarray) -> None:
        """One optimizer update of the whole shard with the combined gradient ``g``."""
        opt, stripes = self.optimizer, self.endpoint.region("params").stripes
        opt.begin_step()
        for a in range(0, self.hi - self.lo, _STRIPE):
            b = min(a + _STRIPE, self.hi - self.lo)
            stripes.acquire(a * 4)
            try:
                opt.update(self.params[a:b], g[a:b], a, b)
            finally:
                stripes.release(a * 4)

    # ------------------------------------------------------------------ replicas
    def _apply_replicated(self, workers: list[int], scale: float) -> None:
        """The primary's update: combine, forward to every backup while applying here, and
        return only when every backup of the view has it (or was dropped from the view)."""
        version = self.clock.version
        g = self.updates[version % 2]
        # The same operations, in the same order, as the stripe loop of ``_apply``: a copy
        # that takes over continues with the bits a run without faults would have.
        if len(workers) == 1:
            np.copyto(g, self.slots[workers[0]])
        else:
            np.add(self.slots[workers[0]], self.slots[workers[1]], out=g)
            for w in workers[2:]:
                np.add(g, self.slots[w], out=g)
            g *= scale
        state = self.clock.replica_state()
        for w in workers:
            state["done"][w] = state["clocks"][w]
        info = {"version": version, "workers": workers, "state": state}
        pending = {b: self._send(b, g, info) for b in self.view.backups}
        self._step(g)
        self._last = info
        # ``meta`` says version + 1 only once every backup has the update: a worker reads
        # ``meta`` before ``params`` and tags its next gradient with it, so a tag never names
        # a version that a backup taking over from a primary lost now could lack. (Its reads
        # of ``params`` may meanwhile see this update: a gradient tagged older than its
        # parameters, as any read racing an update in the asynchronous modes.)
        while pending:
            b, (peer, handle) = pending.popitem()
            try:
                if peer is None:
                    raise handle
                reply = wait_watched(handle, self.beats, b, self.workers + b,
                                     lambda: abandon(peer))
            except StaleWriteError as exc:  # b is in a newer view: its fence refused the write
                log.warning("shard %d: server %d refused primary %d's forward of version %d "
                            "at the write: it is in view %s, this primary in view %d",
                            self.shard, b, self.index, version + 1, exc.level, self.view.epoch)
                reply = {"stale": exc.level}
            except (PeerLostError, GradsyncTimeoutError, OSError) as exc:
                self._copies.pop(b, None)
                self._adopt(self.views.propose(self.view, b, f"its primary lost it: {exc}"))
                reply = {}
            if "stale" in reply:
                epoch = self.view.epoch
                self._adopt(self.views.newest(self.view))
                if self.view.epoch == epoch and b in self.view.backups:
                    # No newer view, yet it refuses: a restarted process not yet a copy.
                    self._copies.pop(b, None)
                    self._adopt(self.views.propose(self.view, b, "it restarted"))
                    reply = {}
            if self.fenced:
                raise Fenced(self.fenced)
            if "stale" in reply and b in self.view.backups:
                pending[b] = self._send(b, g, info)  # under the newer view, which kept it
        self.meta[0] = version + 1

    def _send(self, b: int, g: np.ndarray, info: dict):
        """Starts forwarding ``g`` to backup ``b``: (peer, handle), or (None, error)."""
        epoch = self.view.epoch
        return self._submit(b, lambda peer: self._forward(peer, g, info, epoch),
                            f"forward to server {b}")

    def _forward(self, peer, g: np.ndarray, info: dict, epoch: int) -> dict:
        """(Backup ``peer``'s request thread.) Writes update ``g`` of view ``epoch`` into the
        backup's memory, then has it apply it. The write carries the view: a backup that has
        entered a newer view refuses it (StaleWriteError) before a byte lands, so a primary
        replaced while it was stopped cannot overwrite the update a newer primary put there."""
        peer.region(f"update.{info['version'] % 2}").write(g, fence=epoch)
        return peer.call("follow", epoch=epoch, **info)

    def _submit(self, b: int, fn, what: str):
        """Starts ``fn(peer)`` on backup ``b``'s connection: (peer, handle), or (None, error).
        """
        try:
            peer = self._copies.get(b)
            if peer is None:
                addr, port = self._locate(b)
                peer = self.endpoint.connect(self.workers + b, addr, port,
                                             time.monotonic() + self.connect_timeout,
                                             f"parameter server {b} (rank {self.workers + b})")
                self._copies[b] = peer
        except (GradsyncError, OSError) as exc:
            return None, PeerLostError(f"cannot reach parameter server {b}: {exc}",
                                       peer=self.workers + b)
        return peer, peer.submit(lambda: fn(peer), what)

    def _follow(self, peer: int, args: dict) -> dict:
        """A backup applies its primary's update (the gradient is in ``update.<v % 2>``)."""
        if self.clock is None or self.replicas == 1:
            raise ValueError(f"parameter server {self.index} is no backup to rank {peer}")
        epoch = int(args["epoch"])
        with self.clock.lock:
            if epoch > self.view.epoch:
                self._adopt(self.views.newest(self.view))
            # Fencing: an update of an older view comes from a primary the others have
            # replaced (it was stopped or cut off): it must not touch this copy.
            if self.fenced or self.joining or epoch < self.view.epoch:
                return {"stale": self.view.epoch}
            version = int(args["version"])
            self.clock.follow(version, [int(w) for w in args["workers"]], args["state"],
                              lambda: self._step(self.updates[version % 2]))
            self._last = {k: args[k] for k in ("version", "workers", "state")}
            self.meta[0] = self.clock.version
            return {"version": self.clock.version}

    def _newest(self, peer: int, args: dict) -> dict:
        """This copy's version and the info of the update that made it (``_reconcile``).

        The asking primary's view comes first: a backup enters it (and raises its fence)
        before it answers, so once a new primary has settled its view, no write of an older
        view reaches any of its copies."""
        with self.clock.lock:
            if int(args.get("epoch", 0)) > self.view.epoch:
                self._adopt(self.views.newest(self.view))
            return {"version": self.clock.version, "last": self._last}

    def _reconcile(self) -> bool:
        """(A primary, before it decides anything in a view it has not settled.) Brings the
        view's copies to one version.

        The primary that a view replaced may have died while forwarding an update: then some
        copies applied it and some did not (it was never acknowledged: a primary answers only
        once every backup has). Copies differ by at most that one update, and each keeps the
        newest one (``update.<v % 2>`` and ``_last``). The new primary asks each backup its
        version; if one is ahead it reads that update from it and applies it as a backup
        would (its ``done`` counters then answer the workers' repeated pushes without
        applying them twice), and it sends its newest update again to each backup one
        behind. A backup that cannot be brought level leaves the view, as a lost one does.

        Returns False if this server is no longer the primary (the worker must look again).
        """
        with self.clock.lock:
            while self._settled != self.view.epoch and not self.fenced:
                epoch = self.view.epoch
                if self.view.primary != self.index:
                    return False
                known = {}
                for b in self.view.backups:
                    try:
                        known[b] = self._ask(b, "newest", epoch=epoch)
                    except (PeerLostError, GradsyncTimeoutError, OSError) as exc:
                        self._drop(b, f"its new primary lost it: {exc}")
                if self.view.epoch != epoch:
                    continue  # settle the view that dropped it
                ahead = [b for b in known if known[b]["version"] > self.clock.version]
                if ahead:
                    b = max(ahead, key=lambda b: known[b]["version"])
                    self._catch_up(b, known[b])
                for b, got in known.items():
                    if got["version"] == self.clock.version - 1 and self._last is not None:
                        try:
                            peer, handle = self._send(b, self.updates[got["version"] % 2],
                                                      self._last)
                            if peer is None:
                                raise handle
                            got = {"version": wait_watched(
                                handle, self.beats, b, self.workers + b,
                                lambda: abandon(peer)).get("version")}
                        except StaleWriteError:  # b is in a newer view than this primary
                            self._adopt(self.views.newest(self.view))
                            break
                        except (PeerLostError, GradsyncTimeoutError, OSError, ValueError) as exc:
                            got = {"version": None, "why": str(exc)}
                    if got["version"] != self.clock.version and b in self.view.backups:
                        self._drop(b, f"its copy is at version {got['version']}, the new "
                                      f"primary's at {self.clock.version} "
                                      f"{got.get('why', '')}".strip())
                if self.view.epoch == epoch:
                    self._settled = epoch
                    self.meta[0] = self.clock.version
                    log.warning("shard %d: primary server %d settled view %d at version %d",
                                self.shard, self.index, epoch, self.clock.version)
            if self.fenced:
                raise Fenced(self.fenced)
            return self.view.primary == self.index

    def _catch_up(self, b: int, got: dict) -> None:
        """(Under the lock.) Applies backup ``b``'s newest update, one this copy lacks."""
        last = got.get("last")
        if got["version"] != self.clock.version + 1 or not last or \
                int(last["version"]) != self.clock.version:
            self._drop(b, f"its copy is at version {got['version']}, ahead of the new "
                          f"primary's {self.clock.version} by more than one update")
            return
        version = self.clock.version
        g = self.updates[version % 2]
        try:
            self._copies[b].region(f"update.{version % 2}").read(g)
        except (GradsyncError, OSError) as exc:
            self._drop(b, f"its new primary could not read its newest update: {exc}")
            return
        self.clock.follow(version, [int(w) for w in last["workers"]], last["state"],
                          lambda: self._step(g))
        self._last = last
        log.warning("shard %d: primary server %d took version %d from server %d, which had "
                    "applied the update its old primary was forwarding when it failed",
                    self.shard, self.index, self.clock.version, b)

    def _ask(self, b: int, method: str, **args) -> dict:
        """A call to backup ``b`` (connecting first if need be), watched for silence."""
        peer, handle = self._submit(b, lambda peer: peer.call(method, **args), method)
        if peer is None:
            raise handle
        return wait_watched(handle, self.beats, b, self.workers + b, lambda: abandon(peer))

    def _drop(self, b: int, why: str) -> None:
        """(Under the lock.) Proposes this view without backup ``b``."""
        old = self._copies.pop(b, None)
        if old is not None:
            abandon(old)
        self._adopt(self.views.propose(self.view, b, why))

    def _refuse(self, epoch: int) -> dict | None:
        """None if this server is the primary of view ``epoch``, else the refusal that the
        worker gets (``{"stale": e}``: read view e or newer, and push to its primary)."""
        with self.clock.lock:
            if epoch > self.view.epoch:
                self._adopt(self.views.newest(self.view))
            if self.fenced or self.joining or epoch < self.view.epoch or \
                    self.view.primary != self.index:
                return {"stale": self.view.epoch}
        return None

    def _adopt(self, view: View) -> None:
        """(Holding the clock's lock.) Makes ``view`` this server's; fences the server when
        it is no member."""
        if view.epoch <= self.view.epoch:
            return
        before, self.view = self.view.epoch, view
        # From here no write of an older view lands in this copy's memory (forwards from a
        # primary the others replaced); waits only for a stripe's copy already admitted.
        self.endpoint.raise_fence(view.epoch)
        for b in [b for b in self._copies if b not in view.backups]:
            abandon(self._copies.pop(b))
        if self.joining:
            return
        if self.index not in view.members:
            self._fence(f"view {view.epoch} of shard {self.shard} holds servers "
                        f"{list(view.members)} ({view.why})")
        elif view.epoch > before + 1:
            # This process missed views (it was stopped or cut off while they were made). One
            # that left it out makes it stale even if a later one holds its index: a view never
            # takes a member back, so that is a replacement process that joined since (the
            # launcher starts one without waiting for a silent server to end).
            gone = self.views.left_out(self.index, before, view.epoch - 1)
            if gone is not None:
                self._fence(f"view {gone} of shard {self.shard} left this process out; view "
                            f"{view.epoch} holds server {self.index} again for a replacement "
                            f"process that joined since")

    def _fence(self, why: str) -> None:
        if self.fenced:
            return
        self.fenced = why
        log.error("parameter server %d was excluded from its shard: %s; it stops serving (the "
                  "shard lives on its other copies)", self.index, why)
        with self.clock.lock:
            self.clock.failure = Fenced(f"parameter server {self.index} was excluded: {why}")
            self.clock.lock.notify_all()
        self.done.set()

    def look(self, views: Views) -> None:
        """(The beat thread.) Adopts a newer view from the store: a server that the others
        replaced while it was stopped learns here that it is fenced out, even if nobody
        talks to it. Never waits for the lock: an update in progress finds out itself."""
        if self.fenced or self.view is None:
            return
        newest = views.newest(self.view)
        if self.joining:  # the view change of a join whose last step never reached us
            if self.installed and self.index in newest.members:
                self.accept(newest)
            return
        if self.clock is None:
            return
        if newest.epoch > self.view.epoch and self.clock.lock.acquire(blocking=False):
            try:
                self._adopt(newest)
            finally:
                self.clock.lock.release()

    def accept(self, view: View) -> None:
        """(A joiner.) Its copy is installed and ``view`` holds it: it serves from now on."""
        with self.clock.lock:
            if self.joining and self.index in view.members:
                self.view, self.joining = view, False
                self.endpoint.raise_fence(view.epoch)
                self.joined.set()

    def _stats(self, worker: int, args: dict) -> dict:
        if self.clock is None:
            return {"server": self.index, "version": 0}
        out = {"server": self.index, "lo": self.lo, "hi": self.hi, **self.clock.counters()}
        if self.replicas > 1:
            with self.clock.lock:  # a whole update or none of it
                out["digest"] = hashlib.sha256(self.params.tobytes()).hexdigest()[:16]
                out["view"] = [self.view.epoch, list(self.view.members)]
        return out

    # ------------------------------------------------------------------ checkpoints
    def _save(self, worker: int, args: dict) -> dict:
        path = checkpoint_path(args["directory"], self.shard)
        os.makedirs(args["directory"], exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        # Under the clock's lock: no update can land between the parameters, the optimizer
        # state and the clock that go into one file.
        with self.clock._cv:
            state = self.optimizer.state_dict()
            arrays = {f"opt.{k}": np.asarray(v) for k, v in state.items()}
            np.savez(tmp, params=self.params, spec=json.dumps(self.spec, sort_keys=True),
                     clock=json.dumps(self.clock.state()), bounds=np.array([self.lo, self.hi]),
                     **arrays)
        os.replace(tmp, path)
        return {"path": path, "version": self.clock.version}

    def _load(self, path: str) -> None:
        try:
            data = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            raise ValueError(f"parameter server {self.index}: no checkpoint at {path}") from None
        saved = json.loads(str(data["spec"]))
        mine = {k: v for k, v in self.spec.items() if k != "restore"}
        saved.pop("restore", None)
        if saved["numels"] != mine["numels"] or list(data["bounds"]) != [self.lo, self.hi]:
            raise ValueError(f"{path} holds another model or sharding (saved bounds "
                             f"{list(data['bounds'])}, this server {[self.lo, self.hi]}); "
                             f"restore with the same model and number of servers")
        self.params[:] = data["params"]
        state = {k[4:]: (data[k] if data[k].ndim else data[k].item())
                 for k in data.files if k.startswith("opt.")}
        self.optimizer.load_state_dict(state)
        self.clock.restore(json.loads(str(data["clock"])))
        self.meta[0] = self.clock.version
        log.info("parameter server %d restored version %d from %s", self.index,
                 self.clock.version, path)

    # ------------------------------------------------------------------ leaving
    def _bye(self, worker: int, args: dict) -> dict:
        with self._cv:
            self._left.add(worker)
        if self.clock is not None:
            try:
                self.clock.leave(worker, died=False)
            except Fenced:  # the round it closed was refused: this copy has stopped
                pass
        return {}

    def _disconnected(self, worker: int, error) -> None:
        if worker >= self.workers:
            return  # another server (a primary forwarding to this copy) went away
        with self._cv:
            self._gone.add(worker)
            if worker in self._left:
                self._maybe_done()
                return
            self._lost.add(worker)
            self._cv.notify_all()
        mode = self.clock.mode if self.clock else "set-up"
        log.warning("parameter server %d lost worker %d (%s); %s", self.index, worker,
                    error or "connection closed without bye",
                    "the job cannot go on (sync mode)" if mode == "sync" else
                    f"training goes on without it ({mode} mode)")
        if self.clock is not None:
            try:
                self.clock.leave(worker, died=True)
            except Fenced:  # the round it closed was refused: this copy has stopped
                pass
        with self._cv:
            self._maybe_done()

    def _maybe_done(self) -> None:
        """(Holding ``_cv``.) The server is done once every worker has disconnected."""
        if len(self._gone) >= self.workers:
            self.done.set()

    def outcome(self) -> tuple[int, str | None]:
        """(``serve``, once ``done``.) The exit status and, for 1, why.

        A replicated server's workers all disconnecting is not the end of the job by
        itself: the workers also drop a server that the shard's newest view no longer holds
        (they moved the shard to a newer view when it fell silent, and a worker writes that
        view before it drops its connection: ``client._failover``). In ``async`` mode a lost
        worker fails nothing, so such a server, stopped and woken, found every worker gone
        and ended with status 0 unless its own look at the views came first; the launcher
        restarts only a server that failed, and the shard stayed one copy short. So the
        server reads the newest view before it decides: excluded, it ends with status 1 and
        is started again to rejoin."""
        if self.replicas > 1 and not self.fenced and self.clock is not None \
                and self.view is not None and not self.joining:
            # Bounded: an update in progress that holds the lock finds the view itself.
            if self.clock.lock.acquire(timeout=self.connect_timeout):
                try:
                    self._adopt(self.views.newest(self.view))
                except (GradsyncError, RuntimeError, OSError) as exc:
                    # The store is gone: the job is ending, and nobody is left to replace it.
                    log.debug("parameter server %d: no look at the views at its end: %s",
                              self.index, exc)
                finally:
                    self.clock.lock.release()
        if self.fenced:
            return 1, (f"it was excluded from shard {self.shard} while the job went on: "
                       f"{self.fenced}")
        failure = self.clock.failure if self.clock else None
        if failure is not None:
            return 1, str(failure)
        return 0, None


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class StoreGate:
    """The store connections of a server's threads, shut at its exit (``close``).

    A torch TCPStore request runs in C++ with the GIL released, and a Python thread that
    comes back from one while the interpreter finalizes is ended in a way that aborts the
    process: ``terminate called without an active exception``, status 134 instead of the
    server's own (abort_watch.py explains it for the World's watch). A server ends while
    other threads may be in such a request: its beat thread (a beat, a look at the views, a
    look for join requests), a join thread, a push's thread watching a backup's beats. The
    chaos soak saw it twice, at the end of a job and for a fenced server.

    Every store the server's threads use is wrapped (``wrap``); each call is counted in and
    out. ``close`` waits until no call is in progress and holds every later call at the gate
    for good: no thread enters torch's C++ once the server has ended, and the process ends
    with the threads waiting there. A call that waits on a key nobody sets (a view whose
    proposer stopped between its claim and its write) keeps ``close`` waiting up to
    ``timeout`` only.
    """

    def __init__(self):
        self._cv = threading.Condition()
        self._inside = 0
        self.closed = False
        self.held = 0  # threads that called after the gate shut (tests watch it)

    def wrap(self, store) -> "_Gated":
        return _Gated(store, self)

    def enter(self) -> None:
        with self._cv:
            if self.closed:
                self.held += 1
                self._cv.notify_all()
                while True:  # until the process ends: this thread must not reach torch
                    self._cv.wait()
            self._inside += 1

    def leave(self) -> None:
        with self._cv:
            self._inside -= 1
            self._cv.notify_all()

    def close(self, timeout: float) -> bool:
        """Shuts the gate; True once no call is in progress (False: one still was after
        ``timeout`` seconds)."""
        with self._cv:
            self.closed = True
            return self._cv.wait_for(lambda: self._inside == 0, timeout)


class _Gated:
    """A store whose calls pass through a ``StoreGate``."""

    def __init__(self, store, gate: StoreGate):
        self._gated, self._gate = store, gate

    def __getattr__(self, name):
        attr = getattr(self._gated, name)
        if not callable(attr):
            return attr
        gate = self._gate

        def call(*args, **kwargs):
            gate.enter()
            try:
                return attr(*args, **kwargs)
            finally:
                gate.leave()
        return call


def serve_rank(config, env) -> int:
    """What a parameter-server rank does, whichever way it started (``python -m gradsync.ps``,
    or ``gradsync.init()`` under a foreign launcher): says who it is, then serves until every
    worker is done; returns the process's exit status."""
    # On the job's logger, as every rank's line of who it is (world.py's, a worker's).
    logging.getLogger("gradsync").info(
        "rank %d of %d on host %s (pid %d, local rank %s): parameter server %d of %d (each "
        "shard on %d of them), serving %d workers", env.rank, env.size, env.hostname,
        os.getpid(), env.local_rank, env.server_rank, env.servers, config.ps_replicas,
        env.workers)
    return serve(config, env)


def serve(config, env) -> int:
    """Runs this rank's parameter server until every worker is done; returns an exit status."""
    from ..cluster.rendezvous import Store
    from ..connect.world import listen_addr

    # Every store request of the server's threads passes a gate that its exit shuts (above).
    gate = StoreGate()
    store = gate.wrap(Store(env.store_addr, env.store_port, env.store_is_server, env.job_id,
                            config.connect_timeout, env.size))
    secret = env.secret or store.read_secret()  # worker 0 (rank 0) makes it
    index, replicas = env.server_rank, config.ps_replicas
    if env.servers % replicas:
        log.error("parameter server %d: %d servers cannot hold %d copies of each shard "
                  "(GRADSYNC_PS_REPLICAS must divide GRADSYNC_SERVERS)", index, env.servers,
                  replicas)
        return 1
    expect = set(range(env.workers))
    if replicas > 1:  # primaries reach their backups' regions
        expect |= {env.workers + s for s in range(env.servers) if s != index}
    endpoint = Endpoint(env.rank, env.hostname, secret, f"{env.job_id}.ps",
                        addr=listen_addr(config, env), expect=expect,
                        timeout=config.timeout, direct=config.transport != "tcp",
                        label=f"parameter server {index} (rank {env.rank})")
    stop = threading.Event()
    views = beats = None
    if replicas > 1:
        shard = shard_of(index, env.servers, replicas)
        views = Views(store, shard, env.servers, replicas, config.connect_timeout)
        private = gate.wrap(store.clone_private())
        beats = Beats(private, config.heartbeat_timeout)

    def locate(server: int) -> tuple[str, int]:
        info = json.loads(store.get(f"ps/server/{server}", config.connect_timeout))
        return info["addr"], info["port"]

    server = Server(index, env.servers, env.workers, endpoint, config.timeout,
                    config.connect_timeout, replicas, views, beats, locate)
    # A replicated server whose address is already published replaces a lost copy (the
    # launcher restarted its rank): it joins with a copy of its shard (join.py).
    replacing = replicas > 1 and store.check(f"ps/server/{index}")
    if replacing:
        # Its predecessor exited before the launcher started this process; if it was killed
        # after allocating its copy's regions, their names are still in /dev/shm and would
        # refuse ours (the chaos soak's second kill of one server: every join failed).
        stale = endpoint.clear_stale()
        if stale:
            log.warning("parameter server %d: removed %d shared-memory names its killed "
                     "predecessor left", index, len(stale))
        server.joining, server.view = True, views.newest()
        # Only a primary of that view or a newer one may copy the shard into it.
        endpoint.raise_fence(server.view.epoch)
    if replicas > 1:
        threading.Thread(target=_beat, args=(server, beats, Views(
            private, shard, env.servers, replicas, config.connect_timeout), private,
            config.heartbeat_interval, stop), daemon=True, name="gradsync-ps-beat").start()
    # The pid is for tools that signal a server (``gradsync bench chaos``): it no longer runs
    # a script of theirs that could say it (gradsync run starts it as ``python -m gradsync.ps``).
    store.set(f"ps/server/{index}", json.dumps({"addr": endpoint.addr, "port": endpoint.port,
                                                "host": env.hostname, "pid": os.getpid()}))
    try:
        if replacing and not join.wait_joined(server, store, env.workers,
                                              config.connect_timeout):
            return 0  # the workers finished before it could join: nothing to serve
        while not server.done.wait(1.0):
            # A replicated server that not every worker reaches (a replacement that joined, or
            # one still joining) learns from the store that the workers are done.
            if replicas > 1 and workers_done(store, env.workers):
                break
            record = store.read_abort()
            if record is not None and not server._greeted:
                raise GradsyncError(f"rank {record['rank']} reported before training started: "
                                    f"{record['message']}")
        status, why = server.outcome()
        if status:
            log.error("parameter server %d (rank %d) ends: %s", index, env.rank, why)
        if replicas > 1 and not server.fenced and len(server._gone) >= env.workers:
            # Every worker reached this member of the newest view (``outcome`` read it) and is
            # gone: they have all ended, those that died without closing their client too
            # (``workers_done``), in a job that failed (``sync``'s lost worker) as in one that
            # went on.
            try:
                store.set(FINISHED, str(index))
            except (GradsyncError, RuntimeError, OSError) as exc:  # the store is gone
                log.debug("parameter server %d: cannot say the workers are done: %s", index,
                          exc)
        return status
    except GradsyncError as exc:
        log.error("parameter server %d: %s", index, exc)
        return 1
    finally:
        stop.set()
        endpoint.close()
        if not gate.close(_EXIT_WAIT_S):
            log.warning("parameter server %d: a store request was still in progress %gs "
                        "after the server ended", index, _EXIT_WAIT_S)


def _beat(server: Server, beats: Beats, views: Views, store, interval: float,
          stop: threading.Event) -> None:
    """A replicated server's liveness counter, its look for newer views, and (a primary's)
    for replacements asking to join: at once, then every ``interval`` seconds.

    The first beat does not wait an interval. The server takes hellos and forwards as soon as
    its address is published, and the launcher's watch (``run/server_watch.py``) counts a
    counter that has not moved since its first look as standing still since then: a server
    cut off before its first beat (the partition test's, whose host went down 0.05 s after
    its beat thread started) was reported silent for its whole start-up, 3.8-7.8 s, when it
    had been silent 2.4 s."""
    handled: dict[int, str] = {}
    while True:
        try:
            beats.beat(server.index)
            server.look(views)
            join.serve_requests(server, store, handled)
        except Exception as exc:  # the store is gone: the job is ending
            log.debug("parameter server %d: beat failed: %s", server.index, exc)
            return
        if stop.wait(interval):
            return
