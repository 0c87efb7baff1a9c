"""Which allreduce algorithm to use: a cost model over the job's topology.

Candidates:

    shm               the host's shared-memory group (every rank on one host)
    doubling          recursive doubling: log2 n steps, the whole message each step
    halving_doubling  Rabenseifner: log2 n steps of halving, then of doubling, sizes halve
    ring              ring in rank order: 2(n-1) steps of 1/n of the message
    topo_ring         the same ring with ranks in topology order (``Topology.ring_order``)
    hierarchical      reduce-scatter in each host, allreduce of the shares across hosts,
                      allgather in each host (``hierarchical.py``)

The model (``predict``) is the usual latency-bandwidth one, per step of each algorithm:

    step time = max over the step's messages of (latency + bytes / bandwidth) + fold time

where a message's tier is the slowest tier between its two ranks, and its bandwidth is the
tier's link bandwidth divided by the number of the step's messages that leave the same host
(or group) over that tier at the same time: k ranks of one host sending to other hosts share
its NIC. Folding costs ``bytes / reduce_bandwidth``. The constants come from the topology
(``gradsync probe`` measures them; defaults otherwise). ``choose_allreduce`` picks the
cheapest candidate when ranks span several hosts; on one host it picks ``shm`` if the group
exists, else by size (the tiers' constants describe shared memory, not the loopback TCP that
a forced ``transport=tcp`` uses).

The choice depends only on the size, the requested algorithm and the job, none of which
changes between calls, so ``Plans`` remembers it per (size, request): the planner runs once
per size, not on every call (a small allreduce would otherwise pay for it each time).
"""

from __future__ import annotations

import math
from typing import Sequence

from ..topology import Topology
from . import hierarchical
from .doubling import core_size

__all__ = ["ALGORITHMS", "CANDIDATES", "Plans", "choose_allreduce", "predict", "plan"]

ALGORITHMS = ("ring", "topo_ring", "doubling", "halving_doubling", "hierarchical", "shm")
CANDIDATES = ("doubling", "halving_doubling", "ring", "topo_ring", "hierarchical")


def choose_allreduce(nbytes: int, size: int, requested: str, config, has_shm_group: bool,
                     topo: "Topology | None" = None) -> str:
    """Returns the algorithm name for an allreduce of ``nbytes`` over ``size`` ranks.

    Raises:
        ValueError: an unknown algorithm, or ``shm`` when the ranks span several hosts.
    """
    if requested == "auto":
        requested = config.algorithm
    if requested == "auto":
        if has_shm_group:
            return "shm"
        if topo is not None and len(topo.hosts) > 1:
            return min(CANDIDATES, key=lambda alg: predict(alg, nbytes, topo))
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
    """``choose_allreduce`` for one job, remembered per (bytes, requested algorithm).

    Args:
        size: the number of ranks.
        config: the job's Config (``algorithm``, ``small_bytes``, ``medium_bytes``).
        has_shm_group: whether every rank shares this host's shared-memory group.
        topo: the job's Topology.
        limit: entries kept; past it the memory is cleared (sizes of a training job are few).
    """

    def __init__(self, size: int, config, has_shm_group: bool,
                 topo: "Topology | None" = None, limit: int = 4096):
        self.size, self.config, self.has_shm_group, self.topo = size, config, has_shm_group, topo
        self.limit = limit
        self._chosen: dict[tuple[int, str], str] = {}

    def allreduce(self, nbytes: int, requested: str = "auto") -> str:
        """The algorithm for an allreduce of ``nbytes``; raises as ``choose_allreduce``."""
        key = (nbytes, requested)
        alg = self._chosen.get(key)
        if alg is None:
            alg = choose_allreduce(nbytes, self.size, requested, self.config,
                                   self.has_shm_group, self.topo)
            if len(self._chosen) >= self.limit:
                self._chosen.clear()
            self._chosen[key] = alg
        return alg


# --- the cost model ---------------------------------------------------------------------------

def _step(topo: Topology, messages: Sequence[tuple[int, int]], nbytes: float) -> float:
    """Time of one step in which each (src, dst) message carries ``nbytes`` at once."""
    if not messages:
        return 0.0
    leaving: dict[tuple[str, int], int] = {}
    for a, b in messages:
        for key in _uplinks(topo, a, b):
            leaving[key] = leaving.get(key, 0) + 1
    worst = 0.0
    for a, b in messages:
        tier = topo.tier(a, b)
        bandwidth = topo.tiers["local"].bandwidth if tier == "local" else min(
            topo.tiers[t].bandwidth / leaving[(t, unit)] for t, unit in _uplinks(topo, a, b))
        worst = max(worst, topo.tiers[tier].latency + nbytes / bandwidth)
    return worst


