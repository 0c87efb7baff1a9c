"""Compression on the slow tier only: full precision inside a host, compressed between hosts.

Compressing every rank's gradient (the flat schedule of each compressor) puts compressed
bytes on every link, shared memory included, and pays every rank's rounding: with k ranks
on each of H hosts, the slow links carry k compressed copies per host, and n = k H
roundings are summed. Here the reduction follows the hierarchical allreduce
(``collectives/hierarchical.py``) and compresses only its last step, the one that crosses
the slowest tier:

    1. reduce-scatter inside each host, in float32 (the fast tier: shared memory): local
       rank j ends with the host's sum of its *block*;
    2. the owners of block b, one per host, reduce it with the compressor (the slow tier):
       each host's sum of each block is compressed once, by the rank that owns it;
    3. allgather inside each host, in float32: every local rank gets every block.

So the slow tier carries one compressed copy of the gradient per host, spread over the host's
k ranks (k parallel streams, each 1/k of the data), and the sum over ranks has H roundings
(one per host's sum), not n. More tiers nest the same way: with groups of hosts (racks),
step 2 is itself a float32 reduce-scatter among the hosts of a group, a compressed reduction
across groups, and an allgather; only the slowest tier the topology names is compressed.

Blocks. As in the hierarchical allreduce, the data is cut into ``m`` blocks (m = ranks on
the largest host); block b belongs to local rank ``b * k // m`` of a host with k ranks, so
uneven hosts work and every rank walks the blocks in the same order. A compressor whose
arithmetic is element-wise (int8, fp8, random-k: ``shardable``) runs on each block as a
flat tensor. PowerSGD needs each matrix whole, so it gets one block: the host's sum is
reduced onto local rank 0 (the host's *leader*), the leaders run PowerSGD, and each leader
sends the result back to its host: the *funnel* (``Comm.reduce_to_leader_`` and
``broadcast_from_leader_``). On a World it is ``collectives/funnel.py``: a pipelined chain
(the ring with one non-empty block; each link carries the bucket once, in S + k - 2 steps of
a segment for S segments and k ranks), a binomial tree (ceil(log2 k) rounds of the whole
bucket) or a split (k blocks: a reduce-scatter and a gather, a scatter and an allgather),
whichever the cost model predicts fastest on the unit's ranks: the tree for the smallest
buckets, the split in between, the chain for the largest. Whichever ran, every rank of the
unit ends with the leader's bits.

Worked example, 2 hosts of 2 ranks (ranks 0, 1 on host a, 2, 3 on host b), int8, 8
elements: blocks [0:4] (owned by ranks 0 and 2) and [4:8] (ranks 1 and 3). Step 1: rank 0
holds host a's sum of [0:4], rank 1 of [4:8]. Step 2: ranks 0 and 2 run int8 on their 4
elements (one alltoall, one allgather between the two hosts), ranks 1 and 3 on theirs, at
the same time. Step 3: ranks 0 and 1 swap their blocks over shared memory.

Error feedback lives where the compression happens: each owner keeps the residual of its
block (under the bucket's key with ``@`` and the block's path, e.g. ``bucket0@0of2``), in
the compressor's ``state`` like every other residual, so ``state_dict`` and the elastic
handler carry it unchanged. A rank owns the same blocks at every step as long as the
topology does not change; after a resize the layout changes and each new block's residual
starts from zero (``CompressorState.tensor``).

``tiers="all"`` (the compressor's option) keeps the flat schedule, every tier compressed,
for comparison; a Comm that does not know its placement, or a job on one host, or one rank
per host, has nothing to split and gets the flat schedule too (there it is the same thing).
"""

from __future__ import annotations

import torch

from ..collectives import hierarchical, ring

__all__ = ["TIERS", "reduce", "subgroups"]

TIERS = ("slowest", "all")
"""What a compressor compresses: only the slowest tier (default) or every tier."""


