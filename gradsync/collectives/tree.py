"""Binomial-tree broadcast (segmented, pipelined) and reduce, from and to any root.

Vocabulary. Ranks are renumbered relative to the root: ``vrank = (rank - root) mod n``, so the
root is ``vrank 0``. In the binomial tree the *parent* of ``vrank v > 0`` is ``v`` with its
lowest set bit cleared, and the *children* of ``v`` are ``v + m`` for each power of two ``m``
below ``v``'s lowest set bit (any power of two for the root) with ``v + m < n``. With ``n = 6``
and ``root = 2`` (real rank in brackets)::

    vrank 0 [2] ─┬─ 4 [0] ── 5 [1]
                 ├─ 2 [4] ── 3 [5]
                 └─ 1 [3]

The tree is ``ceil(log2 n)`` deep, so a message reaches everyone in that many hops.

Broadcast. The data travels as *segments* of at most ``chunk_bytes``. Exchange ``k`` receives
segment ``k`` from the parent, straight into place, while it forwards segment ``k-1`` to all
children at once. A large message therefore streams down the tree: with ``S`` segments the
deepest leaf has everything after ``S + depth - 1`` exchanges instead of ``S * depth``, and no
rank buffers more than the segment on the wire. Above, with ``S = 3`` segments: vrank 4
receives segment 0 in exchange 0 and sends it to vrank 5 in exchange 1, while receiving
segment 1.

Reduce. The same tree, leaves first: with ``m = 1, 2, 4, ..`` a rank whose bit ``m`` is set
sends its partial result to ``v - m`` and is done; otherwise it receives ``v + m``'s partial
result (if that rank exists) into scratch slot 0 and folds it in. The root ends with the
reduction over all ranks after ``ceil(log2 n)`` rounds.
"""

from __future__ import annotations

import numpy as np

from ..transport.comm import Communicator
from .ops import Reducer

__all__ = ["broadcast", "reduce"]


def broadcast(comm: Communicator, data: np.ndarray, root: int, chunk_bytes: int) -> None:
    """Copies the root's ``data`` into ``data`` on every rank.

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        data: a contiguous 1-D array, the same length on every rank; read on the root,
            overwritten elsewhere.
        root: the rank whose data is sent.
        chunk_bytes: the largest segment on the wire.
    """
    n = comm.size
    _check(n, data, root)
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    vrank = (comm.rank - root) % n
    parent = None if vrank == 0 else ((vrank & (vrank - 1)) + root) % n
    # Largest subtree first: on a transport that drains sends in order it starts the
    # longest path soonest.
    children = [(child + root) % n for child in reversed(_children(vrank, n))]
    seg = max(1, chunk_bytes // data.itemsize)
    starts = range(0, len(data), seg)
    for k in range(len(starts) + 1):
        incoming, outgoing = [], []
        if parent is not None and k < len(starts):
            incoming.append((parent, data[starts[k]:starts[k] + seg]))
        if k:
            forward = data[starts[k - 1]:starts[k - 1] + seg]
            outgoing = [(child, forward) for child in children]
        if incoming or outgoing:
            comm.exchange(outgoing, incoming)


def reduce(comm: Communicator, data: np.ndarray, root: int, reducer: Reducer) -> None:
    """Reduces ``data`` over all ranks onto the root.

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        data: a contiguous 1-D array, the same length on every rank. On return the root's
            holds the reduction; on other ranks it holds a partial reduction.
        root: the rank that receives the result.
        reducer: the kernel that folds a child's partial result into ``data``; scratch slot 0
            holds one vector.
    """
    n = comm.size
    _check(n, data, root)
    vrank = (comm.rank - root) % n
    mask = 1
    while mask < n:
        if vrank & mask:
            comm.exchange(sends=[((vrank - mask + root) % n, data)])
            return
        if vrank + mask < n:
            scratch = comm.scratch(data.nbytes).view(data.dtype)
            comm.exchange(recvs=[((vrank + mask + root) % n, scratch)])
            reducer(data, scratch)
        mask <<= 1


def _children(vrank: int, n: int) -> list[int]:
    """The children of ``vrank`` in the binomial tree, nearest (smallest subtree) first."""
    lowest = vrank & -vrank if vrank else 1 << n.bit_length()
    children, mask = [], 1
    while mask < lowest and vrank + mask < n:
        children.append(vrank + mask)
        mask <<= 1
    return children


def _check(n: int, data: np.ndarray, root: int) -> None:
    if not 0 <= root < n:
        raise ValueError(f"root {root} is not a rank of a world of {n}")
    if data.ndim != 1 or not data.flags.c_contiguous:
        raise ValueError(f"tree collectives take a contiguous 1-D array, got shape {data.shape}")
