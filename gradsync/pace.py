"""The pace meter: how each step of this rank splits into its own work and time blocked.

Naming a straggler needs, per step and per rank, one number that does not depend on the
hosts' clocks agreeing: the time the rank spent *blocked* in collectives. A rank that arrives
late at the step's collectives finds its peers already there and blocks only for the
communication itself; a rank that arrives early blocks until the late one comes. So in a step
where rank 3 is late by 30 ms, ranks 0-2 block about 30 ms more than rank 3 does, each
measured on its own clock. ``stragglers.py`` compares these numbers across ranks; this module
only measures them, on the rank's own threads, with a few writes to memory it owns.

Vocabulary. *Blocked* time is wall time during which a thread of this rank waited for a
collective to end: a synchronous call (the NumPy API run inline, the express lane), a
``synchronize`` / ``Handle.wait`` (both APIs, the Horovod API's optimizer included) or a torch
backend ``Work.wait``. Blocked intervals of several threads that overlap count once: the
meter keeps the union of the intervals, adding each new interval's part after the end of the
union so far (``blocked``). A *step* is what lies between two step marks: ``mark_step``
(``gradsync.mark_step``, called by the Horovod API's ``DistributedOptimizer.step``) or, in a
job that never marks one, every ``straggler_ops`` completed operations (every rank completes
the same operations in the same order under both APIs, so the counts agree). Each step keeps
``(number, wall end in ns, step ns, blocked ns, operations)``; the step's *compute* is its
time not blocked.

Cost per operation: ``op_done`` (called by ``Record.done`` of the flight recorder, which every
front door calls) adds one to a counter and compares it; ``blocked`` reads two clocks around a
wait and writes two numbers. No lock: a lost update between two threads that finish at the
same instant loses one interval's share of a statistic, never blocks anything. The meter is
off (each call returns at its first test) when ``straggler_interval`` is 0.

What a torch DDP job shows. DDP waits for its buckets inside torch's C++ reducer, which the
meter does not see; such a job's blocked time is what its Python calls wait (``Work.wait``).
"""

from __future__ import annotations

import collections
import time

__all__ = ["Meter", "meter", "HISTORY"]

HISTORY = 64
"""Steps each rank keeps (the newest): what it publishes covers the last ``straggler_window``
of them, and ``gradsync top`` shows the newest."""


class Meter:
    """One process's steps and blocked time (one per process; ``reset`` at each job).

    Args:
        clock: monotonic nanoseconds (tests give their own); walls in ``steps`` are
            ``time.time_ns``.
    """

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
        self._until = 0  # the end of that union so far (monotonic ns)
        self.ops = 0
        self.steps: collections.deque = collections.deque(maxlen=HISTORY)
        self.step = 0
        self.explicit = False
        self._ops_per_step = ops_per_step
        self._next_mark = ops_per_step or -1
        self._mark_ns, self._mark_blocked, self._mark_ops = self._clock(), 0, 0
        self.news = None
        """A straggler report not yet given to ``listeners`` (the publisher's thread sets it,
        the next explicit step mark hands it over on the training thread)."""

    # ------------------------------------------------------------------ per operation
    def blocked(self, begin_ns: int, end_ns: int) -> None:
        """A thread waited for a collective from ``begin_ns`` to ``end_ns`` (monotonic)."""
        until = self._until
        if end_ns > until:
            self.blocked_ns += end_ns - (begin_ns if begin_ns > until else until)
            self._until = end_ns

    def op_done(self) -> None:
        """An operation completed (every front door's, through its flight record)."""
        if not self.on:
            return
        self.ops += 1
        if self.ops == self._next_mark:
            self._next_mark += self._ops_per_step
            self._mark()

    # ------------------------------------------------------------------ per step
    def mark_step(self) -> None:
        """Ends a step (on the training thread); hands a new straggler report to the
        listeners. The first explicit mark drops the steps that counted operations, so that
        every rank numbers the explicit steps from 1."""
        if not self.on:
            return
        if not self.explicit:
            self.explicit = True
            self._next_mark = -1
            self.steps.clear()
            self.step = 0
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
        now, blocked, ops = self._clock(), self.blocked_ns, self.ops
        self.step += 1
        step_ns, blocked_ns = now - self._mark_ns, blocked - self._mark_blocked
        # One append: atomic under the GIL, so the publisher's snapshot sees whole steps.
        self.steps.append((self.step, time.time_ns(), step_ns, min(blocked_ns, step_ns),
                           ops - self._mark_ops))
        self._mark_ns, self._mark_blocked, self._mark_ops = now, blocked, ops
        timeline = self.timeline
        if timeline is not None:
            timeline.instant("steps", "STEP", {
                "step": self.step, "compute_ms": round((step_ns - blocked_ns) / 1e6, 3),
                "blocked_ms": round(blocked_ns / 1e6, 3)})

    def recent(self, count: int) -> list[tuple]:
        """The newest ``count`` steps, oldest first (a snapshot)."""
        held = list(self.steps)
        return held[-count:] if count else []


meter = Meter()
"""The process's meter."""
