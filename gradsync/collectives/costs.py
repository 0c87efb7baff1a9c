"""The cost model: one formula per allreduce, alltoall or allgather algorithm, over any *fabric*
that times a step.

This is the one cost model of gradsync. The run-time planner (``planner.py``) evaluates it on
the job's own ranks (``RankFabric``: every message of a step enumerated over a ``Topology``);
``gradsync simulate`` evaluates the same formulas on clusters of any size
(``gradsync.simulate.fabric.TierFabric``: closed forms over tiers of identical units). The
formulas below know nothing of either: they only ask the fabric what one *step* costs.

Vocabulary. A *step* is a set of messages sent at the same time, one per sending rank; it
lasts as long as its slowest message::

    step time = max over the step's messages of (latency + bytes / bandwidth)

where a message's tier is the slowest tier between its two ranks, and its bandwidth is the
tier's link bandwidth divided by the number of the step's messages that leave the same unit
(host, group of hosts) over that tier at the same time: k ranks of one host sending to other
hosts share its NIC. Folding a received piece into one's own costs ``bytes /
reduce_bandwidth``. A fabric offers four kinds of step over its ranks ``0..n-1`` (positions
in the fabric's order, not necessarily global ranks):

    ring_step(b)         every rank i sends b bytes to i+1 (the last to the first)
    pair_step(d, p, b)   every rank i < p sends b bytes to i XOR d (recursive doubling)
    fold_step(p, b)      every rank p+i >= p sends b bytes to rank i (non powers of two)
    shift_step(d, b)     every rank i sends b bytes to (i + d) mod n (the alltoalls, Bruck's
                         allgather)

and ``split()``, which cuts it along its fastest tier that has several units of several ranks
(the hierarchical plan), or says that no tier does.

The algorithms, for n ranks and S bytes (p = the largest power of two <= n):

    ring              2(n-1) ring steps of S/n; the first n-1 also fold S/n
    doubling          log2 p pair steps of S, each folding S; n > p: 2 fold steps + a fold
    halving_doubling  log2 p rounds at distances p/2, p/4, ..: S/2, S/4, .. there and back
                      (2 pair steps) with one fold; n > p: as doubling
    hierarchical      a ring's traffic inside each unit (reduce-scatter, then allgather), and
                      the allreduce of the shares across units, hierarchical again one tier up:
                      a rank of a unit with k ranks handles ceil(m/k) of the m shares one after
                      another (m = the largest unit), the unit's k ranks at the same time
    shm               the host's shared segment: 3 (k-1)/k S through local memory

Choosing (``choose``): the least predicted time, except that on a bandwidth-bound link (the
cheapest's bytes take longer than its latencies) a ring (``RING_FAMILY``: the ring, the ring
in topology order, the hierarchical plan) predicted within ``RING_MARGIN`` (5%) of a cheaper
doubling or halving-doubling is preferred: the model does not see what halving-doubling's
bursts cost on a shaped or congested link, which was measured (see ``RING_MARGIN``). Every
choice of an allreduce by predicted time, the planner's and the simulator's, is made there.

The alltoalls (``alltoall.py``), S bytes per rank in n uniform blocks of S/n, each block a
local copy costing ``bytes / reduce_bandwidth`` as a fold does (both stream the bytes
through memory once):

    pairwise          n-1 shift steps of S/n at distances 1 .. n-1; the own block copied
    bruck             ceil(log2 n) shift steps at distances 1, 2, 4, ..: the step at d carries
                      c_d S/n (c_d = ``alltoall.moving_blocks(n, d)``, about n/2) and packs
                      and unpacks it (2 c_d S/n copied); the two rotations copy 2 S

Pairwise sends (n-1)/n S in n-1 latencies, Bruck about (S/2) log2 n in log2 n: Bruck for
small blocks among many ranks, pairwise for large blocks (``cheapest_alltoall``). Example:
4,560 ranks one a host, 23 GB/s and 3 us between hosts, folds at 400 GB/s, S = 1 MB (blocks
of 219 bytes, 9.5 ns on the link): pairwise 4,559 x (3 us + 9.5 ns) = 13.72 ms; Bruck 13
steps, 27,040 blocks in all: 39 us + 0.26 ms on the links + 2 MB + 11.9 MB copied, 35 us:
0.33 ms, 41x less. At S = 1 GB (219 KB blocks) pairwise takes 57 ms (13.7 of latency), Bruck
0.29 s: 5.9 GB through each rank's link.

The allgathers of equal blocks (``allgather.py``), S bytes gathered on every rank in n blocks
of S/n, each rank's own already in place:

    ring              n-1 ring steps of S/n (``ring.allgather``; its segments are not modelled,
                      as the ring allreduce's are not)
    bruck             ceil(log2 n) shift steps at distances 1, 2, 4, ..: the step at d carries
                      min(d, n-d) S/n (``allgather.step_blocks``), straight out of and into
                      place: no copies

Both send (n-1)/n S; Bruck pays log2 n latencies instead of n-1, but its steps at distances
of a host's ranks or more put every rank's message on its host's NIC at once, where the ring
in topology order sends one a host (``cheapest_allgather``; the ring at a tie, as at 2 or 3
ranks). The same 4,560 ranks, S = 1 MB: the ring 4,559 x (3 us + 9.5 ns) = 13.72 ms, Bruck
13 steps, 4,559 blocks in all: 39 us + 43 us on the links = 82 us, 166x less; at S = 1 GB
(219 KB blocks) the ring 57 ms, Bruck 43 ms, the same bytes in fewer latencies.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from ..cluster.topology import Topology
from . import hierarchical as _hier
from .allgather import ALGORITHMS as _ALLGATHERS
from .allgather import step_blocks
from .alltoall import ALGORITHMS as _ALLTOALLS
from .alltoall import moving_blocks
from .doubling import core_size

__all__ = ["Fabric", "RankFabric", "FORMULAS", "allreduce_time", "RING_FAMILY", "RING_MARGIN",
           "choose", "cheapest", "ring",
           "doubling", "halving_doubling", "hierarchical", "ALLTOALLS", "alltoall_time",
           "cheapest_alltoall", "pairwise_alltoall", "bruck_alltoall", "ALLGATHERS",
           "allgather_time", "cheapest_allgather", "ring_allgather", "bruck_allgather"]


class Fabric(Protocol):
    """What the formulas need to know about a set of ranks and the network between them."""

    n: int
    reduce_bandwidth: float

    def ring_step(self, nbytes: float) -> float: ...

    def pair_step(self, distance: int, p: int, nbytes: float) -> float: ...

    def fold_step(self, p: int, nbytes: float) -> float: ...

    def shift_step(self, distance: int, nbytes: float) -> float: ...

    def split(self) -> "tuple[Sequence[Fabric], Fabric] | None":  # Sequence: a list of any kind
        """``(parts, owners)``: one fabric per distinct unit (the ranks of one unit, in order),
        and the fabric of one stand-in rank per unit, whose messages carry the unit's shares
        through its uplink and, below it, through all of the unit's links at once; None when
        no tier splits the ranks."""
        ...

    def ordered(self) -> "Fabric":
        """The same ranks in topology order (a ring crosses each slow tier least often)."""
        ...

    def shm_bandwidth(self) -> float: ...


# --- the formulas -----------------------------------------------------------------------------

def ring(f: Fabric, nbytes: float) -> float:
    n = f.n
    if n < 2:
        return 0.0
    piece = nbytes / n
    step = f.ring_step(piece)
    return (n - 1) * (step + piece / f.reduce_bandwidth) + (n - 1) * step


def _fold(f: Fabric, p: int, nbytes: float) -> float:
    """Folding the ranks beyond the power of two in before, and the result out after."""
    if p == f.n:
        return 0.0
    return 2 * f.fold_step(p, nbytes) + nbytes / f.reduce_bandwidth


def doubling(f: Fabric, nbytes: float) -> float:
    p = core_size(f.n)
    total = _fold(f, p, nbytes)
    for i in range(int(math.log2(p))):
        total += f.pair_step(1 << i, p, nbytes) + nbytes / f.reduce_bandwidth
    return total


def halving_doubling(f: Fabric, nbytes: float) -> float:
    p = core_size(f.n)
    total = _fold(f, p, nbytes)
    size = nbytes
    for i in reversed(range(int(math.log2(p)))):  # partners at distance p/2, p/4, ...
        size /= 2
        total += 2 * f.pair_step(1 << i, p, size) + size / f.reduce_bandwidth  # there and back
    return total


def hierarchical(f: Fabric, nbytes: float) -> float:
    cut = f.split()
    if cut is None:
        return ring(f.ordered(), nbytes)
    parts, owners = cut
    m = max(u.n for u in parts)
    inside = max(ring(u, nbytes) for u in parts)
    cross = max(math.ceil(m / k) * hierarchical(owners, nbytes * k / m)
                for k in {u.n for u in parts})
    return inside + cross


def _shm(f: Fabric, nbytes: float) -> float:
    k = f.n
    return 3 * nbytes * (k - 1) / k / f.shm_bandwidth()


FORMULAS: dict[str, Callable[[Fabric, float], float]] = {
    "ring": ring, "topo_ring": lambda f, b: ring(f.ordered(), b), "doubling": doubling,
    "halving_doubling": halving_doubling, "hierarchical": hierarchical, "shm": _shm}


def _formula(table: dict[str, Callable[[Fabric, float], float]], kind: str,
             algorithm: str) -> Callable[[Fabric, float], float]:
    """``table[algorithm]``, or ValueError naming the ``kind`` of collective and the known."""
    try:
        return table[algorithm]
    except KeyError:
        raise ValueError(f"no cost model for {kind}{algorithm!r}; known: {sorted(table)}") \
            from None


def allreduce_time(algorithm: str, f: Fabric, nbytes: float) -> float:
    """Predicted seconds of an allreduce of ``nbytes`` over the ranks of ``f``."""
    return _formula(FORMULAS, "", algorithm)(f, nbytes)


RING_FAMILY = ("ring", "topo_ring", "hierarchical")
"""The allreduces whose traffic is the ring's: every rank sends a steady stream of small pieces
to one neighbour, step after step, pipelined. ``topo_ring`` is the same ring over the ranks in
topology order (the ring a tiered fabric runs); ``hierarchical`` is rings inside each unit and,
across units, a ring of one stand-in per unit (recursive doubling only for pieces under
``small_bytes``, latency-bound ones), so it counts too. The others, ``doubling`` and
``halving_doubling``, send the whole message, or halves of it, to one partner at a time."""

RING_MARGIN = 0.05
"""How much slower than the cheapest candidate a ring-family one may be predicted and still be
chosen (``choose``): 5% of the cheapest's time.

