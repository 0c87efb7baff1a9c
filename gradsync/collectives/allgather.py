"""Allgather of equal blocks by Bruck's algorithm: ceil(log2 n) steps for any n.

Vocabulary. ``data`` is cut into ``n`` *blocks* of equal length, block ``b`` rank ``b``'s; on
entry a rank has filled its own, on return every rank holds every block, in rank order (the
same bits as ``ring.allgather``'s). On rank ``r``, *position* ``i`` names block ``(r - i) mod
n``: position 0 is the rank's own block, position ``i`` the one of the rank ``i`` behind it.

Bruck's allgather (J. Bruck et al., "Efficient algorithms for all-to-all communications in
multiport message-passing systems", IEEE TPDS 1997). In step ``k = 0 .. ceil(log2 n) - 1``,
at *distance* ``d = 2^k``, a rank holds positions ``0 .. d-1``; it sends the first
``step_blocks(n, d) = min(d, n - d)`` of them to rank ``(r + d) mod n`` and receives rank
``(r - d) mod n``'s, which are its own positions ``d ..``: after the step it holds positions
``0 .. min(2d, n) - 1``. The last step, where fewer than ``d`` blocks are missing, sends only
those, so a rank receives each block it lacks exactly once: ``n - 1`` blocks in all, the
ring's bytes, in ``ceil(log2 n)`` messages instead of ``n - 1``. Odd ``n`` and non powers of
two need nothing more. With 5 ranks (blocks held, in position order)::

              rank 0       rank 1       rank 2       rank 3       rank 4
    start     0            1            2            3            4
    d = 1     0 4          1 0          2 1          3 2          4 3          (1 block)
    d = 2     0 4 3 2      1 0 4 3      2 1 0 4      3 2 1 0      4 3 2 1      (2 blocks)
    d = 4     0 4 3 2 1    1 0 4 3 2    2 1 0 4 3    3 2 1 0 4    4 3 2 1 0    (1 block)

No copies. Positions ``0 .. c-1`` are blocks ``r-c+1 .. r``, a run of consecutive blocks mod
n, so a step sends straight out of ``data`` and the blocks it receives, the run ``r-d-c+1 ..
r-d``, land straight in their places: one slice each way, or two where the run wraps past
block ``n - 1``. The receiver places the same blocks, so it cuts the run where the sender
did and each frame meets a receive buffer of its size (``Comm.exchange`` keeps the order of
frames to one peer). The own block is already in place: no rotation, unlike Bruck's
alltoall (``alltoall.py``), and no scratch. Every block is written once, on arrival, before
it is sent on, and never after. Unlike the ring's above ``ring.LEND_ABOVE_BYTES``, its sends
are never lent to the transport.

When each wins. With a message latency ``alpha``, blocks of ``b`` bytes and a link of
``beta`` bytes/s, both spend ``(n - 1) b / beta`` on a rank's link; the ring pays ``(n - 1)
alpha``, Bruck ``ceil(log2 n) alpha``. What the ring has for it is where its messages go: to
the next rank, which in topology order is mostly on the same host, where Bruck's step at a
distance of a host's ranks or more sends every rank's message off its host at once, sharing
the NIC. So Bruck wins where latency decides (int8's allgather among thousands of owners:
blocks of a few hundred bytes), the ring where bandwidth does on a hierarchy. ``costs.py``
times both on the job's links and chooses (``cheapest_allgather``), the ring at a tie
(``ALGORITHMS``' order): at 2 or 3 ranks they take the same steps.
"""

from __future__ import annotations

import numpy as np

from ..transport.comm import Communicator
from . import ring

__all__ = ["bruck", "uniform", "step_blocks", "ALGORITHMS"]

ALGORITHMS = ("ring", "bruck")
"""The allgathers of equal blocks ``uniform`` runs, by name (``costs.ALLGATHERS`` times them);
the first of equals wins."""


def bruck(comm: Communicator, data: np.ndarray) -> None:
    """Bruck's allgather: every rank's block of ``data`` from its rank, in ``ceil(log2 n)``
    steps (module docstring).

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        data: the whole output, a contiguous 1-D array of ``n`` equal blocks in rank order;
            this rank's block is already filled.
    """
    n, rank = comm.size, comm.rank
    block = _block_of(data, n)
    distance = 1
    while distance < n:
        count = step_blocks(n, distance)
        # Positions 0 .. count-1 out, the sender's same positions in at distance .. : the
        # two runs are disjoint (count <= distance and count <= n - distance).
        sends = _run(data, (rank - count + 1) % n, count, block)
        recvs = _run(data, (rank - distance - count + 1) % n, count, block)
        comm.exchange([((rank + distance) % n, s) for s in sends],
                      [((rank - distance) % n, r) for r in recvs])
        distance <<= 1


def uniform(comm: Communicator, data: np.ndarray, algorithm: str, chunk_bytes: int) -> None:
    """The allgather of equal blocks by ``algorithm`` (one of ``ALGORITHMS``), the same on
    every rank; ``chunk_bytes``: the ring's largest segment."""
    if algorithm == "bruck":
        bruck(comm, data)
    elif algorithm == "ring":
        n = comm.size
        ring.allgather(comm, data, [_block_of(data, n)] * n, chunk_bytes)
    else:
        raise ValueError(f"no allgather {algorithm!r}; known: {', '.join(ALGORITHMS)}")


def step_blocks(n: int, distance: int) -> int:
    """The blocks each rank sends in Bruck's step at ``distance`` (a power of two below
    ``n``): as many as it holds, but no more than the ``n - distance`` its peer lacks."""
    return min(distance, n - distance)


def _run(data: np.ndarray, first: int, count: int, block: int) -> list[np.ndarray]:
    """Blocks ``first .. first + count - 1`` (mod n) of ``data``: one slice, or two where they
    wrap past the last block."""
    end = (first + count) * block
    if end <= len(data):
        return [data[first * block:end]]
    return [data[first * block:], data[:end - len(data)]]


def _block_of(data: np.ndarray, n: int) -> int:
    """Validates an allgather's buffer of ``n`` equal blocks; returns the elements per block."""
    if data.ndim != 1 or not data.flags.c_contiguous:
        raise ValueError(f"allgather buffer must be a contiguous 1-D array, got shape "
                         f"{data.shape}")
    if len(data) % n:
        raise ValueError(f"an allgather of equal blocks among {n} ranks needs a length that "
                         f"is a multiple of {n}, got {len(data)}")
    return len(data) // n
