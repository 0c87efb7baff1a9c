"""What a negotiation cycle sends: the ballots' vote, and a gather only when it is needed.

A cycle of ``gradsync/pipeline/negotiation.py`` has two steps on the wire.

1. The *vote*, every cycle: each rank's ballot (``gradsync/pipeline/ballot.py``: a flags word and
   one bit per response-cache entry, ``8 × (1 + ⌈span / 64⌉)`` bytes, at most 136 with the cache's
   1,024 entries) combined by a bitwise AND over the World. Across hosts it is a
   recursive-doubling allreduce (``collectives/doubling.py``, the small-message algorithm):
   ``log2 p`` exchanges of the whole ballot for the ``p`` ranks of the largest power of two,
   one more for a rank that folds in a rank beyond it, one for that rank. So a steady-state
   cycle costs each rank at most ``⌊log2 N⌋ + 1`` messages of one ballot, whatever N is. On
   one host (``World.shares_host``) each rank writes its ballot into its own row of an array
   that the shared-memory group sums, as the cycle's exchange always did there (its waits
   sleep on a futex and wake at once; the rows are ``local ranks × ballot`` bytes), and every
   rank ANDs the rows.
2. The *gather*, only in a cycle whose vote lost the ``QUIET`` flag (some rank announces a
   name that is not cached, or rank 0 expires names): every rank's full announcement,
   pickled (``to_wire``). Each rank sends a fixed block of ``SLOT`` bytes (the length, then
   the pickle when it fits), gathered by a ring (across hosts) or the shared-memory group's
   sum (one host); only when some rank's does not fit is there a second, sized allgather.

Signatures travel as plain tuples: a named tuple pickles as a reference to its class, which
would make the bytes longer. The wire is only compatible within one version of gradsync.
"""

from __future__ import annotations

import pickle

import numpy as np

from ..collectives import doubling, ring
from ..collectives.ops import ReduceOp
from . import operations as ops
from .agreement import Signature

__all__ = ["SLOT", "from_wire", "gather", "to_wire", "vote"]

SLOT = 256
"""Bytes per rank in the gather's one-round exchange."""


def _and(dst: np.ndarray, src: np.ndarray) -> None:
    np.bitwise_and(dst, src, out=dst)


def vote(world, ballot: np.ndarray) -> np.ndarray:
    """Combines every rank's ``ballot`` (``uint64`` words, the same length everywhere) by a
    bitwise AND; returns the result (``ballot`` itself across hosts)."""
    if not world.shares_host:
        comm = world.comm
        # The width goes into the description: ranks whose caches differed would fail the
        # frame checks at once instead of reading each other's bits wrongly.
        comm.begin(f"negotiate vote words={ballot.size}", world.config.check_collectives)
        doubling.allreduce(comm, ballot, _and)
        return ballot
    rows = np.zeros((world.size, ballot.size), dtype=np.int64)
    rows[world.rank] = ballot.view(np.int64)
    flat = rows.reshape(-1)
    ops.allreduce(world, flat, flat.dtype, ReduceOp.SUM, name="negotiate vote",
                  shape=flat.shape)
    return np.bitwise_and.reduce(rows.view(np.uint64), axis=0)


def gather(world, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order (see the module docstring)."""
    size = world.size
    blocks = np.zeros((size, SLOT), dtype=np.uint8)
    mine = blocks[world.rank]
    mine[:8] = np.frombuffer(np.int64(len(data)).tobytes(), dtype=np.uint8)
    if len(data) <= SLOT - 8:
        mine[8:8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
    if world.shares_host:
        # A sum of the blocks (each rank's is zero but for its own row) through the host's
        # shared-memory group, whose waits sleep on a futex and wake at once.
        words = blocks.reshape(-1).view(np.int64)
        ops.allreduce(world, words, words.dtype, ReduceOp.SUM, name="negotiate gather",
                      shape=words.shape)
    else:
        world.comm.begin("negotiate gather", world.config.check_collectives)
        ring.allgather(world.comm, blocks.reshape(-1), [SLOT] * size, world.config.chunk_bytes)
    lengths = blocks[:, :8].copy().view(np.int64).reshape(-1).tolist()
    if max(lengths) <= SLOT - 8:
        return [blocks[r, 8:8 + lengths[r]].tobytes() for r in range(size)]
    flat = np.frombuffer(data, dtype=np.uint8)
    out, rows = ops.allgather(world, flat, flat.dtype, name="negotiate gather",
                              shape=flat.shape)
    bounds = np.cumsum([0] + rows)
    return [out[bounds[r]:bounds[r + 1]].tobytes() for r in range(size)]


def to_wire(full: list[tuple[str, Signature]], expire: tuple,
            waited: dict[str, float]) -> bytes:
    """One rank's full announcement of a cycle: its ``(name, signature)`` pairs, (rank 0
    only) the names it declares expired, and the seconds each demoted name waited as a ballot
    bit (``Ballot.cast``)."""
    return pickle.dumps(([(name, tuple(sig)) for name, sig in full], expire, waited),
                        protocol=5)


def from_wire(data: bytes) -> tuple[list[tuple[str, Signature]], tuple, dict[str, float]]:
    """The inverse of ``to_wire``: the signatures named again."""
    full, expire, waited = pickle.loads(data)
    return [(name, Signature._make(sig)) for name, sig in full], expire, waited
