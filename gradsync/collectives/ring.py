"""Ring reduce-scatter, allgather and allreduce: bandwidth-optimal for large messages.

Vocabulary. The ``n`` ranks form a ring: rank ``r`` sends to ``right = r + 1`` and receives
from ``left = r - 1`` (mod n). The data is cut into ``n`` *blocks*, block ``b`` holding
``counts[b]`` elements from ``offsets[b]``; rank ``b`` owns block ``b`` at the end of the
reduce-scatter. Each block travels as *segments* of at most ``chunk_bytes`` bytes (an empty
block still counts as one empty segment, so every block is at least one message).

Reduce-scatter. In step ``s = 0 .. n-2`` rank ``r`` sends block ``r-1-s`` to the right and
receives block ``r-2-s`` from the left, folding it into its own copy. A block picks up one
rank's contribution per step, so after ``n-1`` steps the block that arrives last, ``r - n = r``,
holds every rank's contribution. With 3 ranks holding ``x0, x1, x2``::

                step 0                      step 1
    rank 0   send B2, recv B1 (x0+x2)    send B1, recv B0 (x0+x1+x2)
    rank 1   send B0, recv B2 (x1+x0)    send B2, recv B1 (x1+x0+x2)
    rank 2   send B1, recv B0 (x2+x1)    send B0, recv B2 (x2+x1+x0)

Each block is reduced in one place only, so once the allgather has copied it out, every rank
holds the same bits whatever the reduction order was.

Allgather. The same walk without reduction: in step ``s`` rank ``r`` sends block ``r-s`` (its
own first, then the ones it has just received) and receives block ``r-1-s`` straight into
place.

The pipeline. Each rank sees the schedule as two streams of segments: the ones it sends
right, and the ones it receives from the left. Its receive stream is its left neighbour's send
stream, and it is also its own send stream shifted by one block: what arrives in step ``s``
leaves in step ``s+1``. So exchange ``k`` posts send segment ``k`` together with receive
segment ``k``; the segment going out arrived at least one exchange earlier (the shift is the
first block's segment count, never zero), so nobody waits on itself, and there is no barrier
between steps: while one segment is being reduced, its successor is already on the wire.
Example: 7 float32 elements, counts ``[3, 2, 2]``, ``chunk_bytes=8`` (two elements per
segment), so B0 is ``B0a = [0:2]`` and ``B0b = [2:3]``; reduce-scatter exchanges::

                exchange 0           exchange 1            exchange 2
    rank 0   send B2,  recv B1    send B1,  recv B0a               recv B0b
    rank 1   send B0a, recv B2    send B0b, recv B1     send B2
    rank 2   send B1,  recv B0a   send B0a, recv B0b    send B0b, recv B2

Rank 2 forwards B0a while B0b comes in. In the reduce-scatter a segment lands in a scratch
segment (slot 0) and the reducer folds it into the block; in the allgather it is final, so it
lands directly in ``data``. Traffic per rank: ``(n-1)/n`` of the data each way per phase.

Both phases at once (``allreduce``). The allgather's streams need not wait for the end of the
reduce-scatter's: a segment of a rank's own block can leave as soon as its last fold is done,
while it is still in the core's cache, and the allgather then writes each segment into the
part of ``data`` that the reduce-scatter has just sent out of it. So ``allreduce`` runs the two
phases' streams side by side, the allgather's ``lag`` exchanges behind (``_lag``): exchange
``k`` posts reduce-scatter segment ``k`` and allgather segment ``k - lag``, each way, in that
order on the wire (``Comm.exchange`` keeps the order of frames to one peer). ``lag`` is the
same on every rank, so both ends of a segment post it in the same exchange, and it is the
smallest for which every rank's last fold of a segment of its own block comes in an earlier
exchange than that segment's allgather send: the length of its reduce-scatter stream up to its
own block, plus one. With 2 ranks that is 1, and the two phases overlap entirely::

                exchange 0              exchange 1                       exchange 2
    rank 0   send B1a,  recv B0a     send B1b, B0a;  recv B0b, B1a    send B0b;  recv B1b
    rank 1   send B0a,  recv B1a     send B0b, B1a;  recv B1b, B0a    send B1b;  recv B0b

(each rank folds what it receives of its own block, B0 on rank 0, and sends it on the next
exchange). With more ranks only the last block of the reduce-scatter overlaps the first of the
allgather. Every op still depends only on ops of earlier exchanges, so nothing waits on itself,
and a segment arrives by the allgather only once the reduce-scatter's send of the same place
has been read: its final value includes that send.

Lending. Above ``LEND_ABOVE_BYTES`` segments may go out lent (``Comm.exchange(lend=True)``):
over TCP their pages go to the socket by reference, so a segment must stay unwritten until the
right neighbour has read it. (Smaller vectors stay in the last-level cache, where the copy
costs less than lending pages and acknowledging them: docs/benchmarks-history.md, "TCP
transport".) Whether larger ones do is measured per Comm (``Comm.lending``): its first
allreduces above the threshold copy and lend in turn, timed, and the faster way is kept.
Within a phase no rank writes a block after sending it (the reduce-scatter folds into a block the
exchange before it forwards it; the allgather writes each block once, on arrival).
Across the phases of ``allreduce``, the allgather writes, on arrival, exactly the blocks the
reduce-scatter sent; but what arrives for a block is that block fully reduced, which the right
neighbour's fold of the lent segment went into, so the right neighbour read it before the
allgather's copy could exist (however far the two phases overlap). Only the end of a phase
that returns to the caller needs ``comm.settle()``: nothing later in the ring proves the right
neighbour read the last segments.

Segment sizes. Over sockets the segment size that keeps the kernel's copies fastest depends on
the machine (docs/benchmarks-history.md, "The segment size measured"), so allreduces of
``TUNE_FROM_BYTES`` or more on a ring with a socket among its pairs measure it
(``Comm.segments``), each power of 4 of sizes on its own: the first ones cut segments of a
sixteenth, a quarter and the whole of ``chunk_bytes`` in turns, each timed per byte, and then
every rank keeps the size whose medians, summed over the ranks, are lowest (a smaller one only
when lower by more than ``trials.SEGMENT_MARGIN``, for its CPU). Over a link shaped to
25 Mbit/s the sixteenths won: whole segments burst past the shaper's queue and TCP recovered
from losses more than twice as often. The ranks must agree, as both ends of
a segment must cut it alike, so the sum is allreduced (``_agree``) within the allreduce that
ends the trials, which is the same one on every rank.
Lending is measured after that, in segments of the chosen size.

Set up once, run many. Both choices are the machine's, not the algorithm's, so they live apart
from the schedule: each size class of each ring has a ``trials.Plan`` (kept in ``comm.plans``)
that holds its segment size and whether it lends. Once the plan is settled, ``allreduce``
reads those two fields and runs the schedule; while it is not, ``Plan.measure`` times the run
around the schedule, never inside it.
"""

