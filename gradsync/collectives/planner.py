"""Which allreduce algorithm to use: a cost model over the job's topology.

Candidates:

    shm               the host's shared-memory group (every rank on one host)
    doubling          recursive doubling: log2 n steps, the whole message each step
    halving_doubling  Rabenseifner: log2 n steps of halving, then of doubling, sizes halve
    ring              ring in rank order: 2(n-1) steps of 1/n of the message
    topo_ring         the same ring with ranks in topology order (``Topology.ring_order``)
    hierarchical      reduce-scatter in each host, allreduce of the shares across hosts,
                      allgather in each host (``hierarchical.py``)

The model is ``costs.py``'s (shared with ``gradsync simulate``), evaluated here on the job's
own ranks with every message of every step enumerated (``costs.RankFabric``). The constants
come from the topology (``gradsync probe`` measures them; defaults otherwise).
``choose_allreduce`` picks the cheapest candidate when ranks span several hosts, by
``costs.choose``'s rule: on a bandwidth-bound link a ring (``ring``, ``topo_ring``,
``hierarchical``) predicted within ``costs.RING_MARGIN`` (5%) of a cheaper doubling or
halving-doubling is taken instead, since halving-doubling's bursts cost more on a shaped link
than the model predicts (measured; see there). On one host it picks ``shm`` if the group
exists, else by size (the tiers' constants describe shared memory, not the loopback TCP that a
forced ``transport=tcp`` uses).

The choice depends only on the size, the requested algorithm and the job, none of which
changes between calls, so ``Plans`` remembers it per (size, request): the planner runs once
per size, not on every call (a small allreduce would otherwise pay for it each time). Rank 0
logs each algorithm at INFO the first time it is chosen, with the size that chose it: one line
per size class, never one per call.

Close calls are measured (``Plans``, "trials"). Where the ranks span hosts over a tier whose
constants are guesses (``DEFAULT_TIERS``: no topology file declared or probed that tier), and
the model prefers recursive doubling or halving-doubling to the best ring-family candidate by
less than ``TRIAL_MARGIN`` on a bandwidth-bound message, the model cannot tell which is faster:
its error between the two reaches 36% on a shaped link (a 5.3 MB halving-doubling predicted
1.4% faster than the ring ran 34% slower at 100 Mbit/s) and the guessed link may be ten or a
hundred times off. There the job's own first allreduces of that size class (a power of 4)
run both, in turns of ``TRIAL_BLOCK`` calls (the first of each turn not counted),
``TRIAL_ROUNDS`` turns each, timed per byte. Inside the last one the ranks take, for each
counted call, the least of their times (a ring allreduce of the minimum, the same bits
everywhere): the last rank to arrive waits for no one, so that is the collective's own time,
where a rank's own time also holds its wait for the others, which in a training step varies
more than the algorithms do. Of those, each algorithm's median; the ring-family one is kept
for the class from then on unless the other is faster by more than ``costs.RING_MARGIN``
(``costs.choose``'s rule, on measured times). The ranks agree the same way after one turn
each, and keep the ring at once where the other is then behind it by more than
``TRIAL_MARGIN`` (halving-doubling ran 1.6-1.7x the ring's time at 25 Mbit/s, and its next
turns would cost as much again). Every rank runs the same collectives in the same
order, so all of them try the same algorithm at the same call and end their trials at the same
one. Rank 0 logs the outcome at INFO: both medians in milliseconds per MB and the model's
prediction.
A topology file (``gradsync probe``) or ``GRADSYNC_ALGORITHM`` makes the choice a rule
again, the same in every run: the trials' outcome may differ between runs, and with it the
order in which a float sum is added.
"""

from __future__ import annotations

import logging
import statistics
from typing import Callable, Sequence

import numpy as np

from ..cluster.topology import Topology
from ..transport.trials import Trials, size_class
from .costs import RING_FAMILY, RING_MARGIN, RankFabric, allreduce_time, cheapest, choose

__all__ = ["ALGORITHMS", "CANDIDATES", "TRIAL_MARGIN", "TRIAL_ROUNDS", "TRIAL_BLOCK", "Plans",
           "contested",
           "choose_allreduce", "predict", "plan"]

log = logging.getLogger("gradsync")

