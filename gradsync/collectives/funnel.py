"""Funnel: a sum onto one rank (the *leader*) and its result back: a chain, a tree or a split.

Tiered PowerSGD (``compress/tiers.py``) needs each unit's float32 sum whole on one rank, the
unit's leader (member 0), and the leader's result back on every member. Three schedules can
carry it; which is fastest depends on the bucket against the unit's size, so the cost model
chooses per call (``schedule``), with the step rule every formula of ``costs.py`` uses, on the
unit's own fabric.

Vocabulary. k members, a bucket of N bytes; a *segment* is at most ``chunk_bytes``
(``ring``'s), so a piece of b bytes travels as S(b) = ceil(b / min(chunk_bytes, b)) of them;
L = ceil(log2 k) *rounds*. A *step* of b bytes costs ``f.ring_step(b)`` = alpha + b beta (one
message on the unit's tier, every sender on its own link), a fold of b bytes b gamma
(``b / f.reduce_bandwidth``).

chain  The ring with every block empty but the leader's: ``ring.reduce_scatter`` walks the
       bucket member 1 -> 2 -> .. -> k-1 -> 0, each member folding in its own, and
       ``ring.allgather`` walks the result 0 -> 1 -> .. -> k-1. A member forwards segment i
       while segment i + 1 arrives, so each link carries the bucket once, and the pipeline
       fills in k - 2 steps (an empty block still costs one empty message). With S = S(N)::

           reduce     (S + k - 2) (step(N / S) + (N / S) gamma)
           broadcast  (S + k - 2)  step(N / S)

tree   A binomial tree (``tree``'s vocabulary: vrank v's parent is v with its lowest set bit
       cleared). Reduce (``tree.reduce``): in round m = 1, 2, 4, .. a rank with bit m set
       sends its partial sum to v - m and is done. Broadcast (the same rounds backwards):
       in round m = .., 4, 2, 1 each rank with bit m and every lower bit clear sends the
       result to v + m. One message per rank per round, the whole bucket each::

           reduce     L (step(N) + N gamma)
           broadcast  L  step(N)

split  The bucket cut into k blocks (``ring.even_counts``), member b's block b. Reduce:
       ``ring.reduce_scatter`` (member b ends with block b's sum), then a binomial gather of
       the blocks onto the leader: in round m = 1, 2, 4, .. a member with bit m set sends the
       blocks it holds, [v, v + m), to v - m. Broadcast: the binomial scatter (the same
       rounds backwards, member v + m getting blocks [v + m, v + 2m)), then
       ``ring.allgather``. With N_b = N / k and S_b = S(N_b), the tree part's round m moving
       min(m, k - m) blocks::

           reduce     (k - 1) S_b (step(N_b / S_b) + (N_b / S_b) gamma) + T
           broadcast  T + (k - 1) S_b step(N_b / S_b),   T = sum_m step(min(m, k - m) N_b)

The chain is bandwidth-optimal (every link carries the bucket once, N beta), with a latency
of S + k - 2 steps that grows with k. The tree's latency grows with log k, but each round
moves the whole bucket: L N beta. The split moves about 2 N beta each way (the ring's
(k - 1)/k N, then the gather's), in k - 1 + L steps. So: small buckets by the tree, large
ones by the chain, whose pipeline has filled, and in between the split.

Worked example: a unit of 18 hosts on 23 GB/s links with 2 us latency, folds at 400 GB/s
(a Summit cabinet, ``simulate/clusters/summit.json``), segments of 1 MiB, L = 5; there and
back:

- 64 KiB: chain 17 + 17 steps of 64 KiB, 168 us; tree 5 + 5 rounds, 49 us; split 99 us.
  The tree.
- 1 MiB: chain 1.66 ms, tree 0.49 ms, split 0.26 ms (17 ring steps of 58 KiB and 5
  rounds each way). The split.
- 25 MB (S = 24 segments of 1.04 MB): chain 40 steps of 47.3 us (+ 2.6 us of fold on the
  way in), 3.89 ms; tree 5 rounds of 1.09 ms each way, 11.2 ms; split 4.32 ms. The chain.
  (Seventeen steps of the whole bucket each way, a chain that does not pipeline, would
  take 38.1 ms.)

Summation order. The leader's sum is, in member order x_0 .. x_{k-1}: chain
``(((x_1 + x_2) + x_3) + .. + x_{k-1}) + x_0``; tree the binomial pairing, e.g. for k = 5
``((x_0 + x_1) + (x_2 + x_3)) + x_4``; split, for block b, the ring's
``((x_{b+1} + x_{b+2}) + .. + x_{b-1}) + x_b`` (indices mod k). Every member ends with the
leader's bits (every broadcast copies bytes), whichever schedule ran. Every member must run
the same schedule: ``schedule`` depends only on the fabric (the job's topology, the same on
every rank), N and ``chunk_bytes``.
"""

