"""Rabenseifner's allreduce: recursive-halving reduce-scatter, then recursive-doubling allgather.

Vocabulary. As in ``doubling.py``, the *core* is the largest power of two ``p`` of ranks, and
extra ranks fold into it first (``fold_in``) and get the answer back last (``fold_out``). The
vector is cut into ``p`` *blocks* of near-equal length; core rank ``b`` owns block ``b`` after
the reduce-scatter. At every moment a rank is responsible for a *window*: a run of
consecutive blocks, the whole vector at first.

Halving (reduce-scatter). With ``distance = p/2, p/4, .., 1`` a rank pairs with
``peer = rank XOR distance``. The window splits in two halves; the rank with that bit clear
keeps the lower half, its peer the upper. Each sends the half it gives up and folds the half
it receives into the half it keeps, so the window halves and the data in it gains the
peer's contributions. With 4 ranks and blocks B0..B3::

    distance 2: 0 <-> 2, 1 <-> 3   0, 1 keep B0-B1   2, 3 keep B2-B3   (each sums 2 ranks)
    distance 1: 0 <-> 1, 2 <-> 3   rank b keeps block Bb                (sums all 4 ranks)

Doubling (allgather). The same pairs in reverse (``distance = 1, 2, .., p/2``): each sends its
window and receives its peer's, the adjacent window of the same size, straight into place, so
the window doubles until it is the whole vector.

Each block is reduced in exactly one place per round, so every rank ends with the same bits.
Traffic: each phase moves ``(p-1)/p`` of the vector each way, like the ring, but in
``log2(p)`` messages instead of ``n-1``: the choice for mid-sized messages. Received halves land
in scratch slot 0 (half of ``data``) before they are folded in.
"""

from __future__ import annotations

import numpy as np

from ..transport.comm import Communicator
from .doubling import core_size, fold_in, fold_out
from .ops import Reducer

__all__ = ["allreduce"]


def allreduce(comm: Communicator, data: np.ndarray, reducer: Reducer) -> None:
    """Reduces ``data`` in place over all ranks by recursive halving, then doubling.

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        data: a contiguous 1-D array; on return it holds the same reduction on every rank.
        reducer: the kernel that folds a received half into ``data``.
    """
    p = core_size(comm.size)
    if fold_in(comm, data, reducer, p):
        base, extra = divmod(len(data), p)
        offsets = [b * base + min(b, extra) for b in range(p + 1)]
        first, last = _halve(comm, data, reducer, p, offsets)
        _double(comm, data, p, offsets, first, last)
    fold_out(comm, data, p)


def _halve(comm: Communicator, data: np.ndarray, reducer: Reducer, p: int,
           offsets: list[int]) -> tuple[int, int]:
    """The reduce-scatter; returns the window ``[first, last)`` of blocks this rank owns."""
    rank = comm.rank
    first, last = 0, p
    distance = p >> 1
    while distance:
        peer = rank ^ distance
        middle = (first + last) // 2
        if rank & distance:
            keep, give = (middle, last), (first, middle)
        else:
            keep, give = (first, middle), (middle, last)
        kept = data[offsets[keep[0]]:offsets[keep[1]]]
        # The first round receives the largest half, so slot 0 grows once, then is reused.
        incoming = comm.scratch(kept.nbytes).view(data.dtype)
        comm.exchange([(peer, data[offsets[give[0]]:offsets[give[1]]])], [(peer, incoming)])
        reducer(kept, incoming)
        first, last = keep
        distance >>= 1
    return first, last


def _double(comm: Communicator, data: np.ndarray, p: int, offsets: list[int], first: int,
            last: int) -> None:
    """The allgather: grows the owned window ``[first, last)`` to the whole vector."""
    rank = comm.rank
    distance = 1
    while distance < p:
        peer = rank ^ distance
        width = last - first
        theirs = (first - width, first) if rank & distance else (last, last + width)
        comm.exchange([(peer, data[offsets[first]:offsets[last]])],
                      [(peer, data[offsets[theirs[0]]:offsets[theirs[1]]])])
        first, last = min(first, theirs[0]), max(last, theirs[1])
        distance <<= 1
