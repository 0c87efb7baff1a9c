"""Measuring how collectives run best on this machine: trials, then a choice kept for good.

Some choices have no answer that holds on every machine: whether sending a large buffer by
reference (``splice.py``) beats copying it, and which segment size keeps a socket ring fastest.
So the first collectives that face such a choice try each candidate in turns, timed per byte
(``Trials``), and then keep the cheapest. A choice that only this rank's sends depend on is made
from this rank's medians alone (``Lending``); one that every rank of a ring must make alike (the
segment size: both ends of a segment cut it the same) is made from the medians of all of them,
summed by the ring itself (the ``agree`` that ``Plan.measure`` is given).

``Tuning`` is what one Comm has measured, kept for the Comm's life: the lending trials, and the
segment-size trials of each set of ranks and size class. A ``Plan`` is what one size class of
one ring runs with: its segment size and whether it lends. Set up once, run many (as Gloo's
``AllreduceRing``): the ring looks its plan up in ``comm.plans`` and, once the plan is settled,
reads two fields and runs its schedule; only while the plan is not settled does
``Plan.measure`` time the run, around the schedule and never inside it, so an exchange never
measures.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Generic, Sequence, TypeVar

import numpy as np

__all__ = ["Trials", "Lending", "SegmentTrials", "Tuning", "Plan", "plan_of", "size_class",
           "LEND_TRIALS", "SEGMENT_TRIALS", "SEGMENT_BLOCK", "SEGMENT_DIVISORS", "SEGMENT_MARGIN"]

log = logging.getLogger("gradsync")

#: The first collectives that may lend copy and lend in turn, this many times each, and the
#: faster way is kept (``Lending``); 0 lends from the start, unmeasured.
LEND_TRIALS = 3

#: The first large ring allreduces over sockets try each segment size in this many turns of
#: ``SEGMENT_BLOCK`` allreduces (``Tuning.segments``); 0 keeps the configured ``chunk_bytes``.
SEGMENT_TRIALS = 2
SEGMENT_BLOCK = 4

#: The segments the trials cut, as divisors of ``chunk_bytes``, in the order of their turns: a
#: sixteenth, a quarter and the whole. Copies between processes of one machine ran fastest in
#: quarters (64 KiB ones about half as fast); over a link shaped to 25 Mbit/s sixteenths kept
#: the shaper's queue from overflowing and ran 3-8% faster than wholes (docs/benchmarks.md,
#: "Smaller segments on the slowest link" and "The segment chosen by measurement").
SEGMENT_DIVISORS = (16, 4, 1)

#: A smaller segment costs more CPU per byte (more exchanges, more system calls), which its
#: trials' times do not show where the allreduce runs beside compute; so it is kept only when
#: its cost is below the larger one's by more than this fraction.
SEGMENT_MARGIN = 0.02


def size_class(nbytes: int) -> int:
    """The power of 4 that ``nbytes`` falls in: sizes of one class share their trials (the
    sizes of a fused buffer vary a little from step to step)."""
    return (max(nbytes, 1).bit_length() - 1) // 2


#: A candidate way of running a collective: a segment size in bytes, or whether to lend.
Way = TypeVar("Way")


class Trials(Generic[Way]):
    """Chooses one of ``ways`` of running a collective by timing the first ones.

    Until a way is chosen, the ways take turns in their order, ``block`` collectives each, for
    ``rounds`` turns each, and ``record`` collects each one's seconds per byte, all but the first
    ``block // 2`` of each turn (on some machines a way runs slower for a few collectives after
    another ran). After the last turn ``record`` says so, and the owner calls ``choose`` with
    one cost per way: this rank's medians (``medians``), or what the ranks make of them
    together when they must agree. Every rank runs the same collectives, so all try the same
    way at the same time.

    Args:
        ways: the candidates, in the order they take turns.
        rounds: turns of each way before choosing; 0 chooses ``untried`` at once.
        untried: the way used when there are no trials.
        block: collectives per turn.
    """

    def __init__(self, ways: Sequence[Way], rounds: int, untried: Way, block: int = 1):
        self.ways = tuple(ways)
        self.rounds, self.block = rounds, block
        self.seconds_per_byte: dict[Way, list[float]] = {way: [] for way in self.ways}
        self.chosen: Way | None = untried if rounds == 0 else None
        self._runs = 0

    @property
    def runs(self) -> int:
        """Collectives recorded so far (counted or not)."""
        return self._runs

    def next(self) -> Way:
        """The way the next collective takes."""
        if self.chosen is not None:
            return self.chosen
        return self.ways[self._runs // self.block % len(self.ways)]

    def record(self, way: Way, seconds: float, nbytes: int) -> bool:
        """What a collective run ``way`` (``next()``'s) took; True when that ends the trials."""
        if self.chosen is not None or nbytes <= 0:
            return False
        if self._runs % self.block >= self.block // 2:
            self.seconds_per_byte[way].append(seconds / nbytes)
        self._runs += 1
        return self._runs >= self.rounds * self.block * len(self.ways)

    def medians(self) -> list[float]:
        """This rank's median seconds per byte of each way, in the order of ``ways``."""
        return [statistics.median(self.seconds_per_byte[way]) for way in self.ways]

    def choose(self, costs: Sequence[float]) -> None:
        """Keeps the way of the lowest cost (the first of them on a tie)."""
        self.chosen = self.ways[min(range(len(self.ways)), key=lambda i: costs[i])]


class Lending(Trials[bool]):
    """Whether a Comm's large collectives lend their send buffers, decided by timing them.

    Lending saves the sender's copy but costs the kernel's page references and an
    acknowledgement per frame, and which is cheaper depends on the machine (measurements in
    docs/benchmarks-history.md, "Lending measured on each machine"). So the first
    ``2 * trials`` collectives that may lend alternate, copying first, each timed per byte,
    and from then on the way with the lower median is used. Each rank decides for its own
    sends (a lent frame says so, and any receiver acknowledges it), so the ranks need not
    agree.
    """

    def __init__(self, trials: int):
        super().__init__((False, True), trials, untried=True)

    def record(self, lent: bool, seconds: float, nbytes: int) -> bool:
        done = super().record(lent, seconds, nbytes)
        if done:
            self.choose(self.medians())
        return done


class SegmentTrials(Trials[int]):
    """The trials of segment sizes (``Tuning.segments``): the ways are segment sizes in bytes,
    and a smaller one is kept only when it beats each larger one kept so far by more than
    ``SEGMENT_MARGIN``."""

    def choose(self, costs: Sequence[float]) -> None:
        largest_first = sorted(range(len(self.ways)), key=lambda i: -self.ways[i])
        best = largest_first[0]
        for i in largest_first[1:]:
            if costs[i] < costs[best] * (1 - SEGMENT_MARGIN):
                best = i
        self.chosen = self.ways[best]


class Tuning:
    """What one Comm's collectives have measured, and the plans built from it.

    Args:
        segment_trials: rounds of the segment-size trials; 0 keeps ``chunk_bytes`` always;
            None: ``SEGMENT_TRIALS``.
        lend_trials: rounds of the lending trials; None: ``LEND_TRIALS``.
    """

    def __init__(self, segment_trials: "int | None" = None, lend_trials: "int | None" = None):
        self.lending = Lending(LEND_TRIALS if lend_trials is None else lend_trials)
        self.segment_trials = SEGMENT_TRIALS if segment_trials is None else segment_trials
        self._segments: dict[tuple, "Trials[int] | None"] = {}
        self._plans: dict[tuple, dict] = {}

    def segments(self, ranks: tuple, chunk_bytes: int, nbytes: int,
                 sockets) -> "Trials[int] | None":
        """The trials of segment sizes for ring allreduces of about ``nbytes`` (the same power
        of 4) among ``ranks`` (global ranks in ring order), or None when their segments are
        ``chunk_bytes`` always.

        Rings with a socket among their pairs (``sockets()``, asked once) try ``chunk_bytes``
        divided by each of ``SEGMENT_DIVISORS`` (none below 4 bytes). Each size class chooses on
        its own: the faster segment at one size can be the slower one at another. Each set of
        ranks has trials of its own: only its members run its collectives, all of them.
        """
        key = (ranks, chunk_bytes, size_class(nbytes))
        if key in self._segments:
            return self._segments[key]
        trials = None
        ways = tuple(dict.fromkeys(chunk_bytes // d for d in SEGMENT_DIVISORS
                                   if chunk_bytes // d >= 4))
        if self.segment_trials and len(ways) > 1 and sockets():
            trials = SegmentTrials(ways, self.segment_trials, untried=chunk_bytes,
                                   block=SEGMENT_BLOCK)
        self._segments[key] = trials
        return trials

    def plans_of(self, ranks: tuple) -> dict:
        """The plans that algorithms keep for the ranks ``ranks`` (global, in their order), by
        whatever key each algorithm uses; one dict per set of ranks, shared by all its views."""
        plans = self._plans.get(ranks)
        if plans is None:
            plans = self._plans[ranks] = {}
        return plans


class Plan:
    """How the ring allreduces of one size class on one set of ranks run: set up once, read
    on every call.

    Attributes:
        segment: the largest segment on the wire, in bytes (final once ``settled``).
        lend: whether segments go out lent (final once ``settled``).
        settled: both are final, so an allreduce runs with them and measures nothing.
        sizing: the segment-size trials, or None when the segment is ``chunk_bytes`` always.
        lending: the Comm's lending trials when they apply to this size, else None.
    """

    __slots__ = ("segment", "lend", "settled", "sizing", "lending")

    def __init__(self, chunk_bytes: int, sizing: "Trials[int] | None",
                 lending: "Lending | None"):
        self.segment, self.lend = chunk_bytes, False
        self.sizing, self.lending = sizing, lending
        self.settled = False
        self._settle()

    def measuring(self) -> bool:
        """Whether the next allreduce is one of the trials, of segment sizes or of lending."""
        if self.sizing is not None and self.sizing.chosen is None:
            return True
        return self.lending is not None and self.lending.chosen is None

    def next_segment(self) -> int:
        """The segment the next allreduce cuts."""
        return self.segment if self.sizing is None else self.sizing.next()

    def measure(self, comm, nbytes: int, run: Callable[[int, bool], None],
                agree: Callable[[object], None]) -> None:
        """Runs one allreduce of ``nbytes`` while the plan is not settled, timed as a trial.

        Args:
            comm: the ring's communicator (whether a pair still lends is asked each time).
            nbytes: the vector's bytes.
            run: runs the allreduce with ``(segment bytes, lend)``.
            agree: sums a float64 array over the ranks of the ring, in place (the ranks must
                cut the same segments, so they choose from the sum of their medians).
        """
        if self.lending is not None and not comm.lends:
            self.lending = None  # a pair stopped lending (a failed vmsplice): for good
        # The trials this allreduce is one of: the segment sizes' until the segment is settled,
        # then the Comm's measurements of lending until the faster way is chosen.
        sizing = self.sizing if self.sizing is not None and self.sizing.chosen is None else None
        lending = self.lending if sizing is None else None
        segment = self.next_segment()
        lend = lending is not None and lending.next()
        start = time.perf_counter()
        run(segment, lend)
        seconds = time.perf_counter() - start
        if lending is not None:
            lending.record(lend, seconds, nbytes)
        if sizing is not None and sizing.record(segment, seconds, nbytes):
            # Every rank completes the trials in the same allreduce, so all of them agree
            # within it; the sum leaves the same bits on every rank.
            costs = np.array(sizing.medians(), dtype=np.float64)
            agree(costs)
            sizing.choose(costs.tolist())
            if comm.rank == 0:
                log.info("ring allreduces of about %d bytes over %d ranks: segments of %s "
                         "bytes measured, %s ms per MB (medians summed over the ranks): %d "
                         "kept", nbytes, comm.size, ", ".join(map(str, sizing.ways)),
                         ", ".join(f"{c * 1e9:.4g}" for c in costs), sizing.chosen)
        self._settle()

    def _settle(self) -> None:
        if self.measuring():
            return
        if self.sizing is not None:
            # Not measuring: the segment-size trials are over, so one of them is chosen.
            assert self.sizing.chosen is not None
            self.segment = self.sizing.chosen
        self.lend = self.lending is not None and bool(self.lending.chosen)
        self.settled = True


def plan_of(comm, key: tuple, chunk_bytes: int, nbytes: int, tune: bool,
            may_lend: bool) -> Plan:
    """The plan kept under ``key`` in ``comm.plans`` (a Comm's or a view's), built on first use.

    Args:
        comm: the ring's communicator.
        key: the size class, as the ring names it.
        chunk_bytes: the configured segment, and the one kept without trials.
        nbytes: an allreduce's bytes in this size class.
        tune: whether this size tries segment sizes (``Comm.segments``, None without sockets).
        may_lend: whether this size may lend; it then does when a pair can, as measured.
    """
    plan = comm.plans.get(key)
    if plan is None:
        sizing = comm.segments(chunk_bytes, nbytes) if tune else None
        # A pair that stops lending (a failed vmsplice) never lends again, so a ring that
        # cannot lend now never will; one that can is asked again while it measures.
        lending = comm.lending if may_lend and comm.lends else None
        plan = comm.plans[key] = Plan(chunk_bytes, sizing, lending)
    return plan
