"""Negotiated execution: operations are matched across ranks by name, not by issue order.

The Horovod API lets ranks issue operations in different orders: rank 0 may start
``allreduce_async(a)`` then ``(b)`` while rank 1 starts ``b`` then ``a``, and an operation one
rank issues before a barrier may be matched by another rank's issued after it. A ``Controller``
makes that work for one World (the global process set's, or one process set's).

Vocabulary. A *request* is one rank's side of an operation: its name (``allreduce.grad.fc1``)
and its *signature* (``agreement.Signature``: kind, dtype, shape, reduce op, root, scale
factors, shared buffer), with the buffers and callables that run it. The controller's
progress thread runs *cycles*, a collective step of every rank of the World. In a cycle
every rank *announces* the requests its caller issued: a request whose name and signature are
in the response cache (it ran before) as a *vote* for its cache bit, every other one *in
full*. Each rank feeds what it learns to its ``agreement.Agreement``, the pure table that
decides what is ready (announced by every rank), in which *agreed order*, whether the ranks
agree on it and what has waited too long; from the same inputs every rank reaches the same
decisions, so no rank coordinates. This module moves the announcements (see Wire below) and
runs what is ready on the controller's progress thread, through the fusion stage.

The executor. A ``Controller`` is an ``executor.Serial``, the one executor of every front door,
with this front door's policy: its items are the requests its caller submits, and the progress
thread (``gradsync-negotiate-<label>``) runs them in cycles, not one by one: a cycle announces
every request queued since the last (``Serial._take``), and when nothing comes the thread
still cycles, as often as Idle cost below says (``_patience``; the cycle then runs as
``_run_idle``). The executor's lock (reentrant) also guards the controller's own state, so a
submit checks the name, registers the request and queues it in one step, and a cycle takes
the requests and the stop as they stand.

Errors. A ready operation whose signatures disagree (shape, dtype, op, root, scale factors;
for allgather and alltoall everything but the first dimension) does not run: every rank's
handle raises ``CollectiveMismatchError`` (a RuntimeError) naming what each rank issued, and
the World stays usable. A name is in use on a rank from the request until its handle is
synchronized (its first ``wait``); a second request with a name in use raises ValueError at
once. Horovod frees the name when the operation completes instead, which makes the outcome of
reusing it a race: a rank whose peers had announced the operation long before may see it
complete before its own next call, and then issues an operation the others never will
(Horovod's own duplicate-name tests depend on that race). A handle dropped without being
synchronized keeps its name until shutdown, as Horovod keeps its output; an owner that will
never wait (``DistributedOptimizer``'s buckets) calls ``Handle.release`` and the name is free
once the operation is done.

Join. A rank that runs out of data announces ``join``. From then on an operation is ready once
every rank that has not joined announced it; the joined rank runs a zero allreduce in its own
place (built from the others' signature), and any other kind fails with RuntimeError on the
ranks that issued it, as in Horovod. ``join`` itself is ready when every rank announced it,
and returns the rank whose announcement came last in agreed order.

Fusion (``fusion.py``, a stage of the pipeline after agreement). The requests ready in a
cycle go, in agreed order, to the controller's ``fusion.Fusion``, which cuts them into batches
(allreduces of one dtype, op and scale factors, up to ``fusion_threshold`` bytes; any other
request alone) and runs each allreduce batch as one collective of its fusion buffer. Every
rank cuts the same batches from the same ready names. Around each batch the controller keeps
its requests' books: it ends their ``QUEUE`` phase and starts their records before, and
finishes their handles (a result, or the batch's error) after.

Wire (``negotiation_wire.py``). A cycle is one *vote*: each rank's *ballot*
(``ballot.py``: a flags word and one bit per cache entry, at most 136 bytes) combined by a
bitwise AND in one recursive-doubling allreduce (on one host, a sum of rows through the
shared-memory group). A bit that survives is a cached operation every rank issued: ready.
A rank votes for its cached requests in every cycle until they are ready, so a steady-state
training step costs each rank at most ⌊log2 N⌋ + 1 messages of one ballot per cycle, not N
announcements (docs/scale.md counts it). Only when some rank has something to say in full (a name not cached, a
changed signature, rank 0's expired names: the vote's ``QUIET`` flag is lost) does the cycle
also *gather* every rank's full announcements, as ``(full, expire, waited)``. A cached request
goes in full instead of voting when the table already holds its name (another rank described
it, say with another signature: they must meet there), while some rank has joined, or when
it has waited as a bit for half of ``min(stall_warning, timeout)`` (the table then times it,
from when it was issued). Ready names run in one order on every rank: the voted ones by bit,
then the table's in agreed order. ``Controller.stats`` counts ``cycles`` and ``gathers``.

Idle cost (the executor's idle policy, ``_patience``). A World of one rank needs no cycles
(everything it issues is ready at once): its thread waits for a request. With more ranks the
cycles run back to back while requests arrive. A rank with nothing of its own in flight has
nothing to learn from a cycle (no operation can become ready without its announcement), so
its thread sleeps until its caller issues something, waking only every ``_HEARTBEAT`` (0.5 s)
for an empty cycle that keeps the other ranks' waiting exchanges within their deadline.
Between two training steps the controller so costs nothing: the step's first request wakes it
at once, and the other ranks' controllers are woken by their own requests. A rank with
operations in flight that are not ready yet (it waits for a slower rank, or it has joined)
cycles after 1 ms, doubling up to ``_MAX_IDLE`` (20 ms).

Stalls. An operation that some ranks issued and others never do would wait for ever: the
cycles go on, so no transport deadline fires. Rank 0's table times each name; after
``stall_warning`` seconds rank 0 logs the operation and the ranks it waits for (Horovod's
stall inspector), and after ``timeout`` seconds (``GRADSYNC_TIMEOUT``, the collective
deadline) it announces the name as expired. Every rank drops it in that same cycle, and the
ranks that issued it get ``CollectiveMismatchError`` naming the ranks that did not, so a rank
whose script diverged ends in an error, not a hang, and the others can go on. A cached name
reaches the table only once it goes in full (see Wire), with the seconds it waited as a bit,
so its warning and expiry keep these times too.

Flight recorder. Each request is recorded when issued (``flight_recorder.py``, on the
controller's track) and numbered when it runs, in agreed order: the Horovod API lets ranks
issue in different orders, so only the agreed order numbers a collective alike on every rank.
A request of this rank that has waited ``stall_report`` seconds gets a stall report
(``stall.py``): every rank that issued it and waits asks the others whether they have.

Shutdown. ``stop()`` asks for it in the next ballot (the ``STOP`` flag; ``Serial.wake`` ends
the thread's wait); the cycles end in the first in which every rank has asked, so no rank
leaves a cycle the others are still in. The executor is then shut (``Serial.shut``) and its
thread leaves; operations still in flight fail with RuntimeError.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..liveness import stall
from .agreement import JOIN, Agreement, ResponseCache, Signature, agreed, describe, mismatch_error
from .ballot import IDLE, QUIET, STOP, Ballot, bits_of
from ..collectives.ops import BFLOAT16
from .negotiation_wire import from_wire, gather, to_wire, vote
from .engine import Handle
from .executor import Serial
from .fusion import Fusion
from ..errors import CollectiveMismatchError, GradsyncError
from ..flight_recorder import Record, recorder

if TYPE_CHECKING:
    from ..connect.world import World

__all__ = ["Controller", "Request", "ResponseCache"]

log = logging.getLogger("gradsync")

_MIN_IDLE = 0.001
_MAX_IDLE = 0.02
_HEARTBEAT = 0.5

# torch's names of the collectives (the flight recorder's; a join is a barrier of sorts).
_TORCH_KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "broadcast": "broadcast",
                "alltoall": "all_to_all", "reducescatter": "reduce_scatter",
                "barrier": "barrier", JOIN: "barrier"}


class Request:
    """This rank's side of one named operation.

    Args:
        name: the full name, the same on every rank (``allreduce.grad.fc1``).
        kind: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``, ``reducescatter`` or
            ``barrier``.
        dtype: the dtype's name (``float32``, ``bfloat16``).
        shape: the tensor's shape.
        op: the reduce op's name, or None.
        root: the broadcast root (rank in the World), or None.
        scale: ``(prescale, postscale)``.
        flat: for allreduce, the flat array reduced in place (fusable).
        run: for the other kinds, ``run(world)`` performs the collective and returns the result.
        finish: turns what ran into the caller's result (allreduce: called with no argument;
            the others: called with ``run``'s result). Default: identity.
        counts: for an Adasum allreduce of several tensors packed in ``flat``, their sizes.
        shared: ``flat`` is the host's shared buffer (``ShmGroup.shared_buffer``).
    """

    __slots__ = ("name", "kind", "sig", "flat", "dtype_tag", "run", "finish", "handle", "joined",
                 "counts", "record")

    def __init__(self, name: str, kind: str, dtype: str, shape: tuple, *, op: str | None = None,
                 root: int | None = None, scale: tuple = (1.0, 1.0), flat=None, dtype_tag=None,
                 run: Callable | None = None, finish: Callable | None = None,
                 counts: list[int] | None = None, shared: bool = False):
        self.name, self.kind = name, kind
        self.sig = Signature(kind, dtype, tuple(int(d) for d in shape), op, root,
                             float(scale[0]), float(scale[1]), bool(shared))
        self.flat, self.dtype_tag = flat, dtype_tag
        self.run, self.finish = run, finish
        self.counts = counts
        self.handle = Handle(name)
        self.joined = False  # a stand-in for a rank that has joined (see Controller.announce_join)
        self.record: Record | None = None  # its flight recorder's record, once submitted


class Controller(Serial[Request]):
    """Negotiates and runs the named operations of one World: an ``executor.Serial`` whose
    items are this rank's requests, run in cycles (see the module docstring).

    Args:
        world: the World the operations run on (owned by the caller; not closed here).
        label: names the progress thread and appears in errors (``global``, ``process set 1``).
        ranks: the global rank of each rank of ``world`` (for messages).
        fusion_threshold: bytes of allreduces fused into one collective.
        timeline: a ``gradsync.timeline.Timeline`` or None; may be replaced at any time.
    """

    def __init__(self, world, label: str, ranks: list[int], fusion_threshold: int,
                 timeline=None):
        super().__init__(f"gradsync-negotiate-{label}", threading.RLock())
        self.world, self.label, self.ranks = world, label, list(ranks)
        if world.rank == 0:  # once per process set (and elastic generation), never per cycle
            log.info("Horovod API (%s, %d ranks): fusion threshold %d bytes (%.4g MiB)",
                     label, len(self.ranks), fusion_threshold, fusion_threshold / (1 << 20))
        self.timeline = timeline
        self.track = recorder.track(f"horovod:{world.env.job_id}", f"Horovod API ({label})",
                                    self.ranks, "horovod", world.config.timeout, world)
        self.owned_world: World | None = None
        """The World this controller was made for and closes after it stops (a process set's
        sub-world, ``torch/process_sets.py``), or None."""
        self.on_stand_in: Callable[[str], None] | None = None
        """Called with the name of each operation this rank joins in (or is excused from)
        without having issued it, while it is joined."""
        # The table is read and written by the progress thread only, so it needs no lock.
        self.agreement = Agreement(world.rank, self.ranks)
        self.cache = self.agreement.cache
        self._ballot = Ballot()  # this rank's cached requests, voted for until ready
        self.stats: collections.Counter[str] = collections.Counter()
        """``cycles``, ``gathers`` (cycles with full announcements), ``cached`` and ``full``
        (requests announced each way), ``demoted`` (voted, then announced in full),
        ``mismatches``, ``expired``, ``fused_batches``, ``fused_tensors`` (these two counted
        by the fusion stage)."""
        self.fusion = Fusion(world, fusion_threshold, self.stats)
        """The fusion stage: cuts the ready requests into batches and runs an allreduce batch
        (``fusion.py``); its buffers are reused from cycle to cycle."""
        # These three are guarded by the executor's lock (``self._lock``), with the queue.
        self._mine: dict[str, Request] = {}  # in flight
        self._unsynchronized: set[str] = set()  # done, handle not synchronized yet
        self._stop_requested = False
        self._idle_cycles = 0  # cycles in a row that ran nothing and heard nothing (_patience)
        self._shared_zeros: "np.ndarray | None" = None  # see _zeros
        self._stall_look = 0.0  # when the thread next looks for stalled requests (stall.py)
        stall.serve_named(world, self)
        self.start()  # it cycles from the start: the other ranks' first cycles wait for it

    # ------------------------------------------------------------------ caller's side
    def submit(self, request: Request) -> Handle:
        """Announces ``request`` in the next cycle; returns its Handle.

        Raises:
            ValueError: an operation with this name is in flight on this rank.
            RuntimeError: the controller has stopped (shutdown, or a failed World).
        """
        with self._lock:
            if self._closed is not None:
                raise self._closed
            if request.name in self._mine or request.name in self._unsynchronized:
                state = "in flight" if request.name in self._mine else "done but not synchronized"
                raise ValueError(
                    f"an operation named '{request.name}' is {state} on rank "
                    f"{self.ranks[self.world.rank]} ({self.label}); synchronize it before "
                    "issuing another with the same name, or give this one another name")
            self._mine[request.name] = request
            sig = request.sig
            request.record = self.track.issue(
                _TORCH_KINDS.get(request.kind, request.kind), request.name,
                sig.shape if sig.dtype != "none" else None, sig.dtype, numbered=False)
            request.handle.on_synchronized = lambda: self._synchronized(request.name)
            tl = self.timeline
            if tl is not None:
                tl.begin(request.name, f"NEGOTIATE_{request.kind.upper()}",
                         {"signature": describe(request.sig)})
            self.push(request)  # open (the lock is held since the check): it is queued
        return request.handle

    def announce_join(self) -> Handle:
        """Announces that this rank has joined (Horovod's ``join``; ``join``, the executor's,
        waits for the progress thread); the Handle returns the global rank that joined last,
        once every rank has. Meanwhile this rank contributes zeros to the others' allreduces,
        and their other operations fail (as in Horovod)."""
        return self.submit(Request(JOIN, JOIN, "none", ()))

    def stop(self, timeout: float | None = None) -> None:
        """Ends the cycles once every rank of the World has asked to (see the module
        docstring); waits up to ``timeout`` seconds for the progress thread to leave."""
        with self._lock:  # before the wake: a thread not waiting yet sees it (_patience)
            self._stop_requested = True
        self.wake()
        self.join(timeout)

    def issued(self, name: str) -> bool:
        """Whether this rank has issued ``name`` and not synchronized it yet (a stall report
        asks)."""
        with self._lock:
            return name in self._mine or name in self._unsynchronized

    def waiting(self) -> list[tuple[str, int]]:
        """This rank's requests not done yet: their names and when they were issued (the
        flight recorder's ``created_ns``)."""
        with self._lock:
            return [(q.name, q.record.created_ns) for q in self._mine.values()
                    if q.record is not None]

    @property
    def running(self) -> bool:
        """Whether the progress thread still runs (until every rank stopped, or a failure)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def cycles(self) -> int:
        """Cycles run so far (each one vote of every rank's ballot)."""
        return self.stats["cycles"]

    @property
    def gathers(self) -> int:
        """Cycles that also gathered full announcements (none in a steady state)."""
        return self.stats["gathers"]

    # ------------------------------------------------------------------ the policy
    def _patience(self) -> float | None:
        """How long the progress thread waits for a request before it cycles anyway (Idle
        cost in the module docstring); called with the lock held."""
        if self._stop_requested:
            return 0.0  # cycles back to back until every rank has asked
        if self.world.size == 1:
            return None  # no cycles: everything it issues is ready at once
        if not self._mine:
            return _HEARTBEAT  # nothing of ours in flight: a heartbeat only
        if self._idle_cycles:
            return min(_MIN_IDLE * (1 << min(self._idle_cycles - 1, 8)), _MAX_IDLE)
        return 0.0

    def _run(self, request: Request) -> None:
        self._turn([request])

    def _run_idle(self) -> None:
        self._turn([])

    def _turn(self, new: list[Request]) -> None:
        """One cycle (one turn of the progress thread): announces ``new`` and every other
        request queued since the last cycle, runs what is ready; on the last cycle, or a
        failure, shuts the executor (``_close``)."""
        try:
            with self._lock:
                new += self._take()
                stop = self._stop_requested
            if self.world.size == 1:  # everything it issues is ready at once
                outcome = None if stop else self.agreement.absorb(
                    [[(q.name, q.sig) for q in new]])
            else:
                outcome = self._cycle(new, stop)
            if outcome is None:  # every rank asked to stop
                self._close(RuntimeError(f"gradsync ({self.label}) has been shut down; the "
                                         "operation did not run"))
                return
            ready, busy = outcome
            self.stats["cycles"] += 1
            if self._mine and self.world.size > 1:
                self._look_for_stalls()
            if ready or busy:
                tl = self.timeline
                if tl is not None:
                    tl.cycle()
                self._idle_cycles = 0
                self._run_ready(ready)
            else:
                self._idle_cycles += 1
        except BaseException as exc:  # noqa: BLE001  (delivered to every waiting handle)
            if isinstance(exc, GradsyncError):
                try:
                    exc = self.world.fail(exc)
                except Exception:  # noqa: BLE001
                    pass
            self._close(exc)

    def _cycle(self, new: list[Request], stop: bool) -> tuple[list, bool] | None:
        """One cycle on the wire: the vote, then the gather if some rank needs it.

        Returns None when every rank asked to stop (nothing else happened); otherwise the
        ready names in the order they run (the voted ones, then the table's) and whether
        anything was announced (so the thread does not back off).
        """
        agreement, ballot, config = self.agreement, self._ballot, self.world.config
        for q in new:
            ballot.add(q.name, q.sig, q)
        words, demoted = ballot.cast(agreement.bit, agreement.cache.span,
                                     min(config.stall_warning, config.timeout) / 2)
        fresh = {q.name for q in new}
        self.stats["cached"] += sum(q.name in ballot for q in new)
        self.stats["full"] += len(demoted)
        full, waited = [], {}
        for name, sig, _, seconds in demoted:
            full.append((name, sig))
            if name not in fresh:  # it voted in earlier cycles: a stall, a join, a change
                waited[name] = seconds
                self.stats["demoted"] += 1
        expire = self._stalled()
        words[0] = ((STOP if stop else 0) | (0 if full or expire else QUIET)
                    | (0 if new or full else IDLE))
        result = vote(self.world, words)
        flags = int(result[0])
        if flags & STOP:
            return None
        # Decoded before anything runs: running a ready name changes the cache.
        ready = agreement.voted(bits_of(result[1:]))
        for name, _ in ready:
            ballot.pop(name)
        announced = not flags & IDLE
        if not flags & QUIET:
            self.stats["gathers"] += 1
            payloads = [from_wire(data) for data in
                        gather(self.world, to_wire(full, expire, waited))]
            in_table, _ = self._absorb(payloads)
            ready += in_table
            for name, who in agreement.expire(payloads[0][1]):
                self._finish_expired(name, who)
        return ready, announced

    def _absorb(self, payloads: list[tuple]) -> tuple[list[tuple[str, dict]], bool]:
        """Adds every rank's full announcements to the table; returns the ready ones in agreed
        order, and whether any rank announced anything (``Agreement.absorb``)."""
        announced = [full for full, _, _ in payloads]
        tl, me = self.timeline, self.world.rank
        if tl is not None:
            for r, pairs in enumerate(announced):
                if r != me:
                    for name, _ in pairs:
                        if name in self._mine:
                            tl.instant(name, f"rank {self.ranks[r]} ready")
        return self.agreement.absorb(announced, [waited for _, _, waited in payloads])

    # ------------------------------------------------------------------ stalls
    def _look_for_stalls(self) -> None:
        """At most every ``abort_poll_interval``: a request of this rank past
        ``stall_report`` seconds gets its report (``stall.watch_named``), once."""
        now = time.monotonic()
        if now < self._stall_look:
            return
        self._stall_look = now + self.world.config.abort_poll_interval
        stall.watch_named(self)

    def _stalled(self) -> tuple:
        """Rank 0: warns about names waiting past ``stall_warning``; returns those past
        ``timeout``, to be announced as expired."""
        config = self.world.config
        stalls, expired = self.agreement.stalled(config.stall_warning, config.timeout)
        for late in stalls:
            log.warning("gradsync (%s): operation '%s' has waited %.0fs: issued by ranks "
                        "%s, not yet by ranks %s; it fails after %.0fs (GRADSYNC_TIMEOUT)",
                        self.label, late.name, late.waited, late.issued, late.missing,
                        config.timeout)
        return expired

    def _finish_expired(self, name: str, who: tuple[list[int], list[int]]) -> None:
        with self._lock:
            request = self._mine.get(name)
        if request is None:
            return
        if self.timeline is not None:
            self.timeline.end(name)
        issued, missing = who
        self.stats["expired"] += 1
        self._finish(request, error=CollectiveMismatchError(
            f"operation '{name}' was issued by ranks {issued} ({self.label}) but not by ranks "
            f"{missing} within {self.world.config.timeout:.0f}s (GRADSYNC_TIMEOUT), so it did "
            "not run; the ranks can go on with other operations"))

    def _run_ready(self, ready: list[tuple[str, dict]]) -> None:
        runnable: list[Request] = []
        tl = self.timeline
        for name, by_rank in ready:
            with self._lock:
                request = self._mine.get(name)
            if tl is not None and request is not None:
                tl.end(name)
            if name == JOIN:
                # JOIN is ready once every rank announced it, this one too: its request is here.
                assert request is not None
                last = self.agreement.end_join()
                self._finish(request, result=self.ranks[last])
                continue
            if self.agreement.joined and (request is None or len(by_rank) < self.world.size):
                request = self._for_joined(name, by_rank, request)
                if request is None:
                    continue
            # Any other name is ready once every rank that has not joined announced it: this
            # rank's request is here, or ``_for_joined`` stands in for it.
            assert request is not None
            if request.record is not None:
                self.track.number(request.record)  # agreed order: alike on every rank
            if not agreed(by_rank):
                self.stats["mismatches"] += 1
                self._finish(request, error=mismatch_error(name, by_rank, self.ranks))
                continue
            self.agreement.ran(name, request.sig)
            if tl is not None:
                tl.begin(name, "QUEUE")
            runnable.append(request)
        for batch in self.fusion.batches(runnable):
            self._execute(batch)

    def _for_joined(self, name: str, by_rank: dict, request: Request | None) -> Request | None:
        """An operation that runs while some ranks have joined: the joined ranks contribute
        zeros to an allreduce (averages still divide by every rank, as in Horovod); any other
        kind fails on the ranks that issued it."""
        sig: Signature = next(iter(by_rank.values()))
        joined = sorted(self.ranks[r] for r in set(self.agreement.joined))
        if request is None and self.on_stand_in is not None:
            self.on_stand_in(name)
        if sig.kind != "allreduce":
            if request is not None:
                self._finish(request, error=RuntimeError(
                    f"{sig.kind} '{name}' cannot run while ranks {joined} have joined (only "
                    "allreduce takes zeros from joined ranks, as in Horovod)"))
            return None
        if request is not None:
            return request
        dtype = sig.dtype
        tag: np.dtype | str
        if dtype == BFLOAT16:  # held as int16, as tensors.py holds bfloat16's bits
            tag, held = BFLOAT16, np.dtype(np.int16)
        else:
            tag = held = np.dtype(dtype)
        count = int(np.prod(sig.shape, dtype=np.int64))
        flat = self._zeros(held, count, sig.shared)
        zeros = Request(name, "allreduce", dtype, sig.shape, op=sig.op,
                        scale=(sig.prescale, sig.postscale), flat=flat, dtype_tag=tag,
                        shared=sig.shared)
        zeros.joined = True
        return zeros

    # ------------------------------------------------------------------ execution
    def _execute(self, batch: list[Request]) -> None:
        """Runs one of the fusion stage's batches (an allreduce batch through the stage, any
        other request by its ``run``) and finishes its requests."""
        tl = self.timeline
        head = batch[0]
        if tl is not None:
            for q in batch:
                tl.end(q.name, "QUEUE")
        for q in batch:
            if q.record is not None:
                q.record.start()
        try:
            if head.kind == "allreduce":
                self.fusion.run(batch, tl)
                results = [q.finish() if q.finish else q.flat for q in batch]
            else:
                phase = head.kind.upper()
                if tl is not None:
                    tl.begin(head.name, phase)
                assert head.run is not None  # every kind but allreduce comes with its run
                try:
                    value = head.run(self.world)
                finally:
                    if tl is not None:
                        tl.end(head.name, phase)
                results = [head.finish(value) if head.finish else value]
        except GradsyncError:
            raise  # the World is broken: _turn fails everything
        except Exception as exc:  # noqa: BLE001  (a local error in finishing the result)
            for q in batch:
                self._finish(q, error=exc)
            return
        for q, result in zip(batch, results):
            self._finish(q, result=result)

    def _zeros(self, dtype: np.dtype, count: int, shared: bool) -> np.ndarray:
        """Zeros that a joined rank contributes; in a shared buffer where the others pass
        theirs (``World.shared_buffer``), which is kept for the next such allreduce."""
        world = self.world
        if not shared or not world.shares_host:
            return np.zeros(count, dtype=dtype)
        nbytes = count * dtype.itemsize
        if self._shared_zeros is None or self._shared_zeros.nbytes < nbytes:
            if self._shared_zeros is not None:
                world.release_shared(self._shared_zeros.ctypes.data)
            self._shared_zeros = world.shared_buffer(nbytes)
            if self._shared_zeros is None:  # cannot be: the others made shared buffers
                return np.zeros(count, dtype=dtype)
        flat = self._shared_zeros[:nbytes].view(dtype)
        flat[...] = 0
        return flat

    def _finish(self, request: Request, result=None, error: BaseException | None = None):
        if request.joined:
            return
        record = request.record
        if record is not None:
            if error is None:
                record.done()
            else:
                record.fail(error)
        with self._lock:
            if self._mine.pop(request.name, None) is not None and \
                    request.handle.on_synchronized is not None:
                self._unsynchronized.add(request.name)
        request.handle.finish(result=result, error=error)

    def _synchronized(self, name: str) -> None:
        with self._lock:
            self._unsynchronized.discard(name)

    def _close(self, error: BaseException) -> None:
        """Shuts the executor (submits raise ``error`` from now on; the thread leaves after this
        cycle) and fails every request in flight, those still queued too."""
        with self._lock:
            self.shut(error, drop=True)  # the dropped requests are in _mine: failed below
            pending = list(self._mine.values())
            self._mine.clear()
            self._unsynchronized.clear()
        for q in pending:
            if q.record is not None and q.record.state != "completed":
                q.record.fail(error)
            q.handle.finish(error=error)