# (ranks, request, algorithm) already logged by this process: one set for all its Worlds, since
# a process set or torch group of the same ranks (a sub-world with Plans of its own) decides
# alike, and kept apart from a Plans' memory, whose clearing would log them again.
_announced: set[tuple[int, str, str]] = set()

ALGORITHMS = ("ring", "topo_ring", "doubling", "halving_doubling", "hierarchical", "shm")
CANDIDATES = ("doubling", "halving_doubling", "ring", "topo_ring", "hierarchical")

TRIAL_MARGIN = 0.25
"""How far ahead of the best ring-family candidate the model's choice of recursive doubling or
halving-doubling may be predicted, on guessed constants, and still be measured against it
(``contested``): 25%. Above the model's error between the two measured on shaped links (a
5.3 MB halving-doubling predicted 1.4% ahead of the ring ran 34% behind it at 100 Mbit/s;
a 1.09 MB one, predicted 6.3% ahead with the default tiers, ran level or 24% behind at
100 Mbit/s and about 20% ahead unshaped); below the lead where doubling's fewer latencies
decide on any link (over 4 hosts with the default tiers, doubling 34% ahead of the ring at
128 KiB). So over 4 hosts with the default tiers, 256 KiB (halving-doubling 18% ahead) to
2 MiB are measured."""

TRIAL_ROUNDS = 3
"""Turns of each of the two contested algorithms before one is kept: each turn
``TRIAL_BLOCK`` allreduces, of which the first is not counted (the connections' state after
the other algorithm's traffic: a congestion window that halving-doubling's bursts shrank
slows the ring's next call), so three counted calls each."""

TRIAL_BLOCK = 2


def _resolved(requested: str, config) -> str:
    return config.algorithm if requested == "auto" else requested


def contested(f, times: "dict[str, float]", choice: str) -> "str | None":
    """The ring-family candidate to measure against ``choice`` (``costs.choose``'s pick from
    ``times`` on the fabric ``f``), or None when the model's choice stands.

    Contested: ``choice`` is no ring (recursive doubling or halving-doubling), the best
    ring-family candidate is predicted within ``TRIAL_MARGIN`` of it, and the message is
    bandwidth-bound (``choice``'s latencies under half of its time), where the model misses
    what halving-doubling's bursts cost. The caller asks only where the constants are guessed.
    """
    if choice in RING_FAMILY:
        return None
    rings = [alg for alg in times if alg in RING_FAMILY]
    if not rings:
        return None
    rival = min(rings, key=times.__getitem__)
    if times[rival] > times[choice] * (1 + TRIAL_MARGIN):
        return None
    return rival if 2 * allreduce_time(choice, f, 0.0) < times[choice] else None


def choose_allreduce(nbytes: int, size: int, requested: str, config, has_shm_group: bool,
                     topo: "Topology | None" = None) -> str:
    """Returns the algorithm name for an allreduce of ``nbytes`` over ``size`` ranks, by the
    model alone (``Plans`` measures its close calls).

    Raises:
        ValueError: an unknown algorithm, or ``shm`` when the ranks span several hosts.
    """
    requested = _resolved(requested, config)
    if requested == "auto":
        if has_shm_group:
            return "shm"
        if topo is not None and len(topo.hosts) > 1:
            return cheapest(RankFabric(topo, range(topo.size)), nbytes, CANDIDATES)
        if nbytes < config.small_bytes:
            return "doubling"
        if nbytes < config.medium_bytes:
            return "halving_doubling"
        return "ring"
    if requested not in ALGORITHMS:
        raise ValueError(f"unknown allreduce algorithm {requested!r}; choose from "
                         f"{('auto',) + ALGORITHMS}")
    if requested == "shm" and not has_shm_group and size > 1:
        raise ValueError("the shm allreduce needs every rank on one host with shared memory "
                         "(transport not forced to tcp)")
    return requested


