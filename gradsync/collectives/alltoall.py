"""Pairwise-exchange alltoall: every rank sends a different block to every other rank.

Vocabulary. ``send`` is cut into one *send block* per destination, ``send_counts[d]``
elements for rank ``d``, in rank order; ``recv`` into one *receive block* per source,
``recv_counts[s]`` elements from rank ``s``. Rank ``a``'s ``send_counts[b]`` must equal rank
``b``'s ``recv_counts[a]``: the transport rejects a message of the wrong size.

The schedule. Step 0 copies the rank's own block locally. In step ``k = 1 .. n-1`` rank ``r``
sends to ``(r + k) mod n`` and receives from ``(r - k) mod n``, straight into its receive
block. Over a step the sends form a permutation, so every rank sends one block and receives
one block: no link or receiver is asked to take two messages at once. With 3 ranks::

    step 1:  0 -> 1, 1 -> 2, 2 -> 0
    step 2:  0 -> 2, 1 -> 0, 2 -> 1

``n - 1`` steps, each moving one block each way per rank.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..transport.comm import Communicator
from .ring import block_offsets

__all__ = ["alltoall"]


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


def _offsets(buf: np.ndarray, counts: Sequence[int], n: int, what: str) -> list[int]:
    """Validates one side's buffer and counts; returns the ``n + 1`` block boundaries."""
    if buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError(f"alltoall {what} buffer must be a contiguous 1-D array, "
                         f"got shape {buf.shape}")
    return block_offsets(counts, n, len(buf))
