"""Alltoall: every rank sends a different block to every other rank, by pairwise exchange or
by Bruck's algorithm.

Vocabulary. ``send`` is cut into one *send block* per destination, ``send_counts[d]``
elements for rank ``d``, in rank order; ``recv`` into one *receive block* per source,
``recv_counts[s]`` elements from rank ``s``. Rank ``a``'s ``send_counts[b]`` must equal rank
``b``'s ``recv_counts[a]``: the transport rejects a message of the wrong size. *Uniform*
blocks: every block has the same ``block`` elements, ``len(send) = len(recv) = n block``.

Pairwise exchange (``alltoall``, any counts). Step 0 copies the rank's own block locally. In
step ``k = 1 .. n-1`` rank ``r`` sends to ``(r + k) mod n`` and receives from ``(r - k) mod
n``, straight into its receive block. Over a step the sends form a permutation, so every
rank sends one block and receives one block: no link or receiver is asked to take two
messages at once. With 3 ranks::

    step 1:  0 -> 1, 1 -> 2, 2 -> 0
    step 2:  0 -> 2, 1 -> 0, 2 -> 1

``n - 1`` steps, each moving one block each way per rank: every block crosses the network
once, and each step pays a message's latency.

Bruck's algorithm (``bruck``, uniform blocks; J. Bruck et al., "Efficient algorithms for
all-to-all communications in multiport message-passing systems", IEEE TPDS 1997). A block's
*position* on a rank is how far it still has to go. Three phases:

1. Rotation: rank ``r`` copies its send block for rank ``(r + i) mod n`` to position ``i``.
2. Steps ``k = 0 .. ceil(log2 n) - 1``: rank ``r`` packs the blocks at every position whose
   bit ``k`` is set (``moving_blocks(n, 2^k)`` of them, about half) into one message to
   ``(r + 2^k) mod n``, and puts the ones from ``(r - 2^k) mod n`` at the same positions. A
   block at position ``i`` moves ``2^k`` ranks for every bit ``k`` of ``i``: ``i`` in all,
   to its destination, where position ``i`` holds the block from rank ``(r - i) mod n``.
3. Inverse rotation: receive block ``s`` is position ``(r - s) mod n``.

With 3 ranks (``sd``: rank s's block for rank d), two steps where the pairwise exchange
also takes two; the savings come with n (13 steps against 4,559 at 4,560 ranks)::

    positions 0 1 2   rotated      step 0 (bit 0: position 1,   step 1 (bit 1: position 2,
                                   to r + 1)                    to r + 2)
    rank 0:           00 01 02     00 20 02                     00 20 10
    rank 1:           11 12 10     11 01 10                     11 01 21
    rank 2:           22 20 21     22 12 21                     22 12 02

and rank 0's receive blocks are positions 0, 2, 1: ``00 10 20``. Odd ``n`` and non powers of
two need nothing more: with 5 ranks the steps at distances 1, 2, 4 move the blocks at
positions {1, 3}, {2, 3} and {4}.

When each wins. With a message latency ``alpha``, a block of ``b`` bytes and a link of
``beta`` bytes/s, pairwise costs ``(n - 1)(alpha + b / beta)``; Bruck ``ceil(log2 n) alpha +
about (n/2) log2 n b / beta``, plus its local copies (the two rotations, and each step's
packing and unpacking): fewer messages, but each block crosses the network about
``(log2 n) / 2`` times. Bruck wins for small blocks among many ranks, where latency decides
(int8's reduce-scatter across thousands of hosts: blocks of a few hundred bytes); the
pairwise exchange for large blocks, where bandwidth does. ``gradsync/collectives/costs.py``
times both on the job's links and chooses (``cheapest_alltoall``).

Scratch: Bruck's rotated blocks in slot 0 (as large as ``send``), a step's outgoing and
incoming blocks in slots 1 and 2 (about half of it each).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..transport.comm import Communicator
from .ring import block_offsets

__all__ = ["alltoall", "bruck", "uniform", "moving_blocks", "ALGORITHMS"]

ALGORITHMS = ("pairwise", "bruck")
"""The uniform-block alltoalls ``uniform`` runs, by name (``costs.ALLTOALLS`` times them)."""


def alltoall(comm: Communicator, send: np.ndarray, send_counts: Sequence[int], recv: np.ndarray,
             recv_counts: Sequence[int]) -> None:
    """Sends block ``d`` of ``send`` to rank ``d`` and receives rank ``s``'s block for this rank.

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        send: contiguous 1-D array, the send blocks in rank order.
        send_counts: elements of ``send`` per destination rank, summing to ``len(send)``.
        recv: contiguous 1-D array of ``send``'s dtype, filled with the receive blocks in
            rank order.
        recv_counts: elements of ``recv`` per source rank, summing to ``len(recv)``.
    """
    n, rank = comm.size, comm.rank
    if send.dtype != recv.dtype:
        raise ValueError(f"alltoall sends {send.dtype} but receives {recv.dtype}")
    send_offsets = _offsets(send, send_counts, n, "send")
    recv_offsets = _offsets(recv, recv_counts, n, "recv")
    if send_counts[rank] != recv_counts[rank]:
        raise ValueError(f"rank {rank} sends itself {send_counts[rank]} elements but expects "
                         f"{recv_counts[rank]}")
    own = send[send_offsets[rank]:send_offsets[rank + 1]]
    recv[recv_offsets[rank]:recv_offsets[rank + 1]] = own
    for k in range(1, n):
        dst, src = (rank + k) % n, (rank - k) % n
        comm.exchange([(dst, send[send_offsets[dst]:send_offsets[dst + 1]])],
                      [(src, recv[recv_offsets[src]:recv_offsets[src + 1]])])


def bruck(comm: Communicator, send: np.ndarray, recv: np.ndarray) -> None:
    """Bruck's alltoall of uniform blocks: block ``d`` of ``send`` to rank ``d``, in
    ``ceil(log2 n)`` steps (module docstring).

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        send: contiguous 1-D array of ``n`` blocks of equal length, in rank order.
        recv: contiguous 1-D array of ``send``'s dtype and length, filled with the receive
            blocks in rank order.
    """
    n, rank = comm.size, comm.rank
    block = _uniform_block(send, recv, n)
    if n == 1:
        recv[:] = send
        return
    dtype = send.dtype
    rotated = comm.scratch(send.nbytes, 0).view(dtype).reshape(n, block)
    positions = np.arange(n)
    np.take(send.reshape(n, block), (rank + positions) % n, axis=0, out=rotated)
    distance = 1
    while distance < n:
        moving = positions[(positions & distance) != 0]
        nbytes = moving.size * block * dtype.itemsize
        out, into = comm.scratch(nbytes, 1), comm.scratch(nbytes, 2)  # 1-D: as they travel
        np.take(rotated, moving, axis=0, out=out.view(dtype).reshape(moving.size, block))
        # Every rank sends as many blocks as it receives (the positions are the same on all):
        # the step is a permutation, one message each way per rank, like a pairwise step.
        comm.exchange([((rank + distance) % n, out)], [((rank - distance) % n, into)])
        rotated[moving] = into.view(dtype).reshape(moving.size, block)
        distance <<= 1
    np.take(rotated, (rank - positions) % n, axis=0, out=recv.reshape(n, block))


def uniform(comm: Communicator, send: np.ndarray, recv: np.ndarray, algorithm: str) -> None:
    """The alltoall of uniform blocks by ``algorithm`` (one of ``ALGORITHMS``), the same on
    every rank."""
    if algorithm == "bruck":
        bruck(comm, send, recv)
    elif algorithm == "pairwise":
        block = _uniform_block(send, recv, comm.size)
        alltoall(comm, send, [block] * comm.size, recv, [block] * comm.size)
    else:
        raise ValueError(f"no alltoall {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def moving_blocks(n: int, distance: int) -> int:
    """How many of positions ``0 .. n-1`` have the bit ``distance`` (a power of two) set: the
    blocks each rank sends in Bruck's step at ``distance``."""
    whole, rest = divmod(n, 2 * distance)
    return whole * distance + max(0, rest - distance)


def _uniform_block(send: np.ndarray, recv: np.ndarray, n: int) -> int:
    """Validates uniform-block buffers; returns the elements per block."""
    if send.dtype != recv.dtype:
        raise ValueError(f"alltoall sends {send.dtype} but receives {recv.dtype}")
    for what, buf in (("send", send), ("recv", recv)):
        if buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError(f"alltoall {what} buffer must be a contiguous 1-D array, "
                             f"got shape {buf.shape}")
    if len(send) != len(recv) or len(send) % n:
        raise ValueError(f"a uniform alltoall among {n} ranks needs send and recv of equal "
                         f"length, a multiple of {n}: got {len(send)} and {len(recv)}")
    return len(send) // n


def _offsets(buf: np.ndarray, counts: Sequence[int], n: int, what: str) -> list[int]:
    """Validates one side's buffer and counts; returns the ``n + 1`` block boundaries."""
    if buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError(f"alltoall {what} buffer must be a contiguous 1-D array, "
                         f"got shape {buf.shape}")
    return block_offsets(counts, n, len(buf))
