"""Hierarchical allreduce, allgather and broadcast: plan the traffic for the network's tiers.

A flat ring over ranks on several hosts sends 2(n-1)/n of the data over *some* slow link
in every one of its 2(n-1) steps. The hierarchical allreduce keeps the slow tier for the
least traffic, and uses all of its links at once:

    1. reduce-scatter inside each host (fast tier): local rank j ends with the host's sum of
       its *share*, 1/k of the data (k ranks on the host);
    2. allreduce each share across hosts, among the ranks that own it (one per host): the k
       local ranks of a host run k such allreduces at the same time, each on 1/k of the data,
       so every host's link carries the whole inter-host traffic in parallel streams;
    3. allgather inside each host: every local rank gets every share.

The slow tier carries 2(H-1)/H of the data per host (H hosts), the minimum for any
allreduce across H hosts; a flat ring in host order carries the same amount but through one
connection per host at a time, and a ring that alternates hosts carries it k times over.

More tiers nest the same way: step 2 across hosts is itself hierarchical when hosts are
grouped (reduce-scatter among the hosts of a group, allreduce across groups, allgather), so
the slowest tier sees the least traffic.

Uneven hosts. With k_h ranks on host h, the data is cut into ``m = max k_h`` blocks (the
largest host gives each rank one). On a host with k ranks, block b belongs to local rank
``b * k // m``, so each local rank owns a contiguous run of blocks and step 1 is an ordinary
reduce-scatter. Step 2 runs once per block, in block order, among the owners of that block
(one per host): a rank on a small host takes part in several, one after another; on even
hosts every rank takes part in exactly one and all run at once. Every rank walks the blocks
in the same order, so the messages between any two ranks pair up.

All steps run on views (``Comm.view``) of the job's communicator, so they reuse the flat
algorithms unchanged: ring for large pieces, recursive doubling for small ones.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..cluster.topology import Topology
from ..transport.comm import Communicator
from . import doubling, ring, tree
from .ops import Reducer

__all__ = ["allreduce", "allgather", "broadcast", "levels_of", "splitting", "units",
           "block_owners"]

Level = Callable[[int], int]
"""Maps a global rank to its unit at one tier (its host, or its group of hosts)."""


def levels_of(topo: Topology) -> list[Level]:
    """The tiers to plan for, fastest first: hosts, then groups when there are several."""
    levels: list[Level] = [lambda r: topo.host_of[r]]
    if len(topo.groups) > 1:
        levels.append(lambda r: topo.group_of[topo.host_of[r]])
    return levels


def units(ranks: Sequence[int], level: Level) -> list[list[int]]:
    """``ranks`` split by their unit at ``level``, units and ranks in the order of ``ranks``."""
    by: dict[int, list[int]] = {}
    for r in ranks:
        by.setdefault(level(r), []).append(r)
    return list(by.values())


def block_owners(unit_sizes: Sequence[int]) -> tuple[int, list[list[int]]]:
    """``(m, owners)``: the number of blocks, and for each unit the local owner of each block."""
    m = max(unit_sizes)
    return m, [[b * k // m for b in range(m)] for k in unit_sizes]


def allreduce(comm: Communicator, data: np.ndarray, reducer: Reducer, order: Sequence[int],
              levels: Sequence[Level], chunk_bytes: int, small_bytes: int = 64 << 10) -> None:
    """Reduces ``data`` in place across all ranks of ``comm``, planned for ``levels``.

    Args:
        comm: the job's communicator.
        order: every rank, in topology order (``Topology.ring_order``): the ranks of a unit
            adjacent, so that each ring stays inside its unit and crosses tiers least.
        levels: tier functions, fastest first (``levels_of``).
        chunk_bytes: ring segment size.
        small_bytes: below this, a flat step uses recursive doubling instead of a ring.
    """
    _allreduce(comm, list(order), data, reducer, list(levels), chunk_bytes, small_bytes)


def splitting(ranks: Sequence[int], levels: Sequence[Level]) -> list[Level]:
    """The levels that split ``ranks`` into several units of which some hold several ranks."""
    return [lv for lv in levels if 1 < len({lv(r) for r in ranks}) < len(ranks)]


def _allreduce(comm: Communicator, ranks: list[int], data: np.ndarray, reducer: Reducer,
               levels: list[Level], chunk_bytes: int, small_bytes: int) -> None:
    levels = splitting(ranks, levels)
    if not levels:
        _flat(_view(comm, ranks), data, reducer, chunk_bytes, small_bytes)
        return
    parts = units(ranks, levels[0])
    me = next(i for i, u in enumerate(parts) if comm.rank in u)
    m, owners = block_owners([len(u) for u in parts])
    bounds = ring.block_offsets(ring.even_counts(data.size, m), m, data.size)
    mine = owners[me]
    local = _view(comm, parts[me])
    counts = [sum(bounds[b + 1] - bounds[b] for b in range(m) if mine[b] == j)
              for j in range(len(parts[me]))]
    ring.reduce_scatter(local, data, counts, reducer, chunk_bytes)
    for b in range(m):
        if parts[me][mine[b]] == comm.rank:
            group = [unit[owners[u][b]] for u, unit in enumerate(parts)]
            _allreduce(comm, group, data[bounds[b]:bounds[b + 1]], reducer, levels[1:],
                       chunk_bytes, small_bytes)
    ring.allgather(local, data, counts, chunk_bytes)


def _flat(view: Communicator, data: np.ndarray, reducer: Reducer, chunk_bytes: int,
          small_bytes: int) -> None:
    if view.size == 1 or data.size == 0:
        return
    if data.nbytes < small_bytes:
        doubling.allreduce(view, data, reducer)
    else:
        ring.allreduce(view, data, reducer, chunk_bytes)


def allgather(comm: Communicator, data: np.ndarray, counts: Sequence[int], order: Sequence[int],
              levels: Sequence[Level], chunk_bytes: int) -> None:
    """Allgather in place: rank r's ``counts[r]`` elements sit at its offset (rank order).

    1. Inside each unit, a ring gathers the unit's blocks.
    2. Across units, each unit's blocks are cut into m slices (m = ranks on the largest
       unit); slice s travels round a ring of its owners, one per unit, so all of a unit's
       links work at once, each on a slice.
    3. Inside each unit, a ring shares what each local rank received.
    With nested levels, step 2 uses a flat ring across the units (groups are not nested
    further: allgather traffic is the same on every tier, only its paths change).
    """
    ranks = list(order)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    levels = splitting(ranks, levels)
    span = lambda r: (int(offsets[r]), int(offsets[r + 1]))  # noqa: E731
    if not levels:
        _gather_spans(_view(comm, ranks), data, [[span(r)] for r in ranks], chunk_bytes)
        return
    parts = units(ranks, levels[0])
    me = next(i for i, u in enumerate(parts) if comm.rank in u)
    local = _view(comm, parts[me])
    _gather_spans(local, data, [[span(r)] for r in parts[me]], chunk_bytes)
    m, owners = block_owners([len(u) for u in parts])
    pieces = [_slices([span(r) for r in u], m) for u in parts]  # pieces[u][s]: spans
    for s in range(m):
        if parts[me][owners[me][s]] == comm.rank:
            group = [unit[owners[u][s]] for u, unit in enumerate(parts)]
            _gather_spans(_view(comm, group), data, [pieces[u][s] for u in range(len(parts))],
                          chunk_bytes)
    others = [u for u in range(len(parts)) if u != me]
    _gather_spans(local, data, [[sp for u in others for s in range(m) if owners[me][s] == j
                                 for sp in pieces[u][s]] for j in range(len(parts[me]))],
                  chunk_bytes)


def _slices(spans: list[tuple[int, int]], m: int) -> list[list[tuple[int, int]]]:
    """Cuts the concatenation of ``spans`` into ``m`` nearly even slices of spans."""
    total = sum(hi - lo for lo, hi in spans)
    cuts = ring.block_offsets(ring.even_counts(total, m), m, total)
    out: list[list[tuple[int, int]]] = []
    for s in range(m):
        a, b = cuts[s], cuts[s + 1]
        pieces, pos = [], 0
        for lo, hi in spans:
            n = hi - lo
            x, y = max(a, pos), min(b, pos + n)
            if x < y:
                pieces.append((lo + x - pos, lo + y - pos))
            pos += n
        out.append(pieces)
    return out


def _gather_spans(view: Communicator, data: np.ndarray, spans: list[list[tuple[int, int]]],
                  chunk_bytes: int) -> None:
    """Allgather where member i contributes the (possibly scattered) spans ``spans[i]``."""
    if view.size == 1:
        return
    counts = [sum(hi - lo for lo, hi in s) for s in spans]
    if all(len(s) == 1 for s in spans) and all(a[0][1] == b[0][0]
                                               for a, b in zip(spans, spans[1:])):
        lo = spans[0][0][0]  # one span each, adjacent in member order: gather in place
        ring.allgather(view, data[lo:lo + sum(counts)], counts, chunk_bytes)
        return
    packed = np.empty(sum(counts), dtype=data.dtype)
    at = sum(counts[:view.rank])
    for lo, hi in spans[view.rank]:
        packed[at:at + hi - lo] = data[lo:hi]
        at += hi - lo
    ring.allgather(view, packed, counts, chunk_bytes)
    at = 0
    for i, member in enumerate(spans):
        for lo, hi in member:
            if i != view.rank:
                data[lo:hi] = packed[at:at + hi - lo]
            at += hi - lo


def broadcast(comm: Communicator, data: np.ndarray, root: int, order: Sequence[int],
              levels: Sequence[Level], chunk_bytes: int) -> None:
    """Broadcast from rank ``root``: across units first, then inside each.

    The data crosses the slow tier once per unit, to one rank of it (the root in its own
    unit, the unit's first rank elsewhere); then a tree inside each unit spreads it on the
    fast tier. With nested levels the step across units is itself hierarchical.
    """
    _broadcast(comm, list(order), data, root, list(levels), chunk_bytes)


def _broadcast(comm: Communicator, ranks: list[int], data: np.ndarray, root: int,
               levels: list[Level], chunk_bytes: int) -> None:
    levels = splitting(ranks, levels)
    if not levels:
        tree.broadcast(_view(comm, ranks), data, ranks.index(root), chunk_bytes)
        return
    parts = units(ranks, levels[0])
    leaders = [root if root in u else u[0] for u in parts]
    me = next(i for i, u in enumerate(parts) if comm.rank in u)
    if comm.rank in leaders:
        _broadcast(comm, leaders, data, root, levels[1:], chunk_bytes)
    tree.broadcast(_view(comm, parts[me]), data, parts[me].index(leaders[me]), chunk_bytes)


def _view(comm: Communicator, ranks: list[int]) -> Communicator:
    """``comm`` itself when ``ranks`` is every rank in order, else its view of ``ranks``."""
    return comm if ranks == list(range(comm.size)) else comm.view(ranks)
