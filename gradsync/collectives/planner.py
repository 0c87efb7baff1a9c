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
``choose_allreduce`` picks the cheapest candidate when ranks span several hosts; on one host it
picks ``shm`` if the group exists, else by size (the tiers' constants describe shared memory,
not the loopback TCP that a forced ``transport=tcp`` uses).
"""

from __future__ import annotations

from typing import Sequence

from ..topology import Topology
from .costs import RankFabric, allreduce_time

__all__ = ["ALGORITHMS", "CANDIDATES", "choose_allreduce", "predict", "plan"]

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


def predict(algorithm: str, nbytes: int, topo: Topology) -> float:
    """Predicted seconds for an allreduce of ``nbytes`` over every rank of ``topo``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"no cost model for {algorithm!r}")
    return allreduce_time(algorithm, RankFabric(topo, range(topo.size)), nbytes)


def plan(topo: Topology, sizes: Sequence[int]) -> list[dict]:
    """For each size: every candidate's predicted seconds and the choice."""
    rows = []
    for nbytes in sizes:
        times = {alg: predict(alg, nbytes, topo) for alg in CANDIDATES}
        rows.append({"size": nbytes, "predicted": times, "choice": min(times, key=times.get)})
    return rows