from __future__ import annotations

from functools import partial
from typing import Iterator, Sequence

import numpy as np

from ..transport.comm import Communicator
from ..transport.trials import Plan, plan_of, size_class
from .ops import ReduceOp, Reducer, make_reducer

__all__ = ["reduce_scatter", "allgather", "allreduce", "even_counts", "block_offsets",
           "segment_bytes", "measuring", "LEND_ABOVE_BYTES", "TUNE_FROM_BYTES"]

#: Vectors larger than this lend their segments to the transport (see "Lending" above); about
#: the last-level cache of the machine it was measured on (32 MiB).
LEND_ABOVE_BYTES = 32 << 20

#: Allreduces of at least this many bytes over a ring with a socket may cut segments smaller
#: than ``chunk_bytes`` (see "Segment sizes" above): from DDP's first bucket up. Below, a
#: vector is a few segments either way.
TUNE_FROM_BYTES = 1 << 20

_SUM = make_reducer(ReduceOp.SUM, np.float64)


def even_counts(length: int, size: int) -> list[int]:
    """Splits ``length`` elements into ``size`` blocks whose lengths differ by at most one."""
    base, extra = divmod(length, size)
    return [base + (b < extra) for b in range(size)]


def reduce_scatter(comm: Communicator, data: np.ndarray, counts: Sequence[int], reducer: Reducer,
                   chunk_bytes: int, source: "np.ndarray | None" = None,
                   own: "np.ndarray | None" = None) -> None:
    """Reduces ``data`` over all ranks, leaving each rank's own block fully reduced.

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        data: this rank's contribution, a contiguous 1-D array; reduced in place. On return,
            ``data[offsets[r]:offsets[r] + counts[r]]`` is the reduction of that block over all
            ranks; the other blocks hold partial reductions.
        counts: elements per block, one per rank, summing to ``len(data)``; zeros allowed.
        reducer: the kernel that folds a received segment into ``data``.
        chunk_bytes: the largest segment on the wire; scratch slot 0 holds one segment.
        source: when given, this rank's contribution instead (same length and dtype), left
            unwritten; ``data`` is then only written, a segment at a time just before its fold
            (a copy that stays in cache, where copying all of ``source`` first would not).
            The block sent first, ``rank - 1``'s, goes out of ``source`` and stays unwritten
            in ``data``.
        own: when given, where this rank's block of the result goes (``counts[rank]``
            elements of ``data``'s dtype), folded straight there instead of into ``data``.
    """
    if source is not None and (source.shape != data.shape or source.dtype != data.dtype):
        raise ValueError(f"source is {source.dtype}{list(source.shape)}, data "
                         f"{data.dtype}{list(data.shape)}; they must match")
    offsets = _offsets(comm, data, counts, chunk_bytes)
    if own is not None and (own.shape != (counts[comm.rank],) or own.dtype != data.dtype):
        raise ValueError(f"own is {own.dtype}{list(own.shape)}; this rank's block is "
                         f"{data.dtype}[{counts[comm.rank]}]")
    if comm.size == 1:  # nothing to fold: the block is the contribution
        if own is not None or source is not None:
            np.copyto(data if own is None else own, data if source is None else source)
        return
    _circulate(comm, data, offsets, comm.rank - 1, _segment_elems(data, counts, chunk_bytes),
               reducer, _lends(comm, data), source, own)
    comm.settle()


