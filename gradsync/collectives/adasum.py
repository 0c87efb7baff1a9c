"""Adasum: adaptive summation of gradients (Maleki et al., MLSys 2021), by vector halving.

The combination. Two ranks' vectors ``a`` and ``b`` are combined into::

    Adasum(a, b) = (1 - a.b / (2 |a|^2)) a  +  (1 - a.b / (2 |b|^2)) b

Orthogonal vectors (``a.b = 0``) are summed; equal vectors give themselves back (each
coefficient is 1/2); parallel ones give their average; in between, the shared component is
counted once and the rest added, so the step stays the size of one rank's step where ranks
agree and grows where they bring new directions. A worked pair: ``a = (1, 0)``,
``b = (1, 1)``: ``a.b = 1``, ``|a|^2 = 1``, ``|b|^2 = 2``, so the coefficients are
``1 - 1/2 = 0.5`` and ``1 - 1/4 = 0.75`` and ``Adasum(a, b) = (0.5, 0) + (0.75, 0.75) =
(1.25, 0.75)`` (the sum would be ``(2, 1)``, the average ``(1, 0.5)``). A vector with
``|v|^2`` below ``sqrt(DBL_MIN)`` counts as zero: its coefficient is 1 (so ``Adasum(0, b) =
b``), as in Horovod. Dot products and norms are per *tensor*: when ``flat`` is a fusion buffer,
``counts`` cuts it into tensors and each tensor gets its own two coefficients, as if it had
been reduced alone.

The tree. Over many ranks the combination is applied recursively, in a binary tree: ranks
``2i`` and ``2i+1`` first, then pairs of pairs, and so on. With ``n`` a power of two ``p``
and ranks holding ``g0..g3``, the answer is ``Adasum(Adasum(g0, g1), Adasum(g2, g3))``.

Vector halving, distance doubling. No rank gathers whole vectors. Vocabulary: a rank owns a
*window* ``[lo, hi)`` of the buffer, the whole of it at first; at *level* ``d = 1, 2, 4, ..``
it pairs with ``peer = rank XOR d``, which owns the same window (windows depend only on the
rank bits below ``d``). The window is cut at its middle; the rank with bit ``d`` clear keeps
the lower half, its peer the upper, and each sends the half it gives up. Now each holds, on
its half, both the *left* vector (the combination of the ranks whose bit ``d`` is clear) and
the *right* one, but only a slice of each: the ``2d`` ranks of its *group* (same rank bits
above ``d``) hold disjoint slices that together cover the buffer. So each computes partial
``a.b``, ``|a|^2``, ``|b|^2`` per tensor on its slice, in float64, and the group sums them
(recursive doubling over ``3 x tensors`` float64s); every member then has the same three
numbers per tensor and combines its slice. With 4 ranks and a buffer of 8 elements::

    level 1: 0<->1, 2<->3   0 and 2 keep [0,4), 1 and 3 keep [4,8); sums within {0,1}, {2,3}
             -> the slices of Adasum(g0,g1) lie on 0 and 1, of Adasum(g2,g3) on 2 and 3
    level 2: 0<->2, 1<->3   0 keeps [0,2), 2 [2,4), 1 [4,6), 3 [6,8); sums within {0,1,2,3}
             -> each rank holds a quarter of the answer

Then the windows grow back (levels in reverse): each rank sends its window to the peer and
receives the peer's, until everyone has the whole answer, bit for bit the same. Each rank sends
about ``n/2 + n/4 + ..`` elements each way in each phase: O(n) bytes, like Rabenseifner's
allreduce (``halving_doubling.py``), plus ``O(log^2 p)`` tiny messages for the dot products.

Any number of ranks. Horovod refuses a world that is not a power of two ("Running Adasum with
non-power of 2 ranks is not supported yet"). Here the largest power of two ``p <= n`` is the
*core*, and each *extra* rank ``e >= p`` first sends its whole vector to its *partner*
``e - p``, which replaces its own vector by ``Adasum(own, extra's)`` (whole vectors, so the
dot products are local); the core then runs the tree above, and each partner sends the answer
back to its extra, as ``doubling.fold_in`` / ``fold_out`` do for sums. The tree for ``n = 6``::

    Adasum(Adasum(Adasum(g0, g4), Adasum(g1, g5)), Adasum(g2, g3))

It is a different tree from a balanced one, so where Adasum's answer depends on the tree
(parallel ``g0, g1, g2`` average with weights ``1/4, 1/2, 1/4`` rather than ``1/3``
each) a non-power-of-two world weights the folded ranks less; orthogonal gradients
still sum, equal ones still give themselves, and the answer still scales with its inputs.

Precision. Dot products and norms accumulate in float64; each combination is computed in
float64 and rounded once to the buffer's dtype (float16, bfloat16, float32 or float64), so
every level of the tree rounds its result once, as a rank holding the whole vector would.
The arithmetic runs over ``_CHUNK`` elements at a time, widened into two float64 work buffers.
Scratch slot 0 holds received halves (half of ``flat``; all of it on fold partners), slot 1
the dot products, slots 2 and 3 the work buffers.
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from ..transport.comm import Communicator
from .doubling import core_size, fold_in, fold_out
from .ops import BFLOAT16

__all__ = ["allreduce", "combine"]

_ZERO_NORM = float(np.sqrt(sys.float_info.min))
"""A squared norm below this counts as zero: its vector's coefficient is 1 (Horovod's rule)."""

_CHUNK = 1 << 15
"""Elements per pass of the float64 arithmetic: two float64 copies of this many (512 KiB)
stay in cache, where whole float64 copies of a large buffer would not."""

_FLOATS = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}


def allreduce(comm: Communicator, flat: np.ndarray, dtype,
              counts: Sequence[int] | None = None) -> None:
    """Replaces ``flat`` on every rank by the Adasum of all ranks' ``flat``, in place.

    Args:
        comm: the communicator (a Comm or CommView); the caller has called ``comm.begin``.
        flat: a contiguous 1-D array, the same length on every rank (bfloat16 as uint16).
        dtype: ``flat``'s element type: float16, float32, float64 or ``BFLOAT16``.
        counts: element counts of the tensors packed in ``flat``, in order (they sum to
            ``flat.size``); each gets its own dot products. None: one tensor.

    Raises:
        TypeError: ``dtype`` is not a floating-point type.
        ValueError: ``counts`` does not cut ``flat`` exactly.
    """
    _check_dtype(dtype)
    offsets = _offsets(counts, flat.size)
    if comm.size == 1 or flat.size == 0:
        return
    p = core_size(comm.size)

    work = _work(comm)

    def fold(mine: np.ndarray, extra: np.ndarray) -> None:  # whole vectors: local dot products
        _combine(mine, extra, True, dtype, offsets, _dots(mine, extra, True, dtype, offsets, work),
                 work)

    if fold_in(comm, flat, fold, p):
        windows, kept = _halve(comm, flat, dtype, p, offsets, work)
        _double(comm, flat, p, windows, kept)
    fold_out(comm, flat, p)


def combine(a: np.ndarray, b: np.ndarray, dtype, counts: Sequence[int] | None = None) -> None:
    """``a = Adasum(a, b)`` in place, on one rank holding both whole vectors.

    Args:
        a, b: contiguous 1-D arrays of the same length and dtype (bfloat16 as uint16).
        dtype: their element type, as for ``allreduce``.
        counts: element counts of the tensors packed in ``a`` and ``b``; None: one tensor.
    """
    _check_dtype(dtype)
    offsets = _offsets(counts, a.size)
    if a.size != b.size:
        raise ValueError(f"Adasum of vectors of {a.size} and {b.size} elements")
    work = (np.empty(_CHUNK), np.empty(_CHUNK))
    _combine(a, b, True, dtype, offsets, _dots(a, b, True, dtype, offsets, work), work)


def _halve(comm: Communicator, flat: np.ndarray, dtype, p: int, offsets: np.ndarray,
           work) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """The combining levels; returns the window held before each level and the one kept last."""
    rank = comm.rank
    lo, hi = 0, flat.size
    windows = []
    distance = 1
    while distance < p:
        peer = rank ^ distance
        middle = lo + (hi - lo) // 2
        is_left = not rank & distance
        keep, give = ((lo, middle), (middle, hi)) if is_left else ((middle, hi), (lo, middle))
        incoming = comm.scratch(flat.itemsize * (keep[1] - keep[0])).view(flat.dtype)
        comm.exchange([(peer, flat[give[0]:give[1]])], [(peer, incoming)])
        windows.append((lo, hi))
        lo, hi = keep
        bounds = np.clip(offsets, lo, hi) - lo  # tensor boundaries within the window
        dots = _dots(flat[lo:hi], incoming, is_left, dtype, bounds, work)
        _group_sum(comm, dots, distance)
        _combine(flat[lo:hi], incoming, is_left, dtype, bounds, dots, work)
        distance <<= 1
    return windows, (lo, hi)


def _double(comm: Communicator, flat: np.ndarray, p: int, windows: list[tuple[int, int]],
            kept: tuple[int, int]) -> None:
    """Grows the window ``kept`` back to the whole buffer: the levels of ``_halve`` in reverse,
    each rank sending its window and receiving its peer's, the other half of the one before."""
    lo, hi = kept
    distance = p >> 1
    while distance:
        peer = comm.rank ^ distance
        outer_lo, outer_hi = windows.pop()
        theirs = flat[outer_lo:lo] if comm.rank & distance else flat[hi:outer_hi]
        comm.exchange([(peer, flat[lo:hi])], [(peer, theirs)])
        lo, hi = outer_lo, outer_hi
        distance >>= 1