def reduce(compressor, x: torch.Tensor, shapes: list[tuple], comm, key: str | None,
           average: bool) -> torch.Tensor | None:
    """The tiered reduction of ``x`` (float32, this rank's copy, reduced in place), or None
    when the flat schedule applies (the module docstring says when)."""
    if compressor.tiers == "all" or x.numel() == 0:
        return None
    placement = getattr(comm, "placement", None)
    topo = placement() if placement is not None else None
    if topo is None:
        return None
    if topo.size != comm.size:
        raise ValueError(f"{compressor.describe()}: the topology places {topo.size} ranks but "
                         f"the group has {comm.size}")
    ranks = topo.ring_order()
    levels = hierarchical.levels_of(topo)
    if not hierarchical.splitting(ranks, levels):
        return None
    prepare = getattr(comm, "prepare", None)
    if prepare is not None:
        prepare(subgroups(topo, compressor.shardable))
    comm.begin_tiered(f"{compressor.describe()} float32[{x.numel()}]")
    _reduce(compressor, comm, ranks, x, shapes, levels, key, "")
    if average:
        x /= comm.size
    return x


def subgroups(topo, shardable: bool) -> list[list[int]]:
    """Every group of ranks the tiered reduction runs a collective in, on any rank, in an
    order that depends on the topology alone (for a Comm whose sub-groups every rank must
    make in the same order, ``TorchComm.prepare``)."""
    out: list[list[int]] = []

    def walk(ranks: list[int], levels: list) -> None:
        levels = hierarchical.splitting(ranks, levels)
        if not levels:
            out.append(ranks)
            return
        parts = hierarchical.units(ranks, levels[0])
        out.extend(parts)
        m, owners = _blocks(parts, shardable)
        for b in range(m):
            walk([unit[owners[u][b]] for u, unit in enumerate(parts)], levels[1:])

    walk(topo.ring_order(), hierarchical.levels_of(topo))
    return list(map(list, dict.fromkeys(map(tuple, out))))


def _blocks(parts: list[list[int]], shardable: bool) -> tuple[int, list[list[int]]]:
    """(m, owners): a block per rank of the largest unit, or one block on each unit's first
    rank (its leader) for a compressor that needs whole tensors."""
    if shardable:
        return hierarchical.block_owners([len(unit) for unit in parts])
    return 1, [[0] for _ in parts]


def _reduce(compressor, comm, ranks: list[int], x: torch.Tensor, shapes: list[tuple],
            levels: list, key: str | None, path: str) -> None:
    """Reduces ``x`` over ``ranks`` (``comm``'s numbering): float32 inside the units of
    each level that splits them, the compressor across the last units."""
    levels = hierarchical.splitting(ranks, levels)
    if not levels:
        sub = comm.sub(ranks)
        name = None if key is None else f"{key}@{path}"
        x.copy_(compressor._reduce(x.clone(), shapes, sub, name, False))
        return
    parts = hierarchical.units(ranks, levels[0])
    me = next(i for i, unit in enumerate(parts) if comm.rank in unit)
    m, owners = _blocks(parts, compressor.shardable)
    bounds = ring.block_offsets(ring.even_counts(x.numel(), m), m, x.numel())
    mine = owners[me]
    counts = [sum(bounds[b + 1] - bounds[b] for b in range(m) if mine[b] == j)
              for j in range(len(parts[me]))]
    local = comm.sub(parts[me])
    if compressor.shardable:
        local.reduce_scatter_sum_(x, counts)
    else:  # one block, the leader's
        local.reduce_to_leader_(x)
    for b in range(m):
        if parts[me][mine[b]] == comm.rank:
            group = [unit[owners[u][b]] for u, unit in enumerate(parts)]
            piece = x[bounds[b]:bounds[b + 1]]
            block_shapes = [(piece.numel(),)] if compressor.shardable else shapes
            _reduce(compressor, comm, group, piece, block_shapes, levels[1:], key,
                    f"{path}.{b}of{m}" if path else f"{b}of{m}")
    if compressor.shardable:
        local.gather_blocks_(x, counts)
    else:
        local.broadcast_from_leader_(x)
