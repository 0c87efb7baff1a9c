"""How a rank waits for another process on this host: spin, then yield the core, then sleep.

Every wait of the transport has the same three rungs:

    spin    look again at once. It answers within a look when the other process runs on a
            core of its own, and only delays it when the two share a core.
    yield   ``sched_yield`` between looks. The core goes to whoever else is runnable, but this
            rank stays runnable itself: a peer that was only descheduled is seen as soon as
            this rank runs again.
    sleep   give the core up: on a futex where the wait has a counter to sleep on
            (``futex.py``: the writer wakes it), else a nap that doubles from ``FIRST_NAP``
            up to ``MAX_NAP`` (in a long wait up to ``LATE_SHARE`` of it, ``LONG_NAP`` at
            most).

Between sleeps a wait looks at its deadline and at the liveness of what it waits for every
``CHECK_EVERY`` seconds. Two kinds of loop climb the ladder:

- a *polling loop* that moves bytes itself (``base.wait_all`` advancing its sends and
  receives over the byte rings): each round that moved nothing is one rung step, counted in
  rounds by ``Backoff`` (``SPINS`` rounds of spinning, then ``YIELDS`` of yielding, then naps);
- a *counter wait* on the host's shared segment (``segment_sync.py``): the rungs are measured
  in time from the wait's start, because one look costs microseconds in Python and
  nanoseconds in C. The Python wait holds the GIL while it looks, the compiled one
  (``collectives/_shmfast.c``) releases it, so each has its own spin and yield lengths below;
  ``native_ladder`` hands the compiled wait its rungs, in nanoseconds, when the segment's
  group is opened: the C loop has no constant of its own.

The measurements behind the figures are in docs/benchmarks-history.md, under "Measurement
notes moved out of the code" (the sections named after the modules that used to hold them:
``gradsync/collectives/shm.py`` and ``gradsync/transport/shm.py``).
"""

from __future__ import annotations

import os
import time
from typing import Callable

__all__ = ["SPINS", "YIELDS", "FIRST_NAP", "MAX_NAP", "LATE_SHARE", "LONG_NAP", "CHECK_EVERY",
           "MIN_SPIN", "MAX_SPIN", "PY_SPIN", "YIELD_FOR", "PY_YIELD_FOR", "BARRIER_YIELD_FOR",
           "Nap", "Backoff", "may_spin", "native_ladder"]

# --- the polling loop's rungs, in rounds --------------------------------------------------

# Rounds of spinning before the first yield. Short (about 10 us of Python) because a spinning
# rank that shares its core with the rank it waits for only delays it: on a 2-vCPU VM whose
# vCPUs were contended, a 2-rank 64 MiB allreduce took 20 ms with 200 spins and 12.5 ms with
# 20 (6 ms either way when each rank had a core of its own): "gradsync/transport/shm.py",
# ``Backoff.SPINS``.
SPINS = 20
# Rounds of yielding after the spins, before the naps begin. No measurement of this figure is
# recorded (docs/benchmarks-history.md names none).
YIELDS = 2000

# --- the sleep rung, shared by both kinds -------------------------------------------------

# A nap where no futex can be slept on starts at FIRST_NAP and doubles up to MAX_NAP: a
# wake-up found late costs at most half a millisecond, and an oversubscribed host (more ranks
# than cores, as in CI) is not kept busy by the nappers. No measurement of these figures is
# recorded; every nap of the transport has used them.
FIRST_NAP = 1e-6
MAX_NAP = 0.0005
# A wait that has seen nothing move for longer than MAX_NAP / LATE_SHARE (25 ms) naps up to
# LATE_SHARE of its length so far, up to LONG_NAP: a nap then ends the wait at most 2% late,
# and a rank that waits on a peer bound by a slow link does not wake 2,000 times a second.
# Sixteen ranks of a ring over four emulated hosts at 25 Mbit/s, each waking every MAX_NAP
# on its shared-memory neighbours while the links carried the bytes (tests/
# test_simulate_netns.py), used most of both cores (docs/benchmarks.md, "Waiting on a slow
# link").
LATE_SHARE = 0.02
LONG_NAP = 0.01
# How often a wait that sleeps looks at its deadline, the job's abort record and its peers'
# liveness (``on_idle``). Not a measurement: the bound on how late a failure is seen.
CHECK_EVERY = 0.05

# --- the counter wait's rungs, in seconds from the wait's start ----------------------------

