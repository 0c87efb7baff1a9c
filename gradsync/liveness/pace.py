"""The pace meter: how each step of this rank splits into its own work and time blocked.

Naming a straggler needs, per step and per rank, one number that does not depend on the
hosts' clocks agreeing: the time the rank spent *blocked* in collectives. A rank that arrives
late at the step's collectives finds its peers already there and blocks only for the
communication itself; a rank that arrives early blocks until the late one comes. So in a step
where rank 3 is late by 30 ms, ranks 0-2 block about 30 ms more than rank 3 does, each
measured on its own clock. ``stragglers.py`` compares these numbers across ranks; this module
only measures them, on the rank's own threads, with a few writes to memory it owns.

Vocabulary. *Blocked* time is wall time during which a thread of this rank waited for a
collective to end: a synchronous call (the NumPy API run inline, its small-call fast case included), a
``synchronize`` / ``Handle.wait`` (both APIs, the Horovod API's optimizer included) or a torch
backend ``Work.wait``. Blocked intervals of several threads that overlap count once: the
meter keeps the union of the intervals, adding each new interval's part after the end of the
union so far (``blocked``). A *step* is what lies between two step marks: ``mark_step``
(``gradsync.mark_step``, called by the Horovod API's ``DistributedOptimizer.step``) or, in a
job that never marks one, every ``straggler_ops`` completed operations (every rank completes
the same operations in the same order under both APIs, so the counts agree). Each step keeps
``(number, wall end in ns, step ns, blocked ns, operations, data ns)``; the step's
*compute* is its time not blocked. A step's clock starts at the end of the step before; the
first step's started at ``reset`` (or at the last mark of a lower level), so it holds the
job's start-up (the rendezvous, connections, first calls' warm-ups) and the judge passes over
it (``straggler_watch.FIRST_JUDGED``). A job of more steps an interval than its posts carry
keeps every ``stride``-th step alone (a power of two the publisher sets,
``straggler_watch.py``), so that the steps it keeps still span more than its posts' interval;
and a history full of steps not posted yet keeps every other one of them (the stride doubles)
rather than drop the oldest, which then no post would carry (a job's first interval, before
any post set a stride, lost all but its newest ``HISTORY`` steps).

*Data* time is wall time the training loop waited for its next batch: gradsync's own
``gradsync.data.Loader`` reports it at each ``next()``; a torch ``DataLoader`` (or any
iterable of batches) reports it through ``gradsync.metered(loader)``, which times each
``next()``, or ``with gradsync.waiting_for_data():`` around the fetch. It is kept as a union
of intervals too (``waited_for_data``) and, per step, taken out of the step's time before the
rest counts as compute: a rank whose data is slow shows it under data, not compute.

Who marks the steps, in order of precedence (``level``): every ``straggler_ops`` operations
(0, a job that marks nothing); the end of each backward pass that issued collectives of the
torch backend (1, a DDP or FSDP job, ``torch/backend/backward.py``); ``mark_step`` (2, the
user or ``DistributedOptimizer``). A mark of a higher level drops the steps of the lower one
and numbers the steps from 1 again; a lower one is ignored from then on, so a DDP job whose
loop also calls ``gradsync.mark_step`` is judged by those marks alone.

Cost per operation: completing one (``Record.done`` of the flight recorder, which every
front door calls) adds one to a counter and compares it with ``next_mark``, in place: no
call; ``blocked`` reads two clocks around a wait and writes two numbers. No lock: a lost
update between two threads that finish at the same instant loses one interval's share of a
statistic, never blocks anything. The meter is off (each call returns at its first test)
when ``straggler_interval`` is 0.

What a torch DDP job shows. DDP waits for its buckets inside torch's C++ reducer, on a
``Future`` no Python code waits on; the torch backend measures that wait from the end of the
backward pass instead (``torch/backend/backward.py``) and reports it through ``blocked``.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Protocol

__all__ = ["Meter", "meter", "HISTORY", "OPS", "BACKWARD", "MARKED", "waiting_for_data",
           "metered"]


class News(Protocol):
    """What the meter reads of a straggler report (``straggler_watch.Report``, which imports
    this module: named here by its shape, so that no import goes back up)."""

    @property
    def step(self) -> int: ...

    @property
    def named(self) -> tuple: ...


HISTORY = 64
"""Steps each rank keeps (the newest of those its ``stride`` keeps): what it posts is drawn
from them (``straggler_watch.py``)."""

OPS, BACKWARD, MARKED = 0, 1, 2
"""Who marks the steps (``Meter.level``; the module docstring)."""


class Meter:
    """One process's steps and blocked time (one per process; ``reset`` at each job).

    Args:
        clock: monotonic nanoseconds (tests give their own); walls in ``steps`` are
            ``time.time_ns``.
    """

    # Slots: the engine's compiled inline run (``_shmfast.c``'s Inline) counts operations
    # and blocked time in ``on``, ``ops``, ``next_mark``, ``blocked_until`` and
    # ``blocked_ns`` at their offsets, a few instructions where a look-up by name costs
    # about two hundred (a test's stand-ins for methods still go in the dict).
    __slots__ = ("_clock", "on", "listeners", "timeline", "blocked_ns", "blocked_until",
                 "data_ns", "_data_until", "ops", "steps", "step", "level", "_ops_per_step",
                 "next_mark", "_mark_ns", "_mark_blocked", "_mark_ops", "_mark_data",
                 "stride", "posted", "news", "__dict__")

    def __init__(self, clock=time.monotonic_ns):
        self._clock = clock
        self.on = False
        self.listeners: list = []
        """Callables given each new straggler report at the next step mark (``stragglers``)."""
        self.timeline = None
        """The Horovod API's timeline while one records (``torch/process_sets``), or None."""
        self.reset(0, on=False)

    def reset(self, ops_per_step: int, on: bool = True) -> None:
        """Starts counting for a new job (or elastic generation): no steps, no operations.

        Args:
            ops_per_step: operations counted as one step until the first explicit mark
                (0: only explicit marks make steps).
            on: False turns the meter off (``straggler_interval`` 0).
        """
        self.on = on
        self.blocked_ns = 0  # the union of this rank's blocked intervals, in ns
        self.blocked_until = 0
        """The end of that union so far (monotonic ns); ``blocked``, and ``Engine.run``'s
        copy of it in place, move it."""
        self.data_ns = 0  # the union of the loop's waits for a batch, in ns
        self._data_until = 0
        self.ops = 0
        self.steps: collections.deque = collections.deque(maxlen=HISTORY)
        self.step = 0
        self.level = OPS
        """Who marks the steps now: ``OPS``, ``BACKWARD`` or ``MARKED``."""
        self._ops_per_step = ops_per_step
        self.next_mark = ops_per_step or -1
        """The operation count that ends the next step (-1: none; steps are marked)."""
        self._mark_ns, self._mark_blocked, self._mark_ops = self._clock(), 0, 0
        self._mark_data = 0
        self.stride = 1
        """Steps kept: those whose number is a multiple of this (the publisher sets it; a
        history full of steps not posted yet doubles it)."""
        self.posted: int | None = None
        """The newest step the publisher posted (None: no publisher reads this meter, and
        the history simply keeps the newest ``HISTORY`` steps)."""
        self.news: News | None = None
        """A straggler report not yet given to ``listeners`` (the publisher's thread sets it,
        the next explicit step mark hands it over on the training thread)."""

    # ------------------------------------------------------------------ per operation
    def blocked(self, begin_ns: int, end_ns: int) -> None:
        """A thread waited for a collective from ``begin_ns`` to ``end_ns`` (monotonic)."""
        until = self.blocked_until
        if end_ns > until:
            self.blocked_ns += end_ns - (begin_ns if begin_ns > until else until)
            self.blocked_until = end_ns

    def waited_for_data(self, begin_ns: int, end_ns: int) -> None:
        """The training loop waited for its next batch from ``begin_ns`` to ``end_ns``."""
        until = self._data_until
        if end_ns > until:
            self.data_ns += end_ns - (begin_ns if begin_ns > until else until)
            self._data_until = end_ns

    def op_done(self) -> None:
        """An operation completed (``Record.done`` of the flight recorder, which every front
        door calls, does the same in place)."""
        if not self.on:
            return
        self.ops += 1
        if self.ops == self.next_mark:
            self.step_by_ops()

    def step_by_ops(self) -> None:
        """The operations counted reached ``next_mark``: a step ends (``level`` OPS)."""
        self.next_mark += self._ops_per_step
        self._mark()

    # ------------------------------------------------------------------ per step
    @property
    def explicit(self) -> bool:
        """True once steps are marked (by ``mark_step`` or by the backward passes)."""
        return self.level > OPS

    def mark_step(self, level: int = MARKED) -> None:
        """Ends a step (on the training thread); hands a new straggler report to the
        listeners. The first mark of a higher ``level`` drops the steps of the lower one, so
        that every rank numbers the steps of that level from 1; marks of a lower level are
        ignored from then on."""
        if not self.on or level < self.level:
            return
        if level > self.level:
            self.level = level
            self.next_mark = -1
            self.steps.clear()
            self.step = 0
            if self.posted is not None:
                self.posted = 0  # numbered from 1 again: none of these steps posted yet
        self._mark()
        news = self.news
        if news is not None:
            self.news = None
            timeline = self.timeline
            if timeline is not None:
                timeline.instant("stragglers", "STRAGGLERS",
                                 {"named": [s.rank for s in news.named], "step": news.step})
            for listener in list(self.listeners):
                listener(news)

    def _mark(self) -> None:
        now, blocked, ops, data = self._clock(), self.blocked_ns, self.ops, self.data_ns
        self.step += 1
        step_ns = now - self._mark_ns
        blocked_ns = min(blocked - self._mark_blocked, step_ns)
        # Waits for data and for collectives are on the loop's thread one after the other;
        # clipped so that the three parts never exceed the step (a wait of another thread
        # may overlap).
        data_ns = min(data - self._mark_data, step_ns - blocked_ns)
        # One append: atomic under the GIL, so the publisher's snapshot sees whole steps.
        if self.step % self.stride == 0 and (len(self.steps) < HISTORY or self._keeps()):
            self.steps.append((self.step, time.time_ns(), step_ns, blocked_ns,
                               ops - self._mark_ops, data_ns))
        self._mark_ns, self._mark_blocked, self._mark_ops = now, blocked, ops
        self._mark_data = data
        timeline = self.timeline
        if timeline is not None:
            timeline.instant("steps", "STEP", {
                "step": self.step,
                "compute_ms": round((step_ns - blocked_ns - data_ns) / 1e6, 3),
                "data_ms": round(data_ns / 1e6, 3), "blocked_ms": round(blocked_ns / 1e6, 3)})

    def _keeps(self) -> bool:
        """The history is full: whether the new step is kept. The oldest step goes if it has
        been posted; if not, no post would ever carry it, so the history keeps every other
        step instead (the stride doubles, a power of two still: ``straggler_watch.py``), and
        the new step if the new stride keeps it."""
        posted = self.posted
        if posted is None or self.steps[0][0] <= posted:
            return True
        self.stride *= 2
        # A new deque, assigned in one store: the publisher's snapshot (``recent``) sees the
        # old history or the new one, whole.
        self.steps = collections.deque([s for s in self.steps if s[0] % self.stride == 0],
                                       maxlen=HISTORY)
        return self.step % self.stride == 0

    def pause(self, on: bool) -> None:
        """Turns the meter off (``on`` False) or back on within a job, as ``gradsync bench
        train --overhead`` does between its windows; the step that goes on after a pause
        is measured from the resumption, so the time off is in no step."""
        if on and not self.on:
            self._mark_ns, self._mark_blocked = self._clock(), self.blocked_ns
            self._mark_ops, self._mark_data = self.ops, self.data_ns
            if self.next_mark > 0:
                self.next_mark = self.ops + self._ops_per_step
        self.on = on

    def recent(self, count: int) -> list[tuple]:
        """The newest ``count`` steps, oldest first (a snapshot)."""
        held = list(self.steps)
        return held[-count:] if count else []


meter = Meter()
"""The process's meter."""


@contextlib.contextmanager
def waiting_for_data(pace: Meter = meter):
    """``with gradsync.waiting_for_data(): batch = next(it)``: the time inside counts as the
    loop waiting for data (``data`` in ``gradsync.stragglers()``, ``gradsync top`` and the
    timeline), not as compute."""
    clock = pace._clock  # the meter's own: its intervals are all on one clock
    began = clock()
    try:
        yield
    finally:
        pace.waited_for_data(began, clock())


def metered(batches, pace: Meter = meter):
    """Yields the items of ``batches`` (a torch ``DataLoader``, any iterable), timing each
    ``next()`` as the loop's wait for data: ``for x, y in gradsync.metered(loader):``.
    The time the loop spends on a batch between two ``next()`` is not counted."""
    items = iter(batches)
    clock = pace._clock  # (as in waiting_for_data)
    while True:
        began = clock()
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            pace.waited_for_data(began, clock())
        yield item