def _group_sum(comm: Communicator, dots: np.ndarray, distance: int) -> None:
    """Sums ``dots`` over the ``2 * distance`` ranks that share this rank's bits above ``distance``.

    Recursive doubling: rank ``r`` adds ``x + y`` where its peer adds ``y + x``, the same bits, so
    every member ends with identical sums and hence identical coefficients.
    """
    incoming = comm.scratch(dots.nbytes, slot=1).view(np.float64).reshape(dots.shape)
    step = 1
    while step <= distance:
        peer = comm.rank ^ step
        comm.exchange([(peer, dots)], [(peer, incoming)])
        dots += incoming
        step <<= 1


def _dots(mine: np.ndarray, theirs: np.ndarray, mine_is_left: bool, dtype, bounds: np.ndarray,
          work) -> np.ndarray:
    """Per tensor ``[left.right, |left|^2, |right|^2]`` over these slices, in float64.

    ``bounds`` are the tensors' boundaries within the slices (``len(tensors) + 1`` of them).
    """
    dots = np.zeros((len(bounds) - 1, 3))
    for start, end, a, b in _chunks(mine, theirs, dtype, work):
        ids, starts, _ = _chunk_segments(bounds, start, end)
        if len(ids) == 1:
            dots[ids[0]] += (np.dot(a, b), np.dot(a, a), np.dot(b, b))
        else:
            for column, (x, y) in enumerate(((a, b), (a, a), (b, b))):
                dots[ids, column] += np.add.reduceat(x * y, starts)
    if not mine_is_left:
        dots[:, [1, 2]] = dots[:, [2, 1]]
    return dots


