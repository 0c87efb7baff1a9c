"""Stragglers named: the rank that is late to the collectives, step after step, and why.

A rank that is late to every collective (slow data loading, a throttled core, a noisy
neighbour) makes the whole job slower without failing anything. This module names it, from
the numbers each rank measures about itself (``pace.py``): per step, its step time and the
time it was *blocked* in collectives.

The rule. Clocks of different hosts do not agree, so no arrival time is compared. Instead, in
one step, a rank that arrives late finds the others waiting and blocks only for the
communication; the others block for as long as it was late, plus the communication. So, per
step ``s`` and rank ``r``::

    late(r, s) = typical(s) - blocked(r, s)

where ``typical(s)`` is the upper median of the ranks' ``blocked(j, s)`` (the element at
index N // 2 of them sorted: the most of two ranks, the third least of four): how much later
than most ranks ``r`` arrived, measured on clocks that never meet. Against the most any rank
blocked, the last of ranks that arrive in a random order on a busy machine would be late in
every step; against the typical rank, only a rank later than most of the others is. (So one
rank faster than three slow ones names nobody: it is the odd one, not they.) Rank ``r`` is
*late in step s* when ``late(r, s)`` exceeds ``straggler_threshold`` (0.1) of the step's time
(the median over the ranks) and 1 ms. A rank late in most of the last ``straggler_window``
(10) steps (6 of 10) is *named*, and stays named until it was late in at most a quarter of
them (2 of 10): a rank slowed just past the bar, which a busy machine moves it under for a
step or two, is not named and let go again and again, a warning each time. Named: a WARNING
of the ``gradsync`` logger on rank 0 with its host and where its steps go, the numbers in
``gradsync.stragglers()``, an instant in the timeline and a call of the callbacks registered
on an elastic ``State``
(``register_straggler_callbacks``). Where the time of a step goes is split three ways:
*communication* is the least any rank blocked in it (what the last to arrive blocked: the
collectives themselves), *waiting* is the rest of a rank's blocked time, *data* is the time
its loop waited for its next batch (``pace.py``: gradsync's ``Loader`` reports it, a torch
``DataLoader`` through ``gradsync.metered``), and *compute* is the rest of the step (the
rank's own work: forward, backward, the optimizer).

Steady training only: the steps judged begin at the second (``FIRST_JUDGED``) of each count
of them (a job's, an elastic generation's, and the count that begins when the job first
marks its steps, ``pace.py``). A step's clock starts at the end of the step before; the first
step's started at the job's start (or at the last mark of the count before), so it holds the
start-up (the rendezvous, connections, first calls' warm-ups, the model's broadcast): a rank
that reached its first collective 2 s after the others was late by 2 s in it, and they
waited 2 s, numbers that the first window's averages (a warning's late time and its split)
carried.

Worked example: 4 ranks, steps of 100 ms of work, rank 3 slowed by 30%. Per step rank 3
computes 130 ms and blocks 2 ms (the allreduce); ranks 0-2 compute 100 ms and block 32 ms.
typical = 32 ms; late(3) = 32 - 2 = 30 ms > 0.1 * 132 ms; late(0..2) = 0. After 6 such steps rank 3 is named:
compute 130 ms, data 0 ms, waiting 0 ms, communication 2 ms; its peers wait 30 ms a step
for it. Had rank 3's 30 ms been a wait for its batches, the same numbers would say compute
100 ms, data 30 ms.

The exchange costs nothing per operation and no collective. Each rank's *publisher*, a
thread (``gradsync-pace``) that wakes every ``straggler_interval`` (1 s), posts its summary
(its steps since its last post, operation count, payload bytes per second, bytes per second
per tier ``traffic.py``, last operation) to the job's store
under ``pace/<rank>`` when it has changed: at most two store requests per rank per interval,
over the World's store client, and none while the rank has not moved (waiting in a
collective); beyond 256 ranks the interval grows with the job (``STORE_POSTS_PER_S``). Rank
0's publisher reads every rank's summary in one ``multi_get``, judges the steps that every
rank has posted and not yet judged (and goes on asking while a step it posted waits for the
others' posts), and posts its verdict (``pace/verdict``, counted in ``pace/verdicts``) when
the named ranks change; the other ranks read it when its count moves (one ``add`` of 0 per
round in which they moved). ``gradsync top`` reads
the same keys from outside the job, so it needs only the store's address.

Steps across posts (``Ledger``). Ranks post at their own moments, up to an interval apart,
and rank 0 posts its newest steps just before it judges. In a job of 13 steps an interval, a
post of the newest 10 steps held by rank 0 at step 112 (steps 103-112) and one posted by a
peer 0.2 s after rank 0's previous round (at step 102: steps 93-102) have no step in common,
and the phases of the ranks' threads drift by milliseconds a round: judging only the steps
that the posts of one read share, rank 0 judged none for 14 s of a real job's 78 ms steps
while ``gradsync top``, which kept its reads, showed the straggler late in 10 of 10. So the
judge keeps every rank's posted steps from one read to the next and judges a step once every
rank's post of it has come. And a post carries every step since the rank's last post (the
newest ``straggler_window`` at least), so that no step is left out of all of a rank's posts:
at most two windows of them (and half of ``HISTORY``); a job of more steps an interval keeps
(``Meter.stride``) and posts only every second, fourth, ... step, a power of two, so that the
steps of ranks whose counts straddle a power of two still meet (the multiples of the larger).
A meter holds its newest ``HISTORY`` (64) steps: before a rank's first post had set its
stride, or when its steps became much faster, more steps than that since its last post
pushed out steps that no post had carried (a job of 130 steps in its first interval posted
steps 72-128, every 8th: steps 8-64 were judged on no rank), so a meter full of steps not
posted yet keeps every other one of them instead (``Meter._keeps``), and the first post
carries steps 8-128.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..cluster.rendezvous import Store
from ..flight_recorder import recorder
from .pace import HISTORY, Meter, meter
from .traffic import Traffic

__all__ = ["Judge", "Ledger", "RankPace", "Report", "Publisher", "EMPTY", "on_report",
           "payload_bytes", "running", "CURRENT_KEY", "TOP_NAMESPACE", "FLOOR_NS",
           "STORE_POSTS_PER_S", "FIRST_JUDGED"]

log = logging.getLogger("gradsync")

FLOOR_NS = 1_000_000
"""A rank is late in a step only by more than this too (1 ms): below it, the differences are
a busy machine's scheduling noise, not a straggler."""