from __future__ import annotations

import math

import numpy as np

from ..transport.comm import Communicator
from . import ring, tree
from .costs import Fabric
from .ops import Reducer

__all__ = ["SCHEDULES", "reduce", "broadcast", "schedule", "reduce_time", "broadcast_time",
           "round_trip_time", "mean_sent", "rounds"]

SCHEDULES = ("chain", "tree", "split")


def reduce(comm: Communicator, data: np.ndarray, reducer: Reducer, chunk_bytes: int,
           how: str) -> None:
    """Sums ``data`` over every rank onto rank 0, in place (other ranks keep partial sums).

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        data: a contiguous 1-D array, the same length on every rank.
        reducer: the kernel that folds a received piece into ``data``.
        chunk_bytes: the ring's largest segment (chain and split).
        how: one of ``SCHEDULES`` (``schedule``), the same on every rank.
    """
    _check(how)
    n = comm.size
    if n == 1 or data.size == 0:
        return
    if how == "chain":
        ring.reduce_scatter(comm, data, [data.size] + [0] * (n - 1), reducer, chunk_bytes)
    elif how == "tree":
        tree.reduce(comm, data, 0, reducer)
    else:
        counts = ring.even_counts(data.size, n)
        ring.reduce_scatter(comm, data, counts, reducer, chunk_bytes)
        offsets = ring.block_offsets(counts, n, data.size)
        for peer, first, end in _rounds(n, comm.rank, gather=True):
            part = data[offsets[first]:offsets[end]]
            if peer < comm.rank:
                comm.exchange(sends=[(peer, part)])
            else:
                comm.exchange(recvs=[(peer, part)])


def broadcast(comm: Communicator, data: np.ndarray, chunk_bytes: int, how: str) -> None:
    """Copies rank 0's ``data`` into ``data`` on every rank (``reduce``'s arguments)."""
    _check(how)
    n = comm.size
    if n == 1 or data.size == 0:
        return
    if how == "chain":
        ring.allgather(comm, data, [data.size] + [0] * (n - 1), chunk_bytes)
        return
    counts = ring.even_counts(data.size, n)
    offsets = ring.block_offsets(counts, n, data.size)
    for peer, first, end in _rounds(n, comm.rank, gather=False):
        # The tree sends it all; the split, the blocks of the receiver's subtree.
        part = data if how == "tree" else data[offsets[first]:offsets[end]]
        if peer > comm.rank:
            comm.exchange(sends=[(peer, part)])
        else:
            comm.exchange(recvs=[(peer, part)])
    if how == "split":
        ring.allgather(comm, data, counts, chunk_bytes)


def _rounds(n: int, v: int, gather: bool):
    """Rank ``v``'s messages of the binomial gather onto rank 0 (rounds m = 1, 2, 4, ..) or
    of the scatter from it (the same rounds backwards): ``(peer, first, end)`` with the
    blocks [first, end) that move, those of the subtree of the higher rank of the two."""
    masks = [1 << i for i in range(rounds(n))]
    for mask in masks if gather else reversed(masks):
        if v % (2 * mask) == 0 and v + mask < n:
            yield v + mask, v + mask, min(v + 2 * mask, n)
        elif v % (2 * mask) == mask:
            yield v - mask, v, min(v + mask, n)


def _check(how: str) -> None:
    if how not in SCHEDULES:
        raise ValueError(f"funnel schedule {how!r}; choose from {', '.join(SCHEDULES)}")