def allgather(comm: Communicator, data: np.ndarray, counts: Sequence[int],
              chunk_bytes: int) -> None:
    """Fills every rank's block of ``data`` from the rank that owns it.

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        data: the whole output, a contiguous 1-D array; this rank's block is already filled.
        counts: elements per block, one per rank, summing to ``len(data)``; zeros allowed.
        chunk_bytes: the largest segment on the wire.
    """
    offsets = _offsets(comm, data, counts, chunk_bytes)
    _circulate(comm, data, offsets, comm.rank, _segment_elems(data, counts, chunk_bytes), None,
               _lends(comm, data))
    comm.settle()


def allreduce(comm: Communicator, data: np.ndarray, reducer: Reducer, chunk_bytes: int) -> None:
    """Reduces ``data`` in place over all ranks: a reduce-scatter and an allgather, their
    streams side by side (see "Both phases at once" above).

    Args:
        comm: the communicator; the caller has called ``comm.begin`` for this collective.
        data: a contiguous 1-D array; on return it holds the same reduction on every rank.
        reducer: the kernel that folds a received segment into ``data``.
        chunk_bytes: the largest segment on the wire; scratch slot 0 holds one segment. From
            ``TUNE_FROM_BYTES`` on, a ring with a socket among its pairs may cut smaller ones
            (see "Segment sizes" and "Set up once, run many" above).
    """
    counts = even_counts(len(data), comm.size)
    key = _size_class(data.nbytes, chunk_bytes)
    plan = comm.plans.get(key)
    if plan is not None and plan.settled:
        _allreduce(comm, data, counts, reducer, plan.segment, plan.lend)
    else:
        plan = plan_of(comm, key, chunk_bytes, data.nbytes, data.nbytes >= TUNE_FROM_BYTES,
                       data.nbytes > LEND_ABOVE_BYTES)
        plan.measure(comm, data.nbytes, partial(_allreduce, comm, data, counts, reducer),
                     partial(_agree, comm, chunk_bytes))