Why: the model times a step by its bytes and latencies alone. On a link whose rate is the
bound, halving-doubling and the ring send the same 2(n-1)/n S per rank and differ only by
latencies, so the model predicts halving-doubling a little faster; but its whole halves sent
at once to one peer overflow a shaped or congested link's queue, which the model does not
see. Measured (docs/benchmarks.md, "Slow links"), one 5.3 MB allreduce over 4 emulated hosts:
halving-doubling against the ring 3.47-3.73 s against 2.88 s at 25 Mbit/s, 0.904 against
0.676 s at 100 Mbit/s, 0.068 against 0.063 s at 1 Gbit/s (8% slower at the least); on the
shaped links halving-doubling's ranks retransmitted 102-189 TCP segments each, the ring's 0-2
(the same measurement, issue 38). The model, with its default tiers,
had predicted halving-doubling 1.4% faster (1.7% at 4 MiB), and with the 100 Mbit/s link's
own constants 0.03%.

What it was chosen from: above those predicted gains (2% at the most) and below the least
loss measured (8%), and below the gains that make recursive doubling or halving-doubling worth
their bursts where latency counts, which stay chosen: with the default tiers over 4 hosts,
halving-doubling 6.3% faster than the ring at 1 MiB and 18% at 256 KiB, doubling 2.8 times
faster at 4 KiB; at 100 Mbit/s, doubling 27% faster at 4 KiB."""


def choose(f: Fabric, times: Mapping[str, float]) -> str:
    """The allreduce to run on ``f``, given each candidate's predicted seconds there (in
    candidate order).

    The cheapest (the first of equals), unless it is not of ``RING_FAMILY``, the cheapest of
    ``RING_FAMILY`` among the candidates is predicted within ``RING_MARGIN`` of it, and the
    link is the bound: the cheapest's latencies (its time for 0 bytes) are under half of its
    time, i.e. the message is longer than Hockney's half-performance length. Then that ring.
    Over n = 2^k ranks of one tier the ring's time exceeds halving-doubling's by 2(n-1) - 2k
    latencies and nothing else, so the margin alone already keeps latency-bound messages on
    recursive doubling or halving-doubling; the second test keeps them there also where a
    ring-family plan comes near for other reasons (16 KiB over 2 hosts of 2 ranks dealt
    alternately: halving-doubling 0.2% ahead of the hierarchical plan, its four latencies
    most of its time).

    The one rule for every choice of an allreduce by predicted time: the planner
    (``planner.choose_allreduce``, ``planner.plan``), a tiered sub-group's (``cheapest``, for
    ``compress.comm``) and ``gradsync simulate``'s (``simulate.compression``), so that the
    simulator projects what the library runs."""
    best = min(times, key=times.__getitem__)
    rings = [alg for alg in times if alg in RING_FAMILY]
    if best in RING_FAMILY or not rings:
        return best
    ring_best = min(rings, key=times.__getitem__)
    if times[ring_best] > times[best] * (1 + RING_MARGIN):
        return best
    return ring_best if 2 * allreduce_time(best, f, 0.0) < times[best] else best


def cheapest(f: Fabric, nbytes: float, candidates: Sequence[str]) -> str:
    """The candidate ``choose`` picks from the predicted times on ``f``: the least, or a ring
    within ``RING_MARGIN`` of it on a bandwidth-bound link."""
    return choose(f, {alg: allreduce_time(alg, f, nbytes) for alg in candidates})


def pairwise_alltoall(f: Fabric, nbytes: float) -> float:
    n = f.n
    if n < 2:
        return 0.0
    block = nbytes / n
    return block / f.reduce_bandwidth + sum(f.shift_step(d, block) for d in range(1, n))


def bruck_alltoall(f: Fabric, nbytes: float) -> float:
    n = f.n
    if n < 2:
        return 0.0
    block = nbytes / n
    total = 2 * nbytes / f.reduce_bandwidth  # the rotation and the inverse rotation
    distance = 1
    while distance < n:
        moving = moving_blocks(n, distance) * block
        total += f.shift_step(distance, moving) + 2 * moving / f.reduce_bandwidth
        distance <<= 1
    return total


ALLTOALLS: dict[str, Callable[[Fabric, float], float]] = {
    "pairwise": pairwise_alltoall, "bruck": bruck_alltoall}
"""The uniform-block alltoalls, by ``alltoall.ALGORITHMS``' names."""