FIRST_JUDGED = 2
"""The first step judged of each count of steps: step 1 holds the start-up (module
docstring)."""

STORE_POSTS_PER_S = 256
"""Paces the store takes per ``straggler_interval`` at most: a job of more ranks posts less
often (the interval times size / 256), so the store's load from paces does not grow with N."""

TOP_NAMESPACE = "top"
"""The store namespace (outside any job's) where rank 0 says which job is running."""

CURRENT_KEY = "current"
"""Key in ``TOP_NAMESPACE``: the job id and size of the newest job that posts its pace."""


@dataclass(frozen=True)
class RankPace:
    """One rank's last judged steps, averaged (milliseconds; see the module docstring)."""

    rank: int
    host: str
    late_steps: int
    """Steps it was late in, among the last ``steps``."""
    steps: int
    late_ms: float
    """How much later than most ranks it arrived, on average (negative: earlier)."""
    step_ms: float
    compute_ms: float
    wait_ms: float
    comm_ms: float
    data_ms: float = 0.0
    """Waiting for its next batch (its data loading's share of the step)."""


@dataclass(frozen=True)
class Report:
    """The straggler verdict after the newest judged step."""

    step: int
    """The newest step judged (0: none yet)."""
    named: tuple = ()
    """A ``RankPace`` for each rank named a straggler now."""
    ranks: tuple = ()
    """Every rank's ``RankPace`` over all the steps judged, on rank 0 (the judge); empty on
    the others. (A named rank's own entry in ``named`` averages its late steps alone.)"""