def _allreduce(comm: Communicator, data: np.ndarray, counts: Sequence[int], reducer: Reducer,
               chunk_bytes: int, lend: bool) -> None:
    """Both phases of ``allreduce`` as one stream of exchanges: see "Both phases at once"."""
    n = comm.size
    offsets = _offsets(comm, data, counts, chunk_bytes)
    if n == 1:
        return
    seg_elems = _segment_elems(data, counts, chunk_bytes)
    rank = comm.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    rs_sends = list(_segments(offsets, rank - 1, seg_elems))
    rs_recvs = list(_segments(offsets, rank - 2, seg_elems))
    ag_sends = list(_segments(offsets, rank, seg_elems))
    ag_recvs = list(_segments(offsets, rank - 1, seg_elems))
    lag = _lag(offsets, seg_elems)
    scratch = comm.scratch(seg_elems * data.itemsize).view(data.dtype)
    # The wire takes bytes: slices of byte views cost less than arrays' (per exchange, in Python).
    size = data.itemsize
    raw, landing = data.view(np.uint8).data, scratch.view(np.uint8).data
    for k in range(lag + max(len(ag_sends), len(ag_recvs))):
        outgoing, incoming = [], []
        if k < len(rs_sends):
            lo, hi = rs_sends[k]
            outgoing.append((right, raw[lo * size:hi * size]))
        fold = rs_recvs[k] if k < len(rs_recvs) else None
        if fold is not None:
            incoming.append((left, landing[:(fold[1] - fold[0]) * size]))
        j = k - lag
        if 0 <= j < len(ag_sends):
            lo, hi = ag_sends[j]
            outgoing.append((right, raw[lo * size:hi * size]))
        if 0 <= j < len(ag_recvs):
            lo, hi = ag_recvs[j]
            incoming.append((left, raw[lo * size:hi * size]))
        comm.exchange(outgoing, incoming, lend)
        if fold is not None and fold[1] > fold[0]:
            lo, hi = fold
            reducer(data[lo:hi], scratch[:hi - lo])
    comm.settle()


