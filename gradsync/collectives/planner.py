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
"""

from __future__ import annotations

import logging
from typing import Sequence

from ..cluster.topology import Topology
from .costs import RankFabric, allreduce_time, cheapest, choose

__all__ = ["ALGORITHMS", "CANDIDATES", "Plans", "choose_allreduce", "predict", "plan"]

log = logging.getLogger("gradsync")

# (ranks, request, algorithm) already logged by this process: one set for all its Worlds, since
# a process set or torch group of the same ranks (a sub-world with Plans of its own) decides
# alike, and kept apart from a Plans' memory, whose clearing would log them again.
_announced: set[tuple[int, str, str]] = set()

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
    """``choose_allreduce`` for one job, remembered per (bytes, requested algorithm).

    Args:
        size: the number of ranks.
        config: the job's Config (``algorithm``, ``small_bytes``, ``medium_bytes``).
        has_shm_group: whether every rank shares this host's shared-memory group.
        topo: the job's Topology.
        limit: entries kept; past it the memory is cleared (sizes of a training job are few).
        announce: log each algorithm at INFO when it is first chosen (rank 0 of a World).
    """

    def __init__(self, size: int, config, has_shm_group: bool,
                 topo: "Topology | None" = None, limit: int = 4096, announce: bool = False):
        self.size, self.config, self.has_shm_group, self.topo = size, config, has_shm_group, topo
        self.limit = limit
        self._chosen: dict[tuple[int, str], str] = {}
        self.announce = announce

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
            if self.announce and (self.size, requested, alg) not in _announced:
                _announced.add((self.size, requested, alg))
                log.info("allreduce over %d ranks: %s, first chosen for %d bytes (requested "
                         "%s)", self.size, alg, nbytes, requested)
        return alg


def predict(algorithm: str, nbytes: int, topo: Topology) -> float:
    """Predicted seconds for an allreduce of ``nbytes`` over every rank of ``topo``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"no cost model for {algorithm!r}")
    return allreduce_time(algorithm, RankFabric(topo, range(topo.size)), nbytes)


def plan(topo: Topology, sizes: Sequence[int]) -> list[dict]:
    """For each size: every candidate's predicted seconds and the choice."""
    rows = []
    fabric = RankFabric(topo, range(topo.size))  # ``predict``'s
    for nbytes in sizes:
        times = {alg: allreduce_time(alg, fabric, nbytes) for alg in CANDIDATES}
        rows.append({"size": nbytes, "predicted": times, "choice": choose(fabric, times)})
    return rows

