"""The worker's side of the data servers: an iterable used as a ``DataLoader`` is.

Every rank of the job runs the same script and builds the same ``Loader``. On a data-server
rank the constructor serves (``server.py``) and ends the process; on a worker it connects to
every data server and returns. Each ``iter(loader)`` is one epoch: the worker computes the
epoch's plan (``plan.py``), tells each server to queue its share, and takes the batches in plan
order, each into a fresh buffer that the yielded tensors view (or, with ``copy=False``, lending
the loop the server's slot itself). From a server on this host a batch comes without a
message, in the loop's own ``next()``, polled from the stream's slot table in shared memory;
from a server on another host by ``take`` calls whose replies carry the batches' bytes, the
next take sent while the batches in hand are used. Small batches are taken so by the loop's
own ``next()``; larger ones by a fetch thread up to ``prefetch`` ahead of the loop, whose
receipt of the bytes overlaps the training step. An ``iter()`` while an epoch is unfinished
(a loop left with ``break``) goes on with that epoch where it stopped.

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
A data server that dies, stops or is cut off is *lost*: its batches go to the others, each
sample still exactly once; in an elastic job the launcher starts it again and the workers
take it back at the start of an epoch they agree on.

The parts. This module holds the ``Loader``: its options, the epochs it starts and where the
data stand (``state_dict``, ``reset``, ``position``). It stands on ``server_set.py``
(``ServerSet``, its base: the links to the data servers, lost ones and returned ones),
``epoch.py`` (``Epoch``, one epoch's iterator: inline or with a fetch thread, borrowed
slots, the batches delivered) and ``roads.py`` (how one batch comes: the poll road on this
host, pipelined takes from another).
"""

from __future__ import annotations

import atexit
import collections
import threading
import time

import numpy as np

from ..errors import ConfigError, GradsyncTimeoutError, PeerLostError
from .epoch import INLINE_REPLY_BYTES, Epoch
from .plan import ORDERS, STATE_VERSION, Batch, pack_mask, plan, unpack_mask, worker_batches
from .returns import Return
from .server_set import ServerSet

__all__ = ["Loader", "STATE_VERSION"]

_TRANSFERS_KEPT = 4096  # batches whose fetch times ``transfers()`` keeps


class Loader(ServerSet):
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
        # Batches in flight per data server on another host (``Roads._call``): a server
        # never has more than ``prefetch`` of a stream prepared ahead, so no more can come.
        self.window = max(1, min(config.data_window, self.prefetch))
        # Takes in flight per data server on another host, sharing the window
        # (``Roads._post``).
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
        self._active: Epoch | None = None
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
        self._active = Epoch(self, epoch, work, orphans, done)
        return self._active

    def _ended(self, run: Epoch) -> None:
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


def _ids(arrays: list[np.ndarray]) -> list[int]:
    return np.concatenate(arrays).tolist() if arrays else []