def _lag(offsets: list[int], seg_elems: int) -> int:
    """How many exchanges the allgather's stream of ``_allreduce`` runs behind the
    reduce-scatter's: the same on every rank (both ends of each segment post it in the same
    exchange), and enough on every rank for its own block's segments to be folded before they
    leave."""
    n = len(offsets) - 1
    segs = [-(-(offsets[b + 1] - offsets[b]) // seg_elems) or 1 for b in range(n)]
    total = sum(segs)
    # Rank q folds its own block last in its reduce-scatter stream, which skips block q - 1.
    return 1 + max(total - segs[q - 1] - segs[q] for q in range(n))


def _agree(comm: Communicator, chunk_bytes: int, costs: np.ndarray) -> None:
    """Sums the trials' ``costs`` over the ring (``Plan.measure``): a ring allreduce of its own,
    too small to be tuned, that leaves the same bits on every rank."""
    allreduce(comm, costs, _SUM, chunk_bytes)


def _size_class(nbytes: int, chunk_bytes: int) -> tuple:
    """The key of the plan of allreduces of ``nbytes``: its power of 4, and which side of
    each threshold it is on (``LEND_ABOVE_BYTES`` falls inside one)."""
    return (chunk_bytes, size_class(nbytes), nbytes >= TUNE_FROM_BYTES,
            nbytes > LEND_ABOVE_BYTES)


def _plan(comm: Communicator, nbytes: int, chunk_bytes: int) -> Plan:
    return plan_of(comm, _size_class(nbytes, chunk_bytes), chunk_bytes, nbytes,
                   nbytes >= TUNE_FROM_BYTES, nbytes > LEND_ABOVE_BYTES)


def segment_bytes(comm: Communicator, nbytes: int, chunk_bytes: int) -> int:
    """The largest segment an allreduce of ``nbytes`` on ``comm`` cuts now (once the trials of
    segment sizes are over, from then on)."""
    return _plan(comm, nbytes, chunk_bytes).next_segment()


def measuring(comm: Communicator, nbytes: int, chunk_bytes: int) -> bool:
    """Whether a ring allreduce of ``nbytes`` on ``comm`` would be one of its trials, of
    segment sizes or of lending."""
    plan = _plan(comm, nbytes, chunk_bytes)
    if plan.lending is not None and not comm.lends:
        return plan.sizing is not None and plan.sizing.chosen is None
    return plan.measuring()


def _lends(comm: Communicator, data: np.ndarray) -> bool:
    """Whether a reduce-scatter or allgather of ``data`` alone lends: above the threshold,
    unless the Comm's allreduces found copying faster."""
    return data.nbytes > LEND_ABOVE_BYTES and comm.lending.chosen is not False


def block_offsets(counts: Sequence[int], size: int, length: int) -> list[int]:
    """Validates one count per rank against ``length``; returns the ``size + 1`` boundaries."""
    if len(counts) != size:
        raise ValueError(f"{len(counts)} counts for {size} ranks")
    offsets = [0]
    for count in counts:
        if count < 0:
            raise ValueError(f"negative count in {list(counts)}")
        offsets.append(offsets[-1] + count)
    if offsets[-1] != length:
        raise ValueError(f"counts {list(counts)} sum to {offsets[-1]}, not {length} elements")
    return offsets


def _offsets(comm: Communicator, data: np.ndarray, counts: Sequence[int],
             chunk_bytes: int) -> list[int]:
    """Validates the arguments; returns the ``n + 1`` block boundaries."""
    if data.ndim != 1 or not data.flags.c_contiguous:
        raise ValueError(f"ring collectives take a contiguous 1-D array, got shape {data.shape}")
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return block_offsets(counts, comm.size, len(data))


def _segment_elems(data: np.ndarray, counts: Sequence[int], chunk_bytes: int) -> int:
    # Capped by the largest block, so a huge chunk_bytes ("don't segment") doesn't ask for a
    # huge scratch buffer. Every rank computes the same value from the same counts.
    return max(1, min(chunk_bytes // data.itemsize, max(counts)))


def _segments(offsets: list[int], first_block: int, seg_elems: int) -> Iterator[tuple[int, int]]:
    """The ``(start, stop)`` of each segment of blocks ``first_block``, ``first_block - 1``, ...

    Covers ``n - 1`` blocks, one per ring step; an empty block yields one empty segment.
    """
    n = len(offsets) - 1
    for step in range(n - 1):
        block = (first_block - step) % n
        start, end = offsets[block], offsets[block + 1]
        while True:
            stop = min(start + seg_elems, end)
            yield start, stop
            start = stop
            if start >= end:
                break


def _circulate(comm: Communicator, data: np.ndarray, offsets: list[int], first_send_block: int,
               seg_elems: int, reducer: "Reducer | None", lend: bool,
               source: "np.ndarray | None" = None, own: "np.ndarray | None" = None) -> None:
    """Runs one ring phase: reduce-scatter when ``reducer`` is given, allgather when None.

    Reduce-scatter only (``reduce_scatter``): ``source``, the contribution, read where ``data``
    would be before a segment is folded there; ``own``, where this rank's block is folded."""
    n = comm.size
    if n == 1:
        return
    right, left = (comm.rank + 1) % n, (comm.rank - 1) % n
    sends = _segments(offsets, first_send_block, seg_elems)
    recvs = _segments(offsets, first_send_block - 1, seg_elems)
    scratch = None
    if reducer is not None:
        scratch = comm.scratch(seg_elems * data.itemsize).view(data.dtype)
    # The first block sent is the only one sent unfolded: out of ``source`` when given. It is
    # cut into this many segments (``_segments``: an empty block is one empty segment).
    b = first_send_block % n
    unfolded = -(-(offsets[b + 1] - offsets[b]) // seg_elems) or 1
    own_lo, own_hi = offsets[comm.rank], offsets[comm.rank + 1]
    send, recv = next(sends, None), next(recvs, None)
    while send is not None or recv is not None:
        # The streams differ in length by the segment counts of two blocks, so near the end a
        # rank may only send or only receive.
        outgoing = []
        if send is not None:
            outgoing.append((right, (data if source is None or unfolded <= 0 else source)
                             [send[0]:send[1]]))
            unfolded -= 1
        incoming = []
        if recv is not None:
            start, stop = recv
            landing = data[start:stop] if scratch is None else scratch[:stop - start]
            incoming.append((left, landing))
        comm.exchange(outgoing, incoming, lend)
        if reducer is not None and recv is not None and stop > start:  # fold what landed
            base = data if source is None else source
            if own is not None and own_lo <= start < own_hi:
                into = own[start - own_lo:stop - own_lo]
                np.copyto(into, base[start:stop])
            else:
                into = data[start:stop]
                if source is not None:
                    np.copyto(into, source[start:stop])
            reducer(into, landing)
        send, recv = next(sends, None), next(recvs, None)