# A counter wait spins MAX_SPIN when every local rank can have a core of its own, MIN_SPIN
# when they outnumber the cores (``may_spin``): spinning then delays the rank waited for.
# MAX_SPIN is the compiled wait's, which releases the GIL. With each rank bound to one CPU
# under mpirun (so given MIN_SPIN), spinning 100 us instead gave 4 KiB ratios to Open MPI of
# 1.5, 3.2, 2.5 against 1.5, 1.7, 1.9 in three alternating pairs: no gain ("The express lane
# and core binding", "Is the peer late, or does the waiter miss it?").
MIN_SPIN, MAX_SPIN = 2e-6, 100e-6
# The Python wait spins at most PY_SPIN: its loop holds the GIL, which a training step's main
# thread needs while a background thread waits here, so a long spin slows the step it waits
# for. With 100 us, 9 alternating pairs of scripts/train_costs.py gave DistributedOptimizer
# 0.55 of the local rate against 0.59 with 10 us (better in 7 of 9): "gradsync/collectives/
# shm.py", ``PY_SPIN``.
PY_SPIN = 10e-6
# The compiled wait yields until YIELD_FOR after its start, and only then sleeps on a futex.
# On a loaded host a woken process waited ~8 ms for a core, so sleeping early turns a
# microsecond wait into one of milliseconds: with 2 ms here, 4-64 KiB allreduces beside Open
# MPI had medians of 0.2-2.5 ms in 2 of 2 runs; with 20 ms, in 1 of 2 (the others ~25 us):
# "gradsync/collectives/shm.py", ``YIELD_FOR``.
YIELD_FOR = 20e-3
# The Python wait yields for at most PY_YIELD_FOR. Every look between yields takes the GIL
# back, and a rank that waits milliseconds in a large allreduce during training waits for a
# peer still in its backward pass, not for one that was descheduled. 15 alternating triples
# of scripts/train_costs.py gave DistributedOptimizer 0.58 of the local rate with 3 ms,
# against 0.52 with 20 ms: "gradsync/collectives/shm.py", ``PY_YIELD_FOR``, and "A fifth
# session".
PY_YIELD_FOR = 3e-3
# The compiled barrier yields for BARRIER_YIELD_FOR, as long as the Python wait did when the
# barrier ran in Python: a barrier's waits are long wherever one rank is late, and a rank that
# yields stays runnable, so on a host with more ranks than cores the waiters take turns from
# the rank they wait for. With YIELD_FOR there, 4 ranks on the 2 cores, rank 0 counting to
# 300,000 before each of 30 barriers: the three waiters used 0.23-0.28 s of CPU each, against
# 0.04 s with the Python barrier (docs/benchmarks.md, "The barrier on the compiled road").
BARRIER_YIELD_FOR = PY_YIELD_FOR


def may_spin(ranks: int) -> bool:
    """Whether a counter wait among ``ranks`` processes of this host may spin ``MAX_SPIN``
    (or ``PY_SPIN``): only when each can have a core this process may run on. Closeness is
    judged by the cores, not by recent waits: a wait that slept is long because it slept,
    which would keep the next waits from spinning ("gradsync/collectives/shm.py", ``_wait``)."""
    return ranks <= len(os.sched_getaffinity(0))


def native_ladder(spin: bool) -> tuple[int, int, int, int, int]:
    """The compiled counter wait's rungs, in nanoseconds: how long it spins (``MAX_SPIN``, or
    ``MIN_SPIN`` where ``may_spin`` said no), until when it yields (``YIELD_FOR``), its budget
    before it hands the wait back to Python (``CHECK_EVERY``: Python owns the deadline and
    the liveness checks), its nap where there is no futex (``MAX_NAP``), and until when a
    barrier yields (``BARRIER_YIELD_FOR``)."""
    return (int((MAX_SPIN if spin else MIN_SPIN) * 1e9), int(YIELD_FOR * 1e9),
            int(CHECK_EVERY * 1e9), int(MAX_NAP * 1e9), int(BARRIER_YIELD_FOR * 1e9))


class Nap:
    """The sleep rung alone: each call sleeps, from ``FIRST_NAP`` doubling up to ``MAX_NAP``,
    and in a wait that has lasted longer than ``MAX_NAP / LATE_SHARE`` up to ``LATE_SHARE``
    of its length so far (at most ``LONG_NAP``). For the waits whose own loop does the
    looking and the checking, outside the transport too: the host segment's counter wait
    where no futex exists, a data worker's poll of its slot table where the kernel refused
    the futex, the torch backend's receive from any source. One nap policy for all of them,
    here."""

    __slots__ = ("seconds", "since")

    def __init__(self):
        self.seconds, self.since = FIRST_NAP, time.monotonic()

    def reset(self) -> None:
        """The wait starts again (progress): the next nap is the first."""
        self.seconds, self.since = FIRST_NAP, time.monotonic()

    def __call__(self, sleep: "Callable[[float], object] | None" = None) -> None:
        (sleep or time.sleep)(self.seconds)
        longest = max(MAX_NAP, min(LONG_NAP, (time.monotonic() - self.since) * LATE_SHARE))
        self.seconds = min(self.seconds * 2, longest)


class Backoff:
    """The polling loop's ladder: ``idle`` after each round that moved nothing, ``reset`` on
    progress. Spins ``SPINS`` rounds, yields ``YIELDS`` more but for no longer than
    ``PY_YIELD_FOR`` since the last progress, then naps, doubling from ``FIRST_NAP`` to
    ``MAX_NAP``.

    The time bound is for a host with more ranks than cores: there each yield hands the core
    to another runnable rank, so 2,000 yields last as long as the others' turns, and a rank
    that yields stays runnable all the while. Sixteen ranks of a ring over four emulated hosts
    at 25 Mbit/s (tests/test_simulate_netns.py) were yielding most of each link-bound step,
    and 75% of both cores was the kernel's (docs/benchmarks.md, "Waiting on a slow link")."""

    __slots__ = ("rounds", "nap")

    def __init__(self):
        self.rounds, self.nap = 0, Nap()

    def reset(self) -> None:
        """Progress: the next idle round starts spinning again."""
        self.rounds = 0
        self.nap.reset()

    def count(self) -> None:
        """A round that waited elsewhere (in ``select``): it counts as one of the ladder's."""
        self.rounds += 1

    def idle(self, sleep: "Callable[[float], object] | None" = None) -> None:
        """One round of waiting on the ladder's current rung; a nap is ``sleep(seconds)``
        (a ``select`` on the wait's sockets too, where it has some: ``base.wait_all``)."""
        self.rounds += 1
        if self.rounds < SPINS:
            return
        if self.rounds < SPINS + YIELDS and time.monotonic() - self.nap.since < PY_YIELD_FOR:
            os.sched_yield()
            return
        self.nap(sleep)