EMPTY = Report(0)


class Judge:
    """The rule (module docstring) over the steps of ``size`` ranks; no I/O, no clock.

    Args:
        size: the ranks.
        window: the last steps looked at (``straggler_window``).
        threshold: the fraction of a step's time a rank must be late by
            (``straggler_threshold``).
    """

    def __init__(self, size: int, window: int, threshold: float):
        self.size, self.window, self.threshold = size, window, threshold
        self.step = 0
        """The newest step judged."""
        self._named: set[int] = set()  # the ranks named as of the newest step
        self._late = [0] * size  # per rank, its late steps among those ``_seen`` holds
        # Per rank, per judged step: (late?, step, blocked, waiting, communication, late,
        # data) ns.
        self._seen: list[collections.deque] = [collections.deque(maxlen=window)
                                               for _ in range(size)]

    def judge(self, step: int, samples) -> None:
        """Judges step ``step`` from each rank's ``(step_ns, blocked_ns, data_ns)``, in rank
        order (``data_ns`` may be left out: 0)."""
        blocked = sorted(s[1] for s in samples)
        typical, least = blocked[len(blocked) // 2], blocked[0]
        bar = max(self.threshold * statistics.median(s[0] for s in samples), FLOOR_NS)
        counts, most, few = self._late, self.window // 2, self.window // 4
        for r, (seen, (step_ns, blocked_ns, *data)) in enumerate(zip(self._seen, samples)):
            late = typical - blocked_ns
            if len(seen) == seen.maxlen:
                counts[r] -= seen[0][0]  # the step the append below lets go
            seen.append((late > bar, step_ns, blocked_ns, blocked_ns - least, least, late,
                         data[0] if data else 0))
            counts[r] += late > bar
            if counts[r] > most:
                self._named.add(r)
            elif counts[r] <= few:
                self._named.discard(r)
        self.step = step

    def named(self) -> list[int]:
        """The ranks late in most of the last ``window`` steps, and those named before that
        have not been on time in three quarters of them since (the module docstring)."""
        return sorted(self._named)

    def pace(self, rank: int, host: str = "", late_only: bool = True) -> RankPace:
        """Rank ``rank``'s numbers, averaged over the steps judged; ``late_only``: over its
        late steps alone, if it has any (what a warning about it shows)."""
        seen = self._seen[rank]
        late = [s for s in seen if s[0]]
        rows = (late if late_only else []) or list(seen) or [(False, 0, 0, 0, 0, 0, 0)]

        def ms(i):
            return round(sum(s[i] for s in rows) / len(rows) / 1e6, 3)

        return RankPace(rank, host, len(late), len(seen), ms(5), ms(1),
                        round(ms(1) - ms(2) - ms(6), 3), ms(3), ms(4), ms(6))


class Ledger:
    """The steps each rank has posted, kept from one read of the posts to the next; each
    judged once every rank's has come, from ``FIRST_JUDGED`` on (module docstring). Rank 0's
    judge and ``gradsync top``'s view.

    Args:
        size, window, threshold: the ``Judge``'s.
    """

    def __init__(self, size: int, window: int, threshold: float):
        self.judge = Judge(size, window, threshold)
        self._held: list[dict] = [{} for _ in range(size)]  # per rank: step -> sample
        self._epoch = None  # the ``explicit`` (who marks the steps) of the steps held

    @property
    def settled(self) -> int:
        """The newest step judged or passed over (the steps before ``FIRST_JUDGED``)."""
        return max(self.judge.step, FIRST_JUDGED - 1)

    def read(self, posts) -> None:
        """Adds each rank's post (None where it has none yet) and judges, in order, the
        steps past ``settled`` that every rank has now posted."""
        # A job's steps are counted by its operations until it marks one (pace.py): numbers
        # that start again at 1 then, judged afresh once every rank's do.
        epochs = {p["explicit"] for p in posts if p is not None and "explicit" in p}
        if len(epochs) > 1:
            return  # some ranks have begun to mark steps, others not yet
        if epochs and epochs != {self._epoch}:
            if self._epoch is not None:
                judge = self.judge
                self.judge = Judge(judge.size, judge.window, judge.threshold)
                self._held = [{} for _ in self._held]
            self._epoch = epochs.pop()
        settled = self.settled
        for held, post in zip(self._held, posts):
            if post is None:
                continue
            for n, *sample in post["steps"]:
                if n > settled:
                    held[n] = tuple(sample)
            # Bounded: a rank's steps that the others never post (a rank far ahead) go.
            for n in sorted(held)[:-HISTORY]:
                del held[n]
        for n in sorted(set.intersection(*(set(h) for h in self._held))):
            self.judge.judge(n, [h[n] for h in self._held])
        judged = self.judge.step
        for held in self._held:  # a step before the newest judged will not be judged
            for n in [n for n in held if n <= judged]:
                del held[n]


_running: "Publisher | None" = None  # the process's publisher thread (a job's or a torch group's)


def running() -> "Publisher | None":
    """The publisher of the process's job (or of its torch job's default group), if any."""
    return _running


def on_report(callback) -> None:
    """Calls ``callback(report)`` with each new straggler report, on the training thread at
    its next step mark (``gradsync.mark_step``, ``DistributedOptimizer.step``): not at the
    same step on every rank, so it must not issue collectives of its own."""
    meter.listeners.append(callback)


def payload_bytes(rec) -> int:
    """The bytes of a record's input (0 for a barrier or an object)."""
    return _nbytes(rec.shape, rec.dtype)


def _nbytes(shape, dtype) -> int:
    return 0 if shape is None else math.prod(shape) * _itemsize(dtype)


def _itemsize(dtype) -> int:
    """Bytes per element of a numpy or torch dtype, or of its name: the Horovod API records
    its dtype as a name ('float32', 'bfloat16'), which has no ``itemsize`` (its operations,
    the gradients of every DistributedOptimizer job, counted 0 bytes before)."""
    size = getattr(dtype, "itemsize", None)
    if size is not None:
        return size
    name = str(dtype).rsplit(".", 1)[-1]
    if name == "bfloat16":  # not a numpy type
        return 2
    try:
        return np.dtype(name).itemsize
    except TypeError:
        return 0


class Publisher:
    """A rank's publisher thread (module docstring); rank 0's also judges.

    Args:
        world: the job's World (its store, rank, size, hosts and settings).
        generation: its elastic generation (-1: none).
        pace: the meter it posts (the process's; tests give their own).
        thread: start the thread (tests call ``round`` themselves).
    """

    def __init__(self, world, generation: int = -1, pace: Meter = meter, thread: bool = True):
        config = world.config
        self.meter = pace
        # From now on the meter keeps the steps not posted yet (pace.py): up to the first
        # post, every step since the job's start.
        pace.posted = 0
        self.rank, self.size = world.rank, world.size
        # Every rank posts once an interval to the one store: beyond STORE_POSTS_PER_S ranks
        # the interval grows with the job, so that the store's load from paces stays flat
        # (at 27,360 ranks a post every 107 s, not 27,360 requests a second).
        self.interval = config.straggler_interval * max(1.0, world.size / STORE_POSTS_PER_S)
        self.window = config.straggler_window
        self.generation = generation
        self.hosts = [p.host for p in world.peers]
        self.host = self.hosts[self.rank]
        self.ledger = Ledger(world.size, config.straggler_window, config.straggler_threshold)
        self.report = EMPTY
        self._job = world.env.job_id
        # The World's own client: a socket more per rank would break the job's budget
        # (world.py), and a round that waits behind the training thread's store request is
        # only late.
        self._store = world.store
        self._stop = threading.Event()
        self._posted = (0, 0)  # (ops, step) last posted: an idle rank posts nothing
        self._newest = 0  # the newest step this rank posted
        self._since = (0, 0)  # (level, step) of the meter at the last post
        self._counted = False  # this rank counted itself in pace/ready
        self._verdicts = 0
        self._last_end, self._last_t = 0, time.monotonic()  # what the last post counted
        self.traffic = Traffic(world)  # bytes per second per tier (traffic.py)
        self._thread: threading.Thread | None = None
        self.paused = False
        """True: rounds do nothing (``gradsync bench train --overhead``'s windows off)."""
        if thread:
            global _running
            _running = self
            self._thread = threading.Thread(target=self._run, name="gradsync-pace",
                                            daemon=True)
            self._thread.start()

    @property
    def judge(self) -> Judge:
        """Rank 0's judge (its ``Ledger``'s)."""
        return self.ledger.judge

    def stop(self) -> None:
        """Ends the thread, waiting for the round in progress (milliseconds): a thread that
        came back from a store request while the interpreter finalizes would abort the
        process (``abort_watch.py`` says why), and ``shutdown`` runs at exit."""
        global _running
        if _running is self:
            _running = None
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.round()
            except Exception as exc:  # noqa: BLE001  (the job outlives its pace thread's errors)
                log.debug("rank %d: pace round failed: %s", self.rank, exc)

    def round(self) -> None:
        """One wake-up: post this rank's summary, then judge (rank 0) or read the verdict.

        A rank that has not moved since the last round (no operation, no step) makes no
        store request, so a rank waiting in a collective costs the store nothing (a verdict
        is acted on at the rank's next step anyway); only rank 0 goes on judging while a step
        it posted is not judged yet (its peers' posts of that step come later): one request
        a round at rank 0, until they have."""
        if self.paused:
            return
        if (self.meter.ops, self.meter.step) != self._posted:
            self._posted = (self.meter.ops, self.meter.step)
            self._store.set(f"pace/{self.rank}", json.dumps(self.summary()))
            if not self._counted:
                self._counted = True
                if self.rank == 0:
                    self._store.set("pace/job", json.dumps({"size": self.size,
                                                            "generation": self.generation}))
                    Store.over(self._store.base, TOP_NAMESPACE, self._store.timeout).set(
                        CURRENT_KEY, json.dumps({"job": self._job, "size": self.size}))
                self._store.add("pace/ready", 1)
        elif self.rank != 0 or self._newest <= self.ledger.settled:
            return
        if self.rank == 0:
            self._judge()
        else:
            count = self._store.add("pace/verdicts", 0)
            if count != self._verdicts:
                self._verdicts = count
                report = _decoded(self._store.get("pace/verdict"))
                self.report = report
                self.meter.news = report

    def summary(self) -> dict:
        """What this rank posts: its steps since its last post and what it does now."""
        now_t = time.monotonic()
        # The bytes of the operations completed since the last post: by their end time, not
        # their number, since an operation in flight now (the Horovod API's fused gradients,
        # often) completes after newer ones were issued and must still count once it does.
        # One pass over the ring, no copy or sort of it (flight_recorder.completed_after), and
        # the size of each shape and dtype worked out once.
        fresh = recorder.completed_after(self._last_end)
        alike = collections.Counter([(shape, dtype) for shape, dtype, _ in fresh])
        rate = sum(count * _nbytes(shape, dtype) for (shape, dtype), count in alike.items()) / \
            max(now_t - self._last_t, 1e-3)
        self._last_end = max([self._last_end] + [ended for _, _, ended in fresh])
        self._last_t = now_t
        last = recorder.newest()
        return {
            "rank": self.rank, "host": self.host, "pid": os.getpid(),
            # Who marks the steps (pace.py): a change of it renumbers them on every rank.
            "generation": self.generation, "explicit": self.meter.level,
            "step": self.meter.step,
            "ops": self.meter.ops, "bytes_s": round(rate), "tiers": self.traffic.rates(),
            "steps": [[n, step_ns, blocked_ns, data_ns] for n, _, step_ns, blocked_ns, _,
                      data_ns in self._steps()],
            "last": None if last is None else last.words(),
        }

    def _steps(self) -> list:
        """The steps to post: those since the last post (the newest ``window`` at least), at
        most two windows of them, thinned by a power-of-two stride (module docstring)."""
        meter, level = self.meter, self.meter.level
        if level != self._since[0]:  # steps renumbered from 1 (pace.py)
            self._since, self._newest = (level, 0), 0
        count = meter.step - self._since[1]
        self._since = (level, meter.step)
        most = max(1, min(2 * self.window, HISTORY // 2))
        stride = 1
        while count > stride * most:
            stride *= 2
        # The meter keeps the same steps from now on: what it holds spans two posts and more.
        meter.stride = stride
        held = [s for s in meter.recent(HISTORY) if s[0] % stride == 0]
        fresh = [s for s in held if s[0] > self._newest]
        posted = fresh if len(fresh) >= self.window else held[-self.window:]
        self._newest = max([self._newest] + [s[0] for s in posted])
        meter.posted = self._newest  # the meter may let these go now (pace.py)
        return posted

    def _judge(self) -> None:
        if self._store.add("pace/ready", 0) < self.size:
            return  # a rank has posted nothing yet
        self.ledger.read([json.loads(v) for v in self._store.get_many(
            [f"pace/{r}" for r in range(self.size)])])
        before = {p.rank for p in self.report.named}
        ranks = tuple(self.judge.pace(r, self.hosts[r], late_only=False)
                      for r in range(self.size))
        named = tuple(self.judge.pace(r, self.hosts[r]) for r in self.judge.named())
        self.report = Report(self.judge.step, named, ranks)
        now = {p.rank for p in named}
        if now == before:
            return
        for p in named:
            if p.rank not in before:
                log.warning("%s", words(p, ranks, self.judge.step))
        for r in sorted(before - now):
            log.info("gradsync: rank %d on host %s is no longer a straggler (step %d)",
                     r, self.hosts[r], self.judge.step)
        verdict = Report(self.report.step, named)
        self._store.set("pace/verdict", json.dumps(_encoded(verdict)))
        self._verdicts = self._store.add("pace/verdicts", 1)
        self.meter.news = verdict


def words(p: RankPace, ranks, step: int) -> str:
    """The warning that names ``p``'s rank at step ``step``, with where its steps and its
    peers' go."""
    others = [r for r in ranks if r.rank != p.rank] or [p]

    def mean(field):
        return sum(getattr(r, field) for r in others) / len(others)

    return (f"gradsync: rank {p.rank} on host {p.host} is a straggler: it arrived after most "
            f"ranks, by {p.late_ms:.1f} ms on average ({100 * p.late_ms / max(p.step_ms, 1e-9):.0f}% of "
            f"a {p.step_ms:.1f} ms step), in {p.late_steps} of the last {p.steps} steps up to "
            f"step {step}. "
            f"Its steps: compute {p.compute_ms:.1f} ms, data {p.data_ms:.1f} ms, waiting "
            f"{p.wait_ms:.1f} ms, communication {p.comm_ms:.1f} ms; its peers': compute "
            f"{mean('compute_ms'):.1f} ms, data {mean('data_ms'):.1f} ms, waiting "
            f"{mean('wait_ms'):.1f} ms, communication {mean('comm_ms'):.1f} ms "
            f"(gradsync.stragglers(), gradsync top)")


def _encoded(report: Report) -> dict:
    return {"step": report.step, "named": [dataclasses.asdict(p) for p in report.named]}


def _decoded(data: bytes) -> Report:
    found = json.loads(data)
    return Report(found["step"], tuple(RankPace(**p) for p in found["named"]))
