"""The cost model's fabric for a cluster of any size: closed forms over tiers of identical units.

``costs.py`` holds the allreduce formulas; they ask a fabric what one step costs (see there).
The planner's ``RankFabric`` enumerates every message of a step over the job's ranks; that is
exact but costs O(n) Python work per step and O(n^2) for a ring. ``TierFabric`` answers the
same questions for a ``Cluster`` whose units at every tier are identical (ranks placed node by
node, the last unit of a tier possibly partial), with the same step rule:

    step time = max over messages of (latency of its tier + bytes / its bandwidth)
    bandwidth = the first tier's, inside a node; else min over the units it leaves (node,
                rack, ...) of that unit's uplink / messages leaving that unit in the step

Vocabulary: level 0 is a rank, level 1 a node, level u+1 a unit of tier u; a message *crosses
tier t* when its ranks share a level t+1 unit but not a level t unit. A fabric's *active*
ranks are every ``stride``-th rank of the first ``ranks`` (stride 1: all; stride = a node's
ranks: one stand-in per node, as the hierarchical plan uses one tier up).

- Ring step, closed form. In block order every unit that holds active ranks sends exactly one
  message out of itself (its last rank's), so every uplink is shared by one message, and tier
  t is crossed iff some level t+1 unit holds two level t units. Time: max over the crossed
  tiers of latency_t + b / min(uplinks of levels 1..t), independent of n.
- Pair and fold steps (recursive doubling's partners ``i XOR d``), counted: the messages that
  leave each unit are counted with NumPy over the active ranks, O(n) per step, a few
  milliseconds at 27,360 ranks. (Closed forms exist when every fanout is a power of two; with
  six GPUs per node they do not.)
- Shift steps (the alltoalls' ``i -> i + d mod n``), counted the same way, but the pairwise
  alltoall takes n-1 of them. Let ``far`` be the active ranks of one unit of the highest
  level that has several: at every distance ``far <= d <= n - far`` every message leaves
  every unit up to that level (a unit's ranks ``[a, a + s)`` send to ``[a + d, a + s + d)``
  mod n, which misses the unit when ``s <= d <= n - s``) and crosses the same tier, and
  each unit sends all of its ranks' messages: the same step. It is counted once
  (``_shifts``, by distance: a step's worst latency and bandwidth per tier serve every
  size), so the pairwise alltoall costs 2 far counted steps, not n; and each counts only
  the senders of four units of ``far`` ranks, the first two and the last two (``_shifted``
  says why the others add nothing): 2 far x 4 far messages in all.
- ``split``: the lowest level with several units of several active ranks; its parts are one
  full unit and the partial last one, its owners the same ranks at the unit's stride.
- A stand-in's links. An active rank at stride s stands for the s ranks of its unit (fewer
  in the partial last one), whose shares leave at once: through an uplink of a level whose
  units hold s ranks or more they pass together (one message), but below it they spread over
  the unit's own links, so a level u unit of ``size_u`` < s ranks lends the stand-in
  ``ceil(ranks of the unit / size_u)`` of its uplinks: a rack's stand-in sends through all
  of the rack's NICs. (``costs.py`` explains why; ``RankFabric`` does the same with hosts.)

On a cluster that a ``Topology`` can also describe (node, group), this fabric and the planner's
give the same numbers (``tests/test_simulate.py`` checks it).
"""

from __future__ import annotations

import numpy as np

from .cluster import Cluster

__all__ = ["TierFabric"]