def _combine(mine: np.ndarray, theirs: np.ndarray, mine_is_left: bool, dtype, bounds: np.ndarray,
             dots: np.ndarray, work) -> None:
    """``mine = c_left * left + c_right * right``, per tensor, computed in float64."""
    dot, left_sq, right_sq = dots[:, 0], dots[:, 1], dots[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        c_left = np.where(left_sq >= _ZERO_NORM, 1.0 - dot / (2.0 * left_sq), 1.0)
        c_right = np.where(right_sq >= _ZERO_NORM, 1.0 - dot / (2.0 * right_sq), 1.0)
    c_mine, c_theirs = (c_left, c_right) if mine_is_left else (c_right, c_left)
    for start, end, a, b in _chunks(mine, theirs, dtype, work):
        ids, _, lengths = _chunk_segments(bounds, start, end)
        if len(ids) == 1:
            a *= c_mine[ids[0]]
            b *= c_theirs[ids[0]]
        else:
            a *= np.repeat(c_mine[ids], lengths)
            b *= np.repeat(c_theirs[ids], lengths)
        a += b
        _narrow(a, mine[start:end], dtype)


def _chunks(mine: np.ndarray, theirs: np.ndarray, dtype, work):
    """Yields ``(start, end, a, b)``: float64 copies of ``mine[start:end]``, ``theirs[start:end]``
    in the work buffers, ``_CHUNK`` elements at a time, so that the arithmetic runs in cache
    and allocates nothing per call."""
    for start in range(0, mine.size, _CHUNK):
        end = min(start + _CHUNK, mine.size)
        a, b = work[0][:end - start], work[1][:end - start]
        _widen_into(mine[start:end], a, dtype)
        _widen_into(theirs[start:end], b, dtype)
        yield start, end, a, b


def _chunk_segments(bounds: np.ndarray, start: int, end: int):
    """The tensors that meet ``[start, end)``: ids, starts and lengths relative to ``start``."""
    first = int(np.searchsorted(bounds, start, "right")) - 1  # the tensor holding ``start``
    stop = int(np.searchsorted(bounds, end, "left"))  # tensors ``first .. stop-1`` begin before end
    if stop - first == 1:
        return (first,), (0,), (end - start,)
    ids = np.arange(first, stop)
    starts = np.clip(bounds[first:stop], start, end) - start
    lengths = np.clip(bounds[first + 1:stop + 1], start, end) - start - starts
    keep = lengths > 0
    return ids[keep], starts[keep], lengths[keep]


def _work(comm: Communicator) -> tuple[np.ndarray, np.ndarray]:
    return (comm.scratch(8 * _CHUNK, slot=2).view(np.float64),
            comm.scratch(8 * _CHUNK, slot=3).view(np.float64))


def _widen_into(x: np.ndarray, out: np.ndarray, dtype) -> None:
    """Copies ``x`` into the float64 array ``out`` (exact for every supported dtype)."""
    if dtype == BFLOAT16:
        x = (x.astype(np.uint32) << 16).view(np.float32)
    np.copyto(out, x)


def _narrow(values: np.ndarray, out: np.ndarray, dtype) -> None:
    """Rounds float64 ``values`` to ``dtype`` into ``out`` (round to nearest even)."""
    if dtype == BFLOAT16:
        import torch

        bf16 = torch.from_numpy(values).to(torch.bfloat16)
        out[:] = bf16.view(torch.int16).numpy().view(np.uint16)
    else:
        out[:] = values


def _check_dtype(dtype) -> None:
    if dtype == BFLOAT16:
        return
    if np.dtype(dtype) not in _FLOATS:
        raise TypeError(f"Adasum needs float16, bfloat16, float32 or float64 data, "
                        f"not {np.dtype(dtype).name}")


def _offsets(counts: Sequence[int] | None, size: int) -> np.ndarray:
    """Tensor boundaries ``[0, c0, c0+c1, ..]``, checked against the buffer's size."""
    if counts is None:
        return np.array([0, size], dtype=np.int64)
    lengths = np.asarray(list(counts), dtype=np.int64)
    if (lengths < 0).any() or lengths.sum() != size:
        raise ValueError(f"Adasum counts {lengths.tolist()} must be >= 0 and sum to the "
                         f"buffer's {size} elements")
    return np.concatenate(([0], np.cumsum(lengths)))