def alltoall_time(algorithm: str, f: Fabric, nbytes: float) -> float:
    """Predicted seconds of an alltoall of ``nbytes`` per rank (n uniform blocks) over ``f``."""
    return _formula(ALLTOALLS, "alltoall ", algorithm)(f, nbytes)


def cheapest_alltoall(f: Fabric, nbytes: float,
                      candidates: Sequence[str] = _ALLTOALLS) -> str:
    """The alltoall with the least predicted time (the first of equals, in order)."""
    return min(candidates, key=lambda alg: alltoall_time(alg, f, nbytes))


def ring_allgather(f: Fabric, nbytes: float) -> float:
    n = f.n
    if n < 2:
        return 0.0
    return (n - 1) * f.ring_step(nbytes / n)


def bruck_allgather(f: Fabric, nbytes: float) -> float:
    n = f.n
    block = nbytes / n
    total = 0.0
    distance = 1
    while distance < n:
        total += f.shift_step(distance, step_blocks(n, distance) * block)
        distance <<= 1
    return total


ALLGATHERS: dict[str, Callable[[Fabric, float], float]] = {
    "ring": ring_allgather, "bruck": bruck_allgather}
"""The allgathers of equal blocks, by ``allgather.ALGORITHMS``' names."""


def allgather_time(algorithm: str, f: Fabric, nbytes: float) -> float:
    """Predicted seconds of an allgather of ``nbytes`` in all (n equal blocks) over ``f``."""
    return _formula(ALLGATHERS, "allgather ", algorithm)(f, nbytes)


