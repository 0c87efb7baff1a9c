"""A data server: prepares its share of each epoch's batches into slots the workers read.

A job started with ``GRADSYNC_DATA_SERVERS=D`` (``gradsync run -np W --data-servers D``) has its
last D ranks serve data: the ``gradsync.data.Loader(...)`` call on such a rank builds a
``DataServer`` around the user's dataset and transform and serves until every worker has
disconnected, then ends the process.

Vocabulary. A *stream* is what this server sends one worker: the worker's batches that this
server prepares (``plan.py``), epoch after epoch, numbered by a *sequence number* that only
grows. Each stream has ``prefetch`` *slots*, one region in shared memory set up once at the
worker's ``hello`` (``slots.<worker>``, ``prefetch * slot_bytes`` bytes; ``transport/regions.py``
lets a same-host worker copy from it directly and a remote one read it over TCP). Item ``k``
of a stream lies in slot ``k % prefetch``.

A step, seen from worker w:

1. ``start(epoch, done)``: w's batches of the epoch on this server join the end of w's stream.
2. The producer thread prepares items ahead of w, as long as w has *credit*: item ``k`` may be
   written only when w has released item ``k - prefetch`` (the slot's previous item). So a
   server runs at most ``prefetch`` batches ahead of each worker, and a slow worker holds back
   only its own stream.
3. The producer publishes each item it wrote in the stream's *slot table* (``slots.py``, a
   second small region, ``table.<worker>``): its sequence number, written last, after the
   bytes and what the worker needs (index in the epoch, sample ids, bytes).
4. A worker on this host polls the table for its next item, reads the slot's bytes straight
   into the buffer its tensors will view, and writes the count of items it has read into
   the table: that one-sided write frees the slot. That release is the credit. No message.
5. A worker on another host (or one told ``GRADSYNC_TRANSPORT=tcp``) cannot map the table:
   it calls ``take(seq, wait, send=True)``, which waits until item ``seq`` is ready and
   answers what it holds (index, sample ids, bytes) and how long it waited, with the slot's
   bytes attached (``regions.Attached``): they cross the connection once, straight into the
   worker's buffer; with ``count`` > 1 the items after ``seq`` that are prepared follow on
   the same reply, which waits until ``least`` of them are (a worker that holds batches asks
   for several at once: one request and one reply for them all, where a reply sent at its
   first ready item brings one batch whenever this server is the slower side; the producer
   wakes the take once they are, not at every item). The worker keeps a few takes in flight
   on its connection (``roads.py``), which this server's serving thread answers one after
   the other: a take without ``seq`` answers the item after those the one before it
   answered, so the next take already waits here when a batch becomes ready, and the round
   trip is hidden behind the batches the worker reads meanwhile. A take releases the items
   before its ``release`` (default ``seq``): those whose bytes are in the worker's buffers
   when it was sent. A take waits at most ``wait`` seconds and then answers with the items
   ready, or ``pending`` when there are none (the worker asks again; a take already behind
   it asks for the same item): so every call is answered within a fraction of the
   heartbeat timeout while this server runs, and a worker that hears nothing for that long
   knows the server is stopped or cut off, not slow (``liveness.py``).

Liveness. A beater counts up the *beat* word of every stream's slot table each
``heartbeat_interval`` (the native thread of ``beater.py``, which needs no GIL, so that a
producer in a long C call does not silence the server; a Python thread where the compiled
module is not built); a same-host worker that sees it stand still for ``heartbeat_timeout``
gives this server up (a stopped process beats no more). A worker on another host watches the
replies instead: ``ping`` when it has nothing in flight, and every call answered promptly.

Producers (``producers.py``): one thread prepares the items by default; with ``producers``
K > 1 (``gradsync run --data-workers K``) K helper processes (or threads) prepare up to K
items at once, each item by exactly one of them, with this process's one cache.

Preparing a sample: the decoded sample comes from the cache (``cache.py``) or from
``dataset[i]`` (and then goes into the cache while the budget lasts); the transform is then
applied with a generator seeded by (seed, epoch, sample id), so that augmentation is random
across epochs but the same for a seed whatever the number of servers, workers or cache hits.
The batch is the samples' stack (``layout.py``), or what the Loader's ``collate`` makes of
them (``collate.py``: padding, packing), in a slot of the collate's fixed upper size.

Failures: a sample that the dataset or transform cannot prepare fails every later ``take`` with
an error naming it (the workers raise it); the tables say so too (``SlotTable.fail``), and a
polling worker that finds its next item missing then makes that ``take`` for the message. A
worker whose connection ends is done with this server; the server ends when every worker has
connected and gone. In an elastic job (``gradsync run --min-np/--max-np --data-servers D``)
workers come and go while the job runs: the server admits any worker id, each once (a worker's
id is not its rank there: ``server_links.unique_id``), goes on when workers leave, and ends
when the launcher writes ``data/end`` in the job's store, after every worker has ended. When
the job's workers re-form (``Loader.reset``, elastic mode), each worker's next ``start``
carries the new *generation*, its number of workers and the worker's place among them: the
server drops the items of that worker's stream that it has not taken and plans the rest of the
epoch for the new count, so a lost worker's unacknowledged share goes to the others. When
another data server is lost, each worker hands the batches it has not received from it to the
servers left (``start`` with ``items``): they join the end of that worker's stream here like
any other, decoded from the dataset (this server's cache keeps them only while its budget
lasts). A data server that the elastic launcher starts again in its slot counts itself in the
store (its *incarnation*, answered in every ``hello``) before it publishes its address, then
writes its *ready record*: the workers agree on the epoch from which it serves them all
(``returns.py``), and each says hello to it then, as to any server.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import sys
import threading
import time

import numpy as np

from ..errors import CollectiveMismatchError, GradsyncError, GradsyncTimeoutError
from ..liveness import beater
from ..transport.regions import Attached, Endpoint
from .cache import Cache
from .layout import Layout, leaves_of
from .plan import Batch, plan, unpack_mask, worker_batches
from .producers import KINDS, Batcher, start_helpers
from .returns import ready_key, ready_record
from .slots import SlotTable, table_words

__all__ = ["Source", "DataServer", "serve", "ELASTIC_KEY", "END_KEY"]

log = logging.getLogger("gradsync.data")
_SWITCH_INTERVAL = 0.0002  # seconds: see serve()
# How often the producer looks at a polling worker's ack while every stream is out of
# credit: a first nap, doubled on each idle look up to the last (a worker's ack is a store to
# shared memory, which wakes nobody; a nap never spins the core the worker may need).
_ACK_NAPS = (0.0001, 0.002)


def takes_rng(transform) -> bool:
    """Whether ``transform`` is called with the generator, ``transform(sample, rng)``: it
    can take two positional arguments. One that takes one, ``transform(sample)`` (a
    torchvision transform's ``__call__``), draws nothing from it, and seeding a generator
    per sample is the largest cost of a cheap sample (30-60 us: docs/data.md, "Where a
    batch's time goes"). Unknown (a signature Python cannot read): the generator."""
    try:
        params = list(inspect.signature(transform).parameters.values())
    except (TypeError, ValueError):
        return True
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) >= 2


class Source:
    """The user's dataset and transform, behind the cache: what prepares one sample.

    Args:
        dataset: supports ``len()`` and ``dataset[i]`` (a map-style torch ``Dataset``).
        transform: ``transform(sample, rng)`` returns the sample to serve; ``rng`` is a
            ``numpy.random.Generator`` seeded by (seed, epoch, sample id); or
            ``transform(sample)``, which is given no generator (``takes_rng``). None: as
            decoded.
        seed: the job's data seed.
        cache: where decoded samples are kept between epochs.
        collate: makes a batch of samples whose shapes vary (``collate.py``); None: every
            sample has the first one's shapes and a batch is their stack (``layout.py``).
    """

    def __init__(self, dataset, transform, seed: int, cache: Cache, collate=None):
        self.dataset, self.transform, self.seed, self.cache = dataset, transform, seed, cache
        self.collate = collate
        self.rng = transform is not None and takes_rng(transform)

    def decoded(self, sample_id: int):
        """``dataset[sample_id]``, from the cache when it is there."""
        sample = self.cache.get(sample_id)
        if sample is None:
            sample = self.dataset[sample_id]
            self.cache.put(sample_id, sample, sum(leaf.nbytes for leaf in leaves_of(sample)))
        return sample

    def served(self, sample, sample_id: int, epoch: int):
        """The transformed sample."""
        if self.rng:
            return self.transform(sample, np.random.default_rng([self.seed, epoch, sample_id]))
        if self.transform is not None:
            return self.transform(sample)
        return sample

    def prepared(self, sample, sample_id: int, epoch: int) -> list[np.ndarray]:
        """The leaves of the transformed sample."""
        return leaves_of(self.served(sample, sample_id, epoch))

    def first(self):
        """Sample 0 as served in epoch 0."""
        return self.served(self.dataset[0], 0, 0)

    def layout(self) -> Layout:
        """The layout of sample 0 as served in epoch 0 (every sample must match it)."""
        return Layout.of(self.first())


class _Stream:
    """One worker's batches from this server, and its slots."""

    def __init__(self, slots: np.ndarray, prefetch: int, table: SlotTable, lock):
        self.slots, self.prefetch, self.table = slots, prefetch, table
        # The take waiting on this stream (a worker's takes are answered one at a time)
        # waits on ``answer``, under the server's lock, until ``produced`` reaches
        # ``awaited``: the producer wakes it then, not at every item (``_take``).
        self.answer = threading.Condition(lock)
        self.awaited = 0
        self.items: list[tuple[int, Batch]] = []   # (epoch, batch) by sequence number
        self.nbytes: list[int] = []                # bytes written, by sequence number
        self.produced = 0    # items written into slots: every item before it
        self.claimed = 0     # items handed to a producer: every item before it
        self.inflight: set[int] = set()  # items a producer is writing
        self.finished: set[int] = set()  # items written, not yet counted in ``produced``
        self.released = 0    # items the worker has finished reading
        self.answered = 0    # the next item a take without ``seq`` answers (``_take``)
        self.gone = False
        self.generation = 0  # of the job's membership, as the worker's last start said
        # The worker takes the bytes over the connection (a take with ``send``): its reads
        # free slots only with a take, which wakes the producers, never by an ack in the table.
        self.remote = False

    @property
    def busy(self) -> bool:
        """A producer is writing an item of this stream."""
        return bool(self.inflight)

    def refresh(self) -> None:
        """Takes in the polling worker's ack: the items it has read free their slots. (An
        ack beyond what was published would be a broken worker's; it frees nothing more.)"""
        self.released = max(self.released, min(self.table.acked(), self.produced))

    def waits_for_credit(self) -> bool:
        """Items are queued but every slot holds one the worker has not read, and only the
        worker's ack in the table can free one (the producer looks for it: ``_produce``)."""
        return (not self.gone and not self.remote and self.claimed < len(self.items)
                and self.claimed - self.released >= self.prefetch)

    def can_produce(self) -> bool:
        self.refresh()
        return (not self.gone and self.claimed < len(self.items)
                and self.claimed - self.released < self.prefetch)

    def finish(self, seq: int) -> None:
        """Item ``seq`` is written: ``produced`` counts it once every earlier one is."""
        self.inflight.discard(seq)
        self.finished.add(seq)
        while self.produced in self.finished:
            self.finished.discard(self.produced)
            self.produced += 1


class DataServer:
    """One data server of a job.

    Args:
        index: this server's index, 0 .. servers-1.
        servers, workers: how many of each the job has.
        endpoint: this server's region endpoint (workers connect to it).
        source: the dataset, transform and cache.
        batch_size, seed: as the ``Loader`` was built (workers must agree).
        timeout: seconds a ``take`` may wait for its batch.
        elastic: the workers come and go (an elastic job): the server does not end when
            they have all gone.
        beat: seconds between beats in the slot tables (the ``heartbeat_interval``; 0: no
            beats, for a job whose heartbeats are off).
        order: how the epoch's batches are cut (``plan.ORDERS``; workers must agree).
        producers: items prepared at once (``producers.py``; the ``data_workers`` setting).
        producer: ``"process"`` (each producer a forked helper process) or ``"thread"``;
            with one producer, this server's own thread prepares every item.
    """

    def __init__(self, index: int, servers: int, workers: int, endpoint: Endpoint,
                 source: Source, batch_size: int, seed: int, timeout: float = 300.0,
                 elastic: bool = False, beat: float = 0.0, order: str = "servers",
                 producers: int = 1, producer: str = "process"):
        if producers < 1:
            raise ValueError(f"a data server needs at least 1 producer, got {producers}")
        if producer not in KINDS:
            raise ValueError(f"producer must be one of {KINDS}, got {producer!r}")
        self.index, self.servers, self.workers = index, servers, workers
        self.elastic = elastic
        self.endpoint, self.source, self.timeout = endpoint, source, timeout
        self.batch_size, self.seed, self.order = batch_size, seed, order
        self.samples = len(source.dataset)
        if self.samples < 1:
            raise ValueError("the dataset is empty")
        # The batch's shape, what the workers need to read one: the layout of the samples'
        # stack, or a collate's spec (then the slot holds the largest batch it can make).
        self.collate = source.collate
        self.layout: Layout | None
        if self.collate is None:
            self.layout = source.layout()
            self.spec = self.layout.describe()
            self.slot_bytes = max(1, batch_size * self.layout.sample_bytes)
        else:
            self.layout = None
            self.spec = self.collate.learn(source.first())
            self.slot_bytes = max(1, int(self.collate.slot_bytes(self.spec, batch_size)))
        self.batcher = Batcher(source, self.layout, self.spec)
        # Forked before this server's own threads start (the endpoint's already run: the
        # helpers touch none of their locks, only the dataset, the transform and a pipe).
        self._helpers = (start_helpers(self.batcher, producers, self.slot_bytes)
                         if producers > 1 and producer == "process" else [])
        self.streams: dict[int, _Stream] = {}
        # Which process of this index this is (``returns.py``): 1, or the count of processes
        # that published before it plus one in an elastic job (``serve`` sets it before the
        # address is published, so every hello answers it).
        self.incarnation = 1
        self.failure: str | None = None
        self.batches_served = 0
        self.takes = 0  # take calls answered (the workers that poll make none)
        self.sent = 0  # of them, answered with the batch's bytes attached
        # (generation, epoch) -> ((done digest, workers), plan)
        self._plans: dict[tuple[int, int], tuple[tuple[str, int], list[Batch]]] = {}
        self._seen: set[int] = set()
        self._started: set[int] = set()
        # One lock for the server's state; the producers wait on ``_cv``, a take on its
        # stream's ``answer``.
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._stop = False
        self.done = threading.Event()
        self._closing = threading.Event()
        for method in ("hello", "start", "take", "stats", "ping"):
            endpoint.on_call(method, getattr(self, "_" + method))
        endpoint.on_disconnect(self._disconnected)
        self._turn = 0  # the worker whose stream a producer looks at first (round robin)
        self._producers = [
            threading.Thread(target=self._produce,
                             args=(self._helpers[k] if self._helpers else None,), daemon=True,
                             name=f"gradsync-data-server{index}" + (f".{k}" if k else ""))
            for k in range(producers)]
        for thread in self._producers:
            thread.start()
        self._beater = None  # the Python beater thread, where there is no native one
        self._beats = beater.start(beat) if beat > 0 else None
        if beat > 0 and self._beats is None:
            self._beater = threading.Thread(target=self._beat, args=(beat,), daemon=True,
                                            name=f"gradsync-data-beat{index}")
            self._beater.start()

    # ------------------------------------------------------------------ control methods
    def _hello(self, worker: int, args: dict) -> dict:
        mine = {"batch_size": self.batch_size, "seed": self.seed, "samples": self.samples,
                "order": self.order,
                "collate": None if self.collate is None else self.collate.describe()}
        theirs = {k: args.get(k) for k in mine}
        theirs["order"] = args.get("order", "servers")  # the default cut says nothing
        if theirs != mine:
            diff = sorted(k for k in mine if mine[k] != theirs[k])
            raise CollectiveMismatchError(
                f"worker {worker}'s Loader differs from data server {self.index}'s in "
                f"{', '.join(diff)} (worker: { {k: theirs[k] for k in diff} }, server: "
                f"{ {k: mine[k] for k in diff} }): every rank must build the same Loader")
        prefetch = int(args["prefetch"])
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        with self._cv:
            if worker in self.streams:
                raise ValueError(f"worker {worker} said hello twice to data server {self.index}")
            slots = self.endpoint.allocate(f"slots.{worker}", (prefetch, self.slot_bytes),
                                           np.uint8)
            words = self.endpoint.allocate(f"table.{worker}",
                                           (table_words(prefetch, self.batch_size),), np.int64)
            table = SlotTable(words, prefetch, self.batch_size)
            if self._beats is not None:
                table.beaten_by(self._beats)
            if self.failure is not None:
                table.fail()
            self.streams[worker] = _Stream(slots, prefetch, table, self._lock)
            self._seen.add(worker)
        return {"layout": self.spec, "slot_bytes": self.slot_bytes,
                "server": self.index, "incarnation": self.incarnation}

    def _start(self, worker: int, args: dict) -> dict:
        """Appends ``worker``'s batches of ``args["epoch"]`` on this server to its stream: its
        share of the plan, or ``args["items"]`` (``[[index, [ids]], ...]``), batches of a lost
        data server that the worker hands to this one."""
        epoch, done = int(args["epoch"]), args.get("done")
        generation = int(args.get("generation", 0))
        wait = args.get("wait")
        with self._cv:
            if generation > self._stream(worker).generation and not self._regenerate(
                    worker, generation, int(args["seq"]),
                    None if wait is None else time.monotonic() + float(wait)):
                # The producer is still writing into this stream (a slow batch): nothing
                # changed, the worker asks again (and this server never goes quiet for it).
                return {"pending": True}
        if args.get("items") is not None:
            adopted = [Batch(int(g), self.index, worker, np.asarray(ids, dtype=np.int64))
                       for g, ids in args["items"]]
            if any(len(b.ids) == 0 or b.ids.min() < 0 or b.ids.max() >= self.samples
                   for b in adopted):
                raise ValueError(f"worker {worker} handed data server {self.index} a batch "
                                 f"with sample ids outside 0 .. {self.samples - 1}")
            with self._cv:
                stream = self._stream(worker)
                stream.items.extend((epoch, b) for b in adopted)
                stream.nbytes.extend([0] * len(adopted))
                self._cv.notify_all()
            return {"batches": len(adopted)}
        digest = hashlib.sha256((done or "").encode()).hexdigest()[:16]
        # A generation's plan: its number of workers, and this worker's place among them
        # (both as at the job's start unless the job re-formed).
        workers = int(args.get("workers", self.workers))
        place = int(args.get("index", worker))
        with self._cv:
            stream = self._stream(worker)
            key = (generation, epoch)
            known = self._plans.get(key)
            if known is not None and known[0] != (digest, workers):
                raise CollectiveMismatchError(
                    f"worker {worker} started epoch {epoch} from another state (or number of "
                    "workers) than an earlier worker of its generation did: every worker must "
                    "load the same state_dict")
            if known is None:
                mask = unpack_mask(done, self.samples) if done else None
                known = ((digest, workers), plan(self.samples, self.batch_size, self.seed,
                                                 epoch, self.servers, workers, mask,
                                                 self.order))
                self._plans = {k: p for k, p in self._plans.items()
                               if k >= (generation, epoch - 1)}
                self._plans[key] = known
            mine = worker_batches(known[1], place, self.index)
            stream.items.extend((epoch, b) for b in mine)
            stream.nbytes.extend([0] * len(mine))
            if worker not in self._started:
                # The worker mapped its slots right after its hello, before any start: the
                # name can go, so a crash from here on leaves nothing in /dev/shm.
                self._started.add(worker)
                self.endpoint.unlink(f"slots.{worker}")
                self.endpoint.unlink(f"table.{worker}")
            self._cv.notify_all()
            return {"batches": len(mine)}

    def _regenerate(self, worker: int, generation: int, seq: int,
                    patience: float | None = None) -> bool:
        """(Under ``_cv``.) ``worker`` is a member of a new generation of the job (an elastic
        job re-formed): the items of its stream from ``seq`` on, the ones it has not taken,
        belong to the old plan and go; the new generation's batches follow from ``seq``.
        Every item before ``seq`` has been read (the worker's fetching has stopped), so
        every slot is free. False, with nothing changed, when the producer is still writing
        into the stream at ``patience`` (a ``time.monotonic()``; None: wait for it)."""
        stream = self._stream(worker)
        while stream.busy:  # a producer is writing into one of its slots: let it finish
            left = 1.0 if patience is None else patience - time.monotonic()
            if left <= 0:
                return False
            self._cv.wait(min(left, 1.0))
        stream.refresh()
        # The worker can only have taken items that were prepared.
        if not stream.released <= seq <= stream.produced:
            raise ValueError(f"worker {worker} restarted its stream of data server "
                             f"{self.index} at item {seq}; it can have taken items up to "
                             f"{stream.produced - 1}, and has released those before "
                             f"{stream.released}")
        del stream.items[seq:], stream.nbytes[seq:]
        stream.produced = stream.released = stream.claimed = stream.answered = seq
        stream.finished.clear()
        stream.generation = generation
        # The items published from ``seq`` on were the old plan's: a polling worker must not
        # find them. (It polls again only after this start's reply.)
        stream.table.clear()
        return True

    def _take(self, worker: int, args: dict) -> dict | Attached:
        """Item ``seq`` of the worker's stream (or, without ``seq``, the next one after
        those the last take answered: a worker's pipelined takes, of which the one before
        may have answered "pending"), with the ready items after it up to ``count`` when
        ``send``, once ``least`` of them are ready; releases the items before ``release``
        (default ``seq``)."""
        end = time.monotonic() + self.timeout * 0.9  # answer before the worker's socket gives up
        # ``wait``: the worker's bound (a fraction of its heartbeat timeout), after which the
        # answer is ``pending`` (or what is ready): a slow batch is never taken for a silent
        # server.
        wait = args.get("wait")
        patience = end if wait is None else min(end, time.monotonic() + float(wait))
        send = bool(args.get("send"))
        with self._cv:
            stream = self._stream(worker)
            stream.refresh()
            seq = int(args["seq"]) if "seq" in args else stream.answered
            # Every item before ``release`` has been read: its slot is free. A pipelined
            # take names fewer than it asks for (the worker has not yet received the items
            # the takes before it answer), so the server never runs more than ``prefetch``
            # items ahead of what the worker holds.
            release = int(args.get("release", seq))
            if not stream.released <= release <= seq < len(stream.items):
                raise ValueError(f"worker {worker} asked data server {self.index} for item "
                                 f"{seq}, releasing those before {release}; its stream holds "
                                 f"items {stream.released} .. {len(stream.items) - 1}")
            stream.released, stream.answered = release, seq
            stream.remote = stream.remote or send
            self._cv.notify_all()
            # ``count``: a worker on another host takes up to this many items at once (its
            # window, ``data_window``), and the reply waits until ``least`` of them are
            # ready (the items after ``seq`` that exist in the stream now: no take waits for
            # an epoch not started). A worker that has batches in hand asks for several
            # (``roads.Roads._post``): one request, one reply and one parse bring them
            # all, where a reply sent as soon as its first item is ready brings one batch
            # when the server is the slower side (its next items are still to come).
            most = min(seq + max(1, int(args.get("count", 1))), len(stream.items)) \
                if send else seq + 1
            enough = min(seq + max(1, int(args.get("least", 1))), most)
            arrived, ready = time.monotonic(), stream.produced >= enough
            while stream.produced < enough:
                now = time.monotonic()
                if stream.produced > seq and (now >= patience or self.failure is not None):
                    break  # what is ready goes; a failure is the next take's answer
                if self.failure is not None:
                    raise GradsyncError(self.failure)
                if patience < end and now >= patience:
                    # The next take without ``seq`` asks for this item again.
                    return {"pending": True, "waited": now - arrived}
                if now >= end:
                    raise GradsyncTimeoutError(f"data server {self.index} did not prepare "
                                               f"worker {worker}'s item {seq} within "
                                               f"{self.timeout * 0.9:.0f}s")
                stream.awaited = enough
                try:
                    stream.answer.wait(max(0.0, min(end - now, patience - now, 1.0)))
                finally:
                    stream.awaited = 0
            self.takes += 1  # answered with its item (a pending answer is no take)
            epoch, batch = stream.items[seq]
            slot, nbytes = seq % stream.prefetch, stream.nbytes[seq]
            # ``waited``: how long the batches it waited for were still being prepared (the
            # rest of the call's time is the transport's: Loader.transfers()).
            info = {"seq": seq, "slot": slot, "nbytes": nbytes, "epoch": epoch,
                    "index": batch.index, "ids": batch.ids.tolist(),
                    "waited": 0.0 if ready else time.monotonic() - arrived}
            more, last = [], seq
            if send:
                while last + 1 < most and stream.produced > last + 1:
                    last += 1
                    e, b = stream.items[last]
                    more.append({"nbytes": stream.nbytes[last], "epoch": e, "index": b.index,
                                 "ids": b.ids.tolist()})
                self.sent += 1 + len(more)
            stream.answered = last + 1
        if send:
            if more:
                info["more"] = more
            # The bytes follow the answer on the connection, sent from the slots: items
            # ``seq`` .. ``last`` stay unreleased (their slots unwritten) until a take
            # releases them, which the worker sends only once these bytes are in its
            # buffer.
            return Attached(info, [stream.slots[k % stream.prefetch][:stream.nbytes[k]]
                                   for k in range(seq, last + 1)])
        return info

    def _ping(self, worker: int, args: dict) -> dict:
        """A worker's look at this server's liveness (``liveness.py``): an answer is all."""
        return {}

    def _stats(self, worker: int, args: dict) -> dict:
        with self._cv:
            served, takes, sent = self.batches_served, self.takes, self.sent
        return {"server": self.index, "batches": served, "takes": takes, "sent": sent,
                "producers": len(self._producers),
                **self.source.cache.counters()}

    def _stream(self, worker: int) -> _Stream:
        stream = self.streams.get(worker)
        if stream is None:
            raise ValueError(f"worker {worker} did not say hello to data server {self.index}")
        return stream

    # ------------------------------------------------------------------ the producer
    def _produce(self, helper=None) -> None:
        """(A producer thread; ``helper``: its helper process, ``producers.py``.) Writes
        items into free slots, taking the workers in turn."""
        nap = _ACK_NAPS[0]
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    ready = sorted(w for w, s in self.streams.items() if s.can_produce())
                    if ready:
                        break
                    # A polling worker's ack wakes nobody: look again soon while a stream
                    # waits only for it; a call (start, take) notifies at once.
                    if any(s.waits_for_credit() for s in self.streams.values()):
                        self._cv.wait(nap)
                        nap = min(2 * nap, _ACK_NAPS[1])
                    else:
                        self._cv.wait(1.0)
                nap = _ACK_NAPS[0]
                # The next worker in turn after the last one served: no stream starves.
                worker = next((w for w in ready if w >= self._turn), ready[0])
                self._turn = worker + 1
                stream = self.streams[worker]
                seq = stream.claimed
                stream.claimed += 1
                stream.inflight.add(seq)
                epoch, batch = stream.items[seq]
                generation = stream.generation  # ``_regenerate`` waits while busy
            try:
                slot = stream.slots[seq % stream.prefetch]
                ids = batch.ids.tolist()
                if helper is None:
                    nbytes = self.batcher.prepare(ids, epoch, slot)
                else:
                    nbytes = helper.prepare(self.source.cache, ids, epoch, slot)
                with self._cv:  # counted before a worker can see it (and then ask the stats)
                    self.batches_served += 1
                    stream.nbytes[seq] = nbytes
                # Published while still in flight, so a re-plan cannot clear the table
                # between.
                stream.table.publish(seq, generation, epoch, batch.index, nbytes, batch.ids)
            except Exception as exc:  # the user's dataset or transform: tell every worker
                log.error("data server %d: batch %d of epoch %d failed: %s: %s", self.index,
                          batch.index, epoch, type(exc).__name__, exc,
                          exc_info=helper is None)
                with self._cv:
                    if self.failure is None:
                        self.failure = (f"data server {self.index} could not prepare batch "
                                        f"{batch.index} of epoch {epoch}: "
                                        f"{type(exc).__name__}: {exc}")
                    stream.inflight.discard(seq)
                    self._stop = True
                    for other in self.streams.values():
                        other.table.fail()
                        other.answer.notify()
                    self._cv.notify_all()
                return
            with self._cv:
                stream.finish(seq)
                if stream.awaited and stream.produced >= stream.awaited:
                    stream.answer.notify()
                self._cv.notify_all()  # (a re-plan that waits for the stream not busy)

    # ------------------------------------------------------------------ liveness
    def _beat(self, interval: float) -> None:
        """Counts up every stream's beat word each ``interval`` while this process runs: a
        same-host worker that sees it stand still gives this server up (``liveness.py``).
        A thread of its own, so that a transform slow in Python still beats (the GIL changes
        hands every ``_SWITCH_INTERVAL``); a stopped process stops it with everything else."""
        while not self._closing.wait(interval):
            with self._cv:
                tables = [s.table for s in self.streams.values()]
            for table in tables:
                table.beat()

    # ------------------------------------------------------------------ ending
    def _disconnected(self, worker: int, error) -> None:
        with self._cv:
            stream = self.streams.get(worker)
            if stream is not None:
                stream.gone = True
            self._seen.add(worker)
            if error is not None:
                log.warning("data server %d lost worker %d: %s", self.index, worker, error)
            if not self.elastic and len(self._seen) >= self.workers and all(
                    s.gone for s in self.streams.values()):
                self._stop = True
                self._cv.notify_all()
                self.done.set()

    def close(self) -> None:
        self._closing.set()
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for thread in self._producers:
            thread.join(self.timeout)
        for helper in self._helpers:
            helper.close()
        if self._beater is not None:
            self._beater.join(self.timeout)
        if self._beats is not None:
            self._beats.close()


ELASTIC_KEY = "data/elastic"
"""Store key the elastic launcher sets before it starts the data servers: the job's workers
come and go (``DataServer``'s ``elastic``)."""
END_KEY = "data/end"
"""Store key the elastic launcher sets once every worker has ended: the data servers end."""


def serve(config, env, source: Source, batch_size: int, seed: int,
          order: str = "servers") -> int:
    """Runs this rank's data server until every worker is done (in an elastic job: until the
    launcher says the job is over); returns an exit status."""
    from ..connect.server_links import open_store, publish
    from ..connect.world import listen_addr
    from ..transport.regions import ANY_PEER

    index = env.data_server_rank
    # The producer runs the user's transform, often Python code that holds the GIL; the
    # thread that answers a worker's take would wait up to the default 5 ms switch interval
    # for it, on every batch. A waiting thread asks for the GIL after this interval, and a
    # lone producer pays nothing for it.
    sys.setswitchinterval(_SWITCH_INTERVAL)
    store = open_store(config, env)
    secret = env.secret or store.read_secret()  # worker 0 (rank 0) makes it in init()
    elastic = store.check(ELASTIC_KEY)
    endpoint = Endpoint(env.rank, env.hostname, secret, f"{env.job_id}.data",
                        addr=listen_addr(config, env),
                        expect=ANY_PEER if elastic else set(range(env.workers)),
                        timeout=config.timeout, direct=config.transport != "tcp",
                        label=f"data server {index} (rank {env.rank})")
    if elastic and store.check(f"data/server/{index}"):
        # A replacement: the launcher started this rank again after its predecessor exited
        # (``run/data_servers.py``). A SIGKILLed predecessor leaves the names of the slots it
        # had not yet unlinked in /dev/shm, which would refuse this process's own.
        stale = endpoint.clear_stale()
        log.warning("data server %d started again%s", index,
                    f"; removed {len(stale)} shared-memory names its predecessor left"
                    if stale else "")
    server = None
    try:
        server = DataServer(index, env.data_servers, env.workers, endpoint, source,
                            batch_size, seed, config.timeout, elastic=elastic,
                            beat=config.heartbeat_interval if config.heartbeat_timeout > 0
                            else 0.0, order=order, producers=config.data_workers,
                            producer=config.data_producer)
        if elastic:
            # Counted before the address is published, by the processes that get that far:
            # the workers take a replacement back from an agreed epoch on (``returns.py``).
            server.incarnation = store.add(f"data/incarnations/{index}", 1)
        publish(store, "data", index, endpoint)
        if elastic:
            store.set(ready_key(index), ready_record(server.incarnation, endpoint.host,
                                                     os.getpid()))
        log.info("rank %d on host %s (pid %d): data server %d of %d, serving %s", env.rank,
                 env.hostname, os.getpid(), index, env.data_servers,
                 "an elastic job's workers" if elastic else f"{env.workers} workers")
        while not server.done.wait(1.0):
            if elastic:
                # Each generation of an elastic job has a World (and an abort record) of its
                # own; a lost worker is the launcher's business, and the end is its word.
                if store.check(END_KEY):
                    break
                continue
            record = store.read_abort()
            if record is not None:
                raise GradsyncError(f"rank {record['rank']} failed: {record['message']}")
        return 1 if server.failure else 0
    except (GradsyncError, ValueError, TypeError) as exc:
        log.error("data server %d: %s", index, exc)
        return 1
    finally:
        if server is not None:
            server.close()
        endpoint.close()