class Plans:
    """``choose_allreduce`` for one job, remembered per (bytes, requested algorithm), with its
    close calls measured (the module docstring, "Close calls are measured").

    A contested size is not remembered until its trials end: ``allreduce`` then names the
    algorithm whose turn it is, ``trying`` is true, and the caller times the allreduce and
    hands the seconds to ``ran``. The trials are kept per size class (a power of 4) and pair
    of algorithms, so that the sizes of one class, a fused buffer's that vary a little from
    step to step among them, share them.

    Args:
        size: the number of ranks.
        config: the job's Config (``algorithm``, ``small_bytes``, ``medium_bytes``).
        has_shm_group: whether every rank shares this host's shared-memory group.
        topo: the job's Topology.
        limit: entries kept; past it the memory is cleared (sizes of a training job are few).
        announce: log each algorithm at INFO when it is first chosen, and each trial's outcome
            (rank 0 of a World).
        trial_rounds: turns of each contested algorithm (``TRIAL_BLOCK`` allreduces each);
            0 keeps the model's choice.
    """

    def __init__(self, size: int, config, has_shm_group: bool,
                 topo: "Topology | None" = None, limit: int = 4096, announce: bool = False,
                 trial_rounds: int = TRIAL_ROUNDS):
        self.size, self.config, self.has_shm_group, self.topo = size, config, has_shm_group, topo
        self.limit = limit
        self._chosen: dict[tuple[int, str], str] = {}
        self.announce = announce
        self.trying = False
        """Whether some size is on trial: the caller then times its allreduces (``ran``)."""
        self._guessed = (trial_rounds > 0 and topo is not None and not has_shm_group
                         and topo.guessed())
        self._rounds = trial_rounds
        self._on_trial: dict[tuple[int, str], "_Contest"] = {}
        self._contests: dict[tuple, "_Contest"] = {}
        self._measured: dict[tuple[int, str], tuple[str, ...]] = {}

    def allreduce(self, nbytes: int, requested: str = "auto") -> str:
        """The algorithm for an allreduce of ``nbytes``; raises as ``choose_allreduce``."""
        key = (nbytes, requested)
        alg = self._chosen.get(key)
        if alg is not None:
            return alg
        contest = self._on_trial.get(key)
        if contest is None and self._guessed and _resolved(requested, self.config) == "auto":
            contest, alg = self._contest(nbytes)
        if contest is not None:
            if contest.trials.chosen is None:
                self._on_trial[key] = contest
                return contest.trials.next()
            self._on_trial.pop(key, None)
            alg = contest.trials.chosen
            self._measured[key] = contest.trials.ways
        elif alg is None:
            alg = choose_allreduce(nbytes, self.size, requested, self.config,
                                   self.has_shm_group, self.topo)
        if len(self._chosen) >= self.limit:
            self._chosen.clear()
        self._chosen[key] = alg
        if self.announce and (self.size, requested, alg) not in _announced:
            _announced.add((self.size, requested, alg))
            log.info("allreduce over %d ranks: %s, first chosen for %d bytes (requested "
                     "%s)", self.size, alg, nbytes, requested)
        return alg

    def ran(self, nbytes: int, requested: str, algorithm: str, seconds: float,
            agree: Callable[[np.ndarray], None]) -> None:
        """An allreduce of ``nbytes`` that ``allreduce`` named ``algorithm`` took ``seconds``.

        Called on every rank while ``trying``; the call that ends its size's trials takes,
        for each counted call, the least of the ranks' seconds with ``agree`` (a minimum over
        the ranks of a float64 array, in place, the same bits on every rank: a collective,
        run inside the trial's allreduce), and keeps the ring-family candidate unless the
        other's median is below it by more than ``costs.RING_MARGIN``. The call that ends
        the first turn of each agrees too, and ends the trials with the ring-family candidate
        where the other is behind it by more than ``TRIAL_MARGIN``."""
        contest = self._on_trial.get((nbytes, requested))
        if contest is None or contest.trials.chosen is not None:
            return
        trials = contest.trials
        done = trials.record(algorithm, seconds, nbytes)
        first_turns = trials.runs == trials.block * len(trials.ways)
        if not (done or first_turns):
            return
        # Every rank recorded the same calls in the same order: per call, the least of the
        # ranks' times (``agree``: a minimum over the ranks) is the collective's own, since
        # the last rank to arrive waits for no one and the others' extra is waiting for it.
        recorded = [trials.seconds_per_byte[way] for way in trials.ways]
        calls = np.array([s for way in recorded for s in way], dtype=np.float64)
        agree(calls)
        cut = len(recorded[0])
        costs = [statistics.median(calls[:cut].tolist()), statistics.median(calls[cut:].tolist())]
        if done:
            # The ring unless the other is measured faster beyond ``costs.RING_MARGIN``: the
            # rule of ``costs.choose``, on measured times (a median does not see
            # halving-doubling's tails on a congested link, which a longer run meets).
            trials.chosen = trials.ways[0 if costs[0] * (1 + RING_MARGIN) < costs[1] else 1]
        elif costs[0] > costs[1] * (1 + TRIAL_MARGIN):
            # After one turn each, the other already behind the ring by more than the model's
            # own doubt: the ring, without the other's turns to come (at 25 Mbit/s
            # halving-doubling ran 1.6-1.7x the ring's time in each of them).
            trials.chosen = trials.ways[1]
        else:
            return
        self.trying = any(c.trials.chosen is None for c in self._contests.values())
        if self.announce:
            (a, b), (pa, pb) = trials.ways, contest.predicted
            turns = trials.runs // (trials.block * len(trials.ways))
            log.info("allreduce over %d ranks, about %d bytes: %s and %s measured in %d turn%s "
                     "each, %.4g and %.4g ms per MB (the median over calls of the least of the "
                     "ranks' times; predicted %.4g and %.4g): %s kept", self.size, nbytes, a, b,
                     turns, "" if turns == 1 else "s", costs[0] * 1e9, costs[1] * 1e9,
                     pa * 1e9 / nbytes, pb * 1e9 / nbytes, trials.chosen)

    def kept(self) -> list[str]:
        """Each size's algorithm as remembered now, and for a measured one the two tried:
        ``"1089536 B: ring (measured against halving_doubling)"`` (a benchmark's row)."""
        out = []
        for (nbytes, requested), alg in sorted(self._chosen.items()):
            ways = self._measured.get((nbytes, requested))
            rival = "" if ways is None else f" (measured against {ways[ways[0] == alg]})"
            asked = "" if requested == "auto" else f" (requested {requested})"
            out.append(f"{nbytes} B: {alg}{rival}{asked}")
        return out

    def _contest(self, nbytes: int) -> "tuple[_Contest | None, str]":
        """The trials ``nbytes`` joins (None when the model's choice stands), and the model's
        choice."""
        assert self.topo is not None
        fabric = RankFabric(self.topo, range(self.topo.size))
        times = {alg: allreduce_time(alg, fabric, nbytes) for alg in CANDIDATES}
        choice = choose(fabric, times)
        rival = contested(fabric, times, choice)
        if rival is None:
            return None, choice
        key = (size_class(nbytes), choice, rival)
        contest = self._contests.get(key)
        if contest is None:
            contest = self._contests[key] = _Contest(
                Trials((choice, rival), self._rounds, untried=choice, block=TRIAL_BLOCK),
                (times[choice], times[rival]))
            self.trying = True
        return contest, choice


class _Contest:
    """One size class's trials of two algorithms, and what the model predicted for the first
    size that started them."""

    __slots__ = ("trials", "predicted")

    def __init__(self, trials: Trials, predicted: tuple[float, float]):
        self.trials, self.predicted = trials, predicted


def predict(algorithm: str, nbytes: int, topo: Topology) -> float:
    """Predicted seconds for an allreduce of ``nbytes`` over every rank of ``topo``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"no cost model for {algorithm!r}")
    return allreduce_time(algorithm, RankFabric(topo, range(topo.size)), nbytes)


def plan(topo: Topology, sizes: Sequence[int]) -> list[dict]:
    """For each size: every candidate's predicted seconds, the choice, and the candidate a job
    measures it against (``trial``: ``Plans``' close calls, on guessed tiers; else None)."""
    rows = []
    fabric = RankFabric(topo, range(topo.size))  # ``predict``'s
    guessed = topo.guessed()
    for nbytes in sizes:
        times = {alg: allreduce_time(alg, fabric, nbytes) for alg in CANDIDATES}
        choice = choose(fabric, times)
        rows.append({"size": nbytes, "predicted": times, "choice": choice,
                     "trial": contested(fabric, times, choice) if guessed else None})
    return rows