def cheapest_allgather(f: Fabric, nbytes: float,
                       candidates: Sequence[str] = _ALLGATHERS) -> str:
    """The allgather with the least predicted time (the first of equals, in order: the ring)."""
    return min(candidates, key=lambda alg: allgather_time(alg, f, nbytes))


# --- the job's own ranks ----------------------------------------------------------------------

class RankFabric:
    """Ranks of a ``Topology`` in a given order: every step's messages enumerated.

    Args:
        topo: the job's topology.
        ranks: global ranks, in the order the algorithm walks them.
        levels: the tiers the hierarchical plan may split (``hierarchical.levels_of``).
        hosts: for a stand-in rank (``split``'s owners), the hosts its unit's ranks are on:
            its messages leave through all of their NICs at once. Other ranks: their own.
    """

    def __init__(self, topo: Topology, ranks: Sequence[int], levels=None,
                 hosts: "Mapping[int, frozenset[int]] | None" = None):
        self.topo, self.ranks = topo, list(ranks)
        self.levels = _hier.levels_of(topo) if levels is None else levels
        self.hosts = dict(hosts or {})
        self.n = len(self.ranks)
        self.reduce_bandwidth = topo.reduce_bandwidth
        self._rank = np.asarray(self.ranks, dtype=np.int64)
        self._host = np.asarray(topo.host_of, dtype=np.int64)
        self._group = np.asarray(topo.group_of, dtype=np.int64)
        self._nics = np.array([len(self._hosts_of(r)) for r in self.ranks], dtype=np.int64)

    def ring_step(self, nbytes: float) -> float:
        i = np.arange(self.n)
        return self._step(i, (i + 1) % self.n, nbytes)

    def pair_step(self, distance: int, p: int, nbytes: float) -> float:
        i = np.arange(p)
        return self._step(i, i ^ distance, nbytes)

    def fold_step(self, p: int, nbytes: float) -> float:
        i = np.arange(self.n - p)
        return self._step(p + i, i, nbytes)

    def shift_step(self, distance: int, nbytes: float) -> float:
        i = np.arange(self.n)
        return self._step(i, (i + distance) % self.n, nbytes)

    def split(self) -> "tuple[list[RankFabric], RankFabric] | None":
        levels = _hier.splitting(self.ranks, self.levels)
        if not levels:
            return None
        parts = _hier.units(self.topo.ring_order(self.ranks), levels[0])
        cover = {u[0]: frozenset().union(*(self._hosts_of(r) for r in u)) for u in parts}
        return ([RankFabric(self.topo, u, levels[1:], self.hosts) for u in parts],
                RankFabric(self.topo, [u[0] for u in parts], levels[1:], cover))

    def ordered(self) -> "RankFabric":
        return RankFabric(self.topo, self.topo.ring_order(self.ranks), self.levels, self.hosts)

    def _hosts_of(self, r: int) -> frozenset[int]:
        return self.hosts.get(r) or frozenset((self.topo.host_of[r],))

    def shm_bandwidth(self) -> float:
        return self.topo.tiers["local"].bandwidth

    def _step(self, src: np.ndarray, dst: np.ndarray, nbytes: float) -> float:
        """Time of one step in which the rank at each position of ``src`` sends ``nbytes`` to
        the one at the same place of ``dst``, all at once (positions in ``ranks``).

        A message that leaves its host shares the host's NIC with the step's other messages
        leaving it, and one that leaves its group the group's uplink likewise: counted with
        NumPy over the messages (a pairwise alltoall takes n-1 steps of n messages)."""
        if src.size == 0:
            return 0.0
        tiers = self.topo.tiers
        ha, hb = self._host[self._rank[src]], self._host[self._rank[dst]]
        ga, gb = self._group[ha], self._group[hb]
        leaves_host, leaves_group = ha != hb, ga != gb
        bandwidth = np.full(src.size, tiers["local"].bandwidth)
        latency = np.full(src.size, tiers["local"].latency)
        if leaves_host.any():
            # A stand-in's shares leave through every NIC of its unit (``hosts``) at once.
            out = ha[leaves_host]
            bandwidth[leaves_host] = (tiers["host"].bandwidth * self._nics[src[leaves_host]]
                                      / np.bincount(out)[out])
            latency[leaves_host] = tiers["host"].latency
        if leaves_group.any():
            out = ga[leaves_group]
            bandwidth[leaves_group] = np.minimum(
                bandwidth[leaves_group], tiers["group"].bandwidth / np.bincount(out)[out])
            latency[leaves_group] = tiers["group"].latency
        return float(np.max(latency + nbytes / bandwidth))