def _uplinks(topo: Topology, a: int, b: int) -> list[tuple[str, int]]:
    """The shared links a message from ``a`` to ``b`` goes through: its host's NIC when it
    leaves the host, and its group's uplink when it leaves the group."""
    ha, hb = topo.host_of[a], topo.host_of[b]
    if ha == hb:
        return []
    out = [("host", ha)]
    if topo.group_of[ha] != topo.group_of[hb]:
        out.append(("group", topo.group_of[ha]))
    return out


def _ring(topo: Topology, order: Sequence[int], nbytes: float) -> float:
    n = len(order)
    if n < 2:
        return 0.0
    edges = list(zip(order, list(order[1:]) + [order[0]]))
    piece = nbytes / n
    step = _step(topo, edges, piece)
    return (n - 1) * (step + piece / topo.reduce_bandwidth) + (n - 1) * step


def _doubling(topo: Topology, ranks: Sequence[int], nbytes: float) -> float:
    n = len(ranks)
    p = core_size(n)
    total = 0.0
    if p < n:  # fold the extra ranks in before and out after
        fold = [(ranks[p + i], ranks[i]) for i in range(n - p)]
        total += 2 * _step(topo, fold, nbytes) + nbytes / topo.reduce_bandwidth
    for i in range(int(math.log2(p))):
        pairs = [(ranks[r], ranks[r ^ (1 << i)]) for r in range(p)]
        total += _step(topo, pairs, nbytes) + nbytes / topo.reduce_bandwidth
    return total


def _halving_doubling(topo: Topology, ranks: Sequence[int], nbytes: float) -> float:
    n = len(ranks)
    p = core_size(n)
    total = 0.0
    if p < n:
        fold = [(ranks[p + i], ranks[i]) for i in range(n - p)]
        total += 2 * _step(topo, fold, nbytes) + nbytes / topo.reduce_bandwidth
    size = nbytes
    steps = int(math.log2(p))
    for i in reversed(range(steps)):  # halving: partners at distance p/2, p/4, ...
        size /= 2
        pairs = [(ranks[r], ranks[r ^ (1 << i)]) for r in range(p)]
        total += 2 * _step(topo, pairs, size) + size / topo.reduce_bandwidth  # there and back
    return total


def _hierarchical(topo: Topology, ranks: Sequence[int], nbytes: float,
                  levels: "Sequence | None" = None) -> float:
    """Mirrors ``hierarchical.allreduce`` (with its own level and unit helpers): a ring
    allreduce's worth of traffic inside each unit (reduce-scatter, then allgather), and the
    shares' allreduce across units, where a rank of a unit with k ranks handles ceil(m / k)
    of the m shares one after another, while the k ranks of its unit share its uplink."""
    levels = hierarchical.splitting(ranks, hierarchical.levels_of(topo) if levels is None
                                    else levels)
    if not levels:
        return _ring(topo, topo.ring_order(ranks), nbytes)
    parts = hierarchical.units(topo.ring_order(ranks), levels[0])
    m = max(len(u) for u in parts)
    inside = max(_ring(topo, u, nbytes) for u in parts)
    owners = [u[0] for u in parts]  # stand-ins for each share's owners, one per unit
    cross = max(math.ceil(m / k) * _hierarchical(topo, owners, nbytes * k / m, levels[1:])
                for k in {len(u) for u in parts})
    return inside + cross


def predict(algorithm: str, nbytes: int, topo: Topology) -> float:
    """Predicted seconds for an allreduce of ``nbytes`` over every rank of ``topo``."""
    ranks = list(range(topo.size))
    if algorithm == "ring":
        return _ring(topo, ranks, nbytes)
    if algorithm == "topo_ring":
        return _ring(topo, topo.ring_order(), nbytes)
    if algorithm == "doubling":
        return _doubling(topo, ranks, nbytes)
    if algorithm == "halving_doubling":
        return _halving_doubling(topo, ranks, nbytes)
    if algorithm == "hierarchical":
        return _hierarchical(topo, ranks, nbytes)
    if algorithm == "shm":
        k = topo.size
        return 3 * nbytes * (k - 1) / k / topo.tiers["local"].bandwidth
    raise ValueError(f"no cost model for {algorithm!r}")


def plan(topo: Topology, sizes: Sequence[int]) -> list[dict]:
    """For each size: every candidate's predicted seconds and the choice."""
    rows = []
    for nbytes in sizes:
        times = {alg: predict(alg, nbytes, topo) for alg in CANDIDATES}
        rows.append({"size": nbytes, "predicted": times, "choice": min(times, key=times.get)})
    return rows