def rounds(k: int) -> int:
    """L = ceil(log2 k): the tree's rounds each way."""
    return (k - 1).bit_length()


def _segments(nbytes: float, chunk_bytes: int) -> int:
    """S(b): the segments a ring cuts a piece of ``nbytes`` into (one at least)."""
    return max(1, math.ceil(nbytes / max(1, min(chunk_bytes, nbytes))))


def _segment_step(f: Fabric, nbytes: float, chunk_bytes: int, fold: bool) -> float:
    """One ring step of a segment of a piece of ``nbytes`` (and its fold)."""
    piece = nbytes / _segments(nbytes, chunk_bytes)
    return f.ring_step(piece) + (piece / f.reduce_bandwidth if fold else 0.0)


def _binomial(f: Fabric, nbytes: float) -> float:
    """The split's gather (or scatter) of k blocks of ``nbytes``: round m moves the blocks
    of a subtree, min(m, k - m) of them, to or from the leader."""
    k = f.n
    return sum(f.ring_step(min(1 << i, k - (1 << i)) * nbytes) for i in range(rounds(k)))


def _time(how: str, f: Fabric, nbytes: float, chunk_bytes: int, fold: bool) -> float:
    """``reduce_time`` (``fold``) or ``broadcast_time``: the module docstring's formulas."""
    k = f.n
    if k < 2 or nbytes <= 0:
        return 0.0
    if how == "tree":
        return rounds(k) * (f.ring_step(nbytes) + (nbytes / f.reduce_bandwidth if fold else 0.0))
    if how == "split":
        block = nbytes / k
        ring_part = (k - 1) * _segments(block, chunk_bytes) * _segment_step(f, block,
                                                                             chunk_bytes, fold)
        return ring_part + _binomial(f, block)
    # The chain: the pipeline's S + k - 2 steps of a segment.
    steps = _segments(nbytes, chunk_bytes) + k - 2
    return steps * _segment_step(f, nbytes, chunk_bytes, fold)


def reduce_time(how: str, f: Fabric, nbytes: float, chunk_bytes: int) -> float:
    """Predicted seconds of ``reduce`` of ``nbytes`` by ``how`` over the ranks of ``f``."""
    _check(how)
    return _time(how, f, nbytes, chunk_bytes, True)


def broadcast_time(how: str, f: Fabric, nbytes: float, chunk_bytes: int) -> float:
    """Predicted seconds of ``broadcast`` of ``nbytes`` by ``how`` over the ranks of ``f``."""
    _check(how)
    return _time(how, f, nbytes, chunk_bytes, False)


def mean_sent(how: str, k: int, nbytes: float) -> float:
    """Bytes a rank sends on average for ``reduce`` and ``broadcast`` of ``nbytes`` by ``how``
    among ``k``: the chain and the tree send the bucket k - 1 times each way; the split sends
    each block k - 1 times each way by the ring, and once per round it climbs in the gather
    (and descends in the scatter), for the blocks of a subtree."""
    if k < 2:
        return 0.0
    once = 2 * (k - 1) * nbytes
    if how != "split":
        return once / k
    climbs = sum(min(v & -v, k - v) for v in range(1, k))  # each rank's subtree, sent up
    return (once + 2 * climbs * nbytes / k) / k


def round_trip_time(how: str, f: Fabric, nbytes: float, chunk_bytes: int) -> float:
    return reduce_time(how, f, nbytes, chunk_bytes) + broadcast_time(how, f, nbytes, chunk_bytes)


def schedule(f: Fabric, nbytes: float, chunk_bytes: int) -> str:
    """The schedule of a funnel of ``nbytes`` (both ways) over the ranks of ``f``: the one
    whose round trip is predicted fastest, the first of ``SCHEDULES`` among equals. With
    two ranks every schedule is one hop and the chain stays: it keeps the ring's segments
    (a 25 MB bucket is not one message and one whole-bucket scratch buffer), for at most
    (S - 1) alpha more."""
    if f.n < 3:
        return "chain"
    return min(SCHEDULES, key=lambda how: round_trip_time(how, f, nbytes, chunk_bytes))