class TierFabric:
    """The ranks ``0, stride, 2 stride, ..`` below ``ranks`` of ``cluster``, in block order."""

    def __init__(self, cluster: Cluster, ranks: int, stride: int = 1):
        if ranks > cluster.capacity:
            raise ValueError(f"cluster {cluster.name!r} holds at most {cluster.capacity:.0f} "
                             f"ranks, asked for {ranks}")
        self.cluster, self.ranks, self.stride = cluster, ranks, stride
        self.n = -(-ranks // stride)
        self.reduce_bandwidth = cluster.reduce_bandwidth
        self._sizes = cluster.unit_ranks()
        self._uplinks = cluster.uplinks()
        self._latency = [t.latency for t in cluster.tiers]
        last = ranks - (self.n - 1) * stride  # the ranks the last stand-in stands for
        # _links[0]: how many level u uplinks a full unit's stand-in sends through at once
        # (1 at and above its own level), _links[1]: the partial last unit's.
        self._links = [np.array([_spread(size, stride, r) for size in self._sizes], dtype=float)
                       for r in (stride, last)]
        self._far = 1  # the active ranks of a unit of the highest level with several
        for level in range(1, len(self._latency)):
            if self._units(level) > 1:
                self._far = max(1, -(-int(self._sizes[level]) // stride))
        self._shifts: dict[int, list[tuple[float, float]]] = {}  # shift_step's, by distance

    def _units(self, level: int) -> int:
        """How many level ``level`` units hold active ranks."""
        size = self._sizes[level]
        return self.n if size <= self.stride else -(-self.ranks // size)

    def _bandwidth(self, tier: int, links: np.ndarray) -> float:
        """A lone message's bandwidth across ``tier`` from a stand-in with ``links``."""
        if tier == 0:
            return self._uplinks[0]
        return min(up * k for up, k in zip(self._uplinks[1:tier + 1], links[1:tier + 1]))

    # --- the steps ---------------------------------------------------------------------------
    def ring_step(self, nbytes: float) -> float:
        if self.n < 2:
            return 0.0
        crossed = [t for t in range(len(self._latency)) if self._units(t) > self._units(t + 1)]
        worst = max(self._latency[t] + nbytes / self._bandwidth(t, self._links[0])
                    for t in crossed)
        # The last stand-in (its unit possibly partial, fewer links) closes the ring: its
        # message crosses the highest tier crossed.
        top = crossed[-1]
        return max(worst, self._latency[top] + nbytes / self._bandwidth(top, self._links[1]))

    def pair_step(self, distance: int, p: int, nbytes: float) -> float:
        src = np.arange(p, dtype=np.int64)
        return self._step(src, src ^ distance, nbytes)

    def fold_step(self, p: int, nbytes: float) -> float:
        dst = np.arange(self.n - p, dtype=np.int64)
        return self._step(dst + p, dst, nbytes)

    def shift_step(self, distance: int, nbytes: float) -> float:
        n = self.n
        distance %= n
        if self._far <= distance <= n - self._far:
            distance = self._far  # the same step at every such distance (module docstring)
        worst = self._shifts.get(distance)
        if worst is None:
            src = self._shifted(np.arange(n, dtype=np.int64))
            worst = self._shifts[distance] = self._worst(src, (src + distance) % n)
        return _time(worst, nbytes)

    def _shifted(self, ranks: np.ndarray) -> np.ndarray:
        """The senders whose messages show every kind a shift step has: the ranks of the
        first two and the last two units of ``far`` ranks. A unit sends ``[a, a + far)`` to
        ``[a + d, a + far + d)``; only where that range wraps past rank n - 1 (the last units
        for d < far, the first for d > n - far) or the unit is partial (the last) does it
        differ from unit 1's: every other unit repeats unit 1 (its units below nest in it, so
        their counts are whole)."""
        far, units = self._far, -(-self.n // self._far)
        if units <= 4:
            return ranks
        return np.concatenate([ranks[:2 * far], ranks[(units - 2) * far:]])

    def _step(self, src: np.ndarray, dst: np.ndarray, nbytes: float) -> float:
        return _time(self._worst(src, dst), nbytes)

    def _worst(self, src: np.ndarray, dst: np.ndarray) -> list[tuple[float, float]]:
        """Per tier the step's messages cross: its latency and their least bandwidth. A step
        of b bytes lasts the largest latency + b / bandwidth of these, whatever b (of the
        messages on one tier, the one with the least bandwidth is the slowest)."""
        if src.size == 0:
            return []
        a, b = src * self.stride, dst * self.stride
        levels = len(self._latency)
        # tier[i]: the lowest t with both ends in one level t+1 unit.
        tier = np.zeros(a.size, dtype=np.int64)
        for t in range(1, levels):
            tier[(a // self._sizes[t]) != (b // self._sizes[t])] = t
        bandwidth = np.full(a.size, np.inf)
        bandwidth[tier == 0] = self._uplinks[0]
        last = a == (self.n - 1) * self.stride
        for u in range(1, levels):
            out = tier >= u  # leaves its level u unit
            if not out.any():
                break
            unit = a[out] // int(self._sizes[u])
            counts = np.bincount(unit)[unit]  # the messages that leave each unit at once
            links = np.where(last[out], self._links[1][u], self._links[0][u])
            bandwidth[out] = np.minimum(bandwidth[out], self._uplinks[u] * links / counts)
        return [(self._latency[t], float(bandwidth[tier == t].min()))
                for t in range(levels) if (tier == t).any()]

    # --- structure --------------------------------------------------------------------------
    def split(self) -> "tuple[list[TierFabric], TierFabric] | None":
        for level in range(1, len(self._latency)):
            if self._sizes[level] <= self.stride:
                continue
            units = self._units(level)
            if 1 < units < self.n:
                size = int(self._sizes[level])
                last = self.ranks - (units - 1) * size
                parts = [TierFabric(self.cluster, size, self.stride)]
                if last != size:
                    parts.append(TierFabric(self.cluster, last, self.stride))
                return parts, TierFabric(self.cluster, self.ranks, size)
        return None

    def ordered(self) -> "TierFabric":
        return self

    def shm_bandwidth(self) -> float:
        return self._uplinks[0]

    def __repr__(self) -> str:
        return f"TierFabric({self.cluster.name!r}, ranks={self.ranks}, stride={self.stride})"


def _time(worst: list[tuple[float, float]], nbytes: float) -> float:
    """A step's seconds for ``nbytes`` a message, from ``TierFabric._worst``."""
    return max((latency + nbytes / bandwidth for latency, bandwidth in worst), default=0.0)


def _spread(size: float, stride: int, ranks: int) -> int:
    """How many level units of ``size`` ranks a stand-in of ``ranks`` ranks (at ``stride``)
    sends through at once: 1 at levels whose units hold a whole stand-in's unit."""
    return 1 if size >= stride else -(-ranks // int(size))


