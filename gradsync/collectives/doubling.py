"""Recursive-doubling allreduce: latency-optimal for small messages.

Vocabulary. ``p`` is the largest power of two not above the world size ``n``; ranks ``0 .. p-1``
are the *core*, ranks ``p .. n-1`` the *extras*. Each extra ``e`` has a *partner* ``e - p`` in
the core. In round ``i`` of the doubling, a core rank's *peer* is ``rank XOR 2**i``.

The doubling. Each round, every core rank swaps its whole vector with its peer and folds the
peer's copy into its own. After round ``i`` a rank holds the reduction over the ``2**(i+1)``
ranks that share its high bits, so ``log2(p)`` rounds reduce over the whole core. With 4 ranks
holding ``a, b, c, d``::

    round 0 (XOR 1): 0 <-> 1, 2 <-> 3   ->  0, 1 hold a+b     2, 3 hold c+d
    round 1 (XOR 2): 0 <-> 2, 1 <-> 3   ->  all hold (a+b)+(c+d)

Rank 0 computes ``(a+b) + (c+d)`` and rank 2 computes ``(c+d) + (a+b)``: the same two operands,
and every reduction gradsync offers is commutative bit for bit (IEEE addition and
multiplication are), so all ranks end with identical bits.

Folding (any ``n``). Before the doubling, each extra sends its vector to its partner, which
folds it in; after, the partner sends the result back. With ``n = 6`` (``p = 4``), ranks 4 and 5
fold into 0 and 1, the core runs as above, and 0 and 1 send the answer to 4 and 5: two more
messages on the critical path, the price of not being a power of two. ``fold_in`` and
``fold_out`` are shared with the halving-doubling algorithm.

Cost: ``log2(p)`` rounds (+2 when folding), each moving the whole vector, so it wins when
latency, not bandwidth, dominates. Received vectors land in scratch slot 0, as large as
``data``; the answer an extra gets back lands directly in ``data``.
"""

from __future__ import annotations

import numpy as np

from ..transport.comm import Communicator
from .ops import Reducer

__all__ = ["allreduce", "core_size", "fold_in", "fold_out"]


def allreduce(comm: Communicator, data: np.ndarray, reducer: Reducer) -> None:
    """Reduces ``data`` in place over all ranks by recursive doubling.

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        data: a contiguous 1-D array; on return it holds the same reduction on every rank.
        reducer: the kernel that folds a received vector into ``data``; scratch slot 0 holds
            one vector.
    """
    p = core_size(comm.size)
    if fold_in(comm, data, reducer, p):
        scratch = comm.scratch(data.nbytes).view(data.dtype)
        distance = 1
        while distance < p:
            peer = comm.rank ^ distance
            comm.exchange([(peer, data)], [(peer, scratch)])
            reducer(data, scratch)
            distance <<= 1
    fold_out(comm, data, p)


def core_size(size: int) -> int:
    """The largest power of two not above ``size``."""
    return 1 << (size.bit_length() - 1)


def fold_in(comm: Communicator, data: np.ndarray, reducer: Reducer, p: int) -> bool:
    """Folds each extra rank's vector into its partner's; True on ranks of the core.

    Uses scratch slot 0 (as large as ``data``) on partners.
    """
    rank = comm.rank
    if rank >= p:
        comm.exchange(sends=[(rank - p, data)])
        return False
    if rank + p < comm.size:
        scratch = comm.scratch(data.nbytes).view(data.dtype)
        comm.exchange(recvs=[(rank + p, scratch)])
        reducer(data, scratch)
    return True


def fold_out(comm: Communicator, data: np.ndarray, p: int) -> None:
    """Sends the core's result back from each partner into its extra rank's ``data``."""
    rank = comm.rank
    if rank >= p:
        comm.exchange(recvs=[(rank - p, data)])
    elif rank + p < comm.size:
        comm.exchange(sends=[(rank + p, data)])
