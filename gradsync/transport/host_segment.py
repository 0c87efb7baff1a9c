"""The host's shared segment: allreduce, broadcast and barrier among the ranks of one host.

The segment is a transport, the second beside the pairs (``base.py``): where every rank of a
World is on this host, ``connect/_shm_setup.py`` opens it and ``World`` holds it, and the
algorithms reach it through ``pipeline/operations.py`` (the ``shm`` algorithm) like any other
transport. The front doors never hold it: they ask ``World`` (is there a small-message road
for this call, how large a bucket is worth sharing, a shared buffer of n bytes), and
tests/test_structure.py names the only modules that may reach it.

Vocabulary. The host's *local ranks* 0..n-1 share one segment. Each local rank owns two
*slots* of ``slot_bytes`` (double buffering) and one cache line of *counters*. The data is
processed in *pieces* of at most one slot; every piece gets the next *sequence number*
``seq`` (global across calls, never reset, identical on every rank because every rank
processes the same pieces), and uses the slots of *parity* ``seq % 2``. A piece is split
evenly into n *sub-slices* (boundaries rounded to cache lines, some possibly empty);
local rank i *owns* sub-slice i: it alone reduces it.

One piece of an allreduce, on local rank i:

    1. copy-in   copy the piece into my slot, except sub-slice i (only I would read it);
                 publish arrived[i] = seq; wait until every arrived[r] >= seq, then check
                 that every rank issued the same collective (signature, size, kind).
    2. reduce    fold sub-slice i of every other rank's slot into data[sub-slice i], in the
                 order of local ranks (mine first); copy the result into my slot;
                 publish reduced[i] = seq; wait until every reduced[r] >= seq.
    3. copy-out  copy sub-slice r of rank r's slot into data, for every r != i.

Worked example: 3 local ranks, a piece of 6 float32 (cache-line rounding aside), so the
sub-slices are [0,2) [2,4) [4,6). Rank 1 copies data[0:2] and data[4:6] into its slot and
arrives; then it computes data[2:4] = data[2:4] + slot0[2:4] + slot2[2:4] (ranks 0 and 2
do the same for [0,2) and [4,6)), copies data[2:4] into slot1[2:4] and publishes reduced;
then it copies slot0[0:2] and slot2[4:6] into its data. Each element is computed by exactly
one rank and copied by the others, so every rank ends with bitwise identical values, and
the fold order (owner's value first, then the others by local rank) is fixed for a given
host size. Per rank and per byte of data, an allreduce moves (n-1)/n in, folds (n-1)/n,
publishes 1/n and copies (n-1)/n out: about 3 passes over memory, against 8(n-1)/n for a
ring allreduce over the byte rings of ``transport/shm.py`` (each of its 2(n-1)/n sends is
copied into a ring and out again, and half of them are folded).

Four roads. ``ShmGroup.allreduce`` chooses by what it is given, which is the same on every
rank: shared buffers take the shared road (``segment_shared.py``: the buffers themselves
instead of the slots; from a slot's size on, only where every rank passes one, which the
ranks tell each other in one arrival before the pieces); an allreduce that fits one piece of
at most ``small_bytes`` takes the one-step road (``segment_small.py``: one synchronisation
instead of two, and one C call where ``_shmfast.c`` has a kernel for the op and dtype, whose
codes ``_FAST_CODES`` below builds); anything else the pieces above. A broadcast goes piece
by piece through the root's slots, a barrier is one arrival.

The parts, bottom up: ``segment_layout.py`` places every word and slot of the segment and
makes and names it; ``segment_sync.py`` (``SegmentRank``) is one rank's hold on it, the
arrivals and waits every road is built from, and why two slots and no locks suffice;
``segment_small.py`` (``SmallRoad``) and ``segment_shared.py`` (``SharedRoad``) are two of
the roads; this module's ``ShmGroup`` stands on them all: it opens the group, chooses the
road, and runs the pieces, broadcasts and barriers.
"""

from __future__ import annotations

import collections
import enum
import mmap
import os
import time
from typing import Callable, Sequence

import numpy as np

from .. import _native
from .segment_layout import (_ALLREDUCE, _BARRIER, _BROADCAST, _CLOSED, _REDUCED,
                             _control_bytes, create_group_segment, group_segment_name,
                             segment_bytes)
from .segment_shared import SharedRoad
from .segment_small import SmallRoad
from .segment_stores import Stores
from .segment_sync import Reducer
from .shm import CACHE_LINE, attach_segment, unlink_segment
from .wait import native_ladder

__all__ = ["ShmGroup", "segment_bytes", "DEFAULT_SLOT_BYTES", "DEFAULT_SMALL_BYTES",
           "group_segment_name", "create_group_segment"]

DEFAULT_SLOT_BYTES = 1 << 20
DEFAULT_SMALL_BYTES = 32 << 10

# Kernel codes of _shmfast.c: op << 4 | dtype. An Average folds as a sum, then divides.
# The ops are named by their ``ReduceOp`` value (``collectives/ops.py``, the floor above: the
# segment takes the algorithms' op and reads its value, and imports nothing from there).
_FAST_OPS = {"sum": 0, "average": 0, "min": 1, "max": 2, "product": 3}
_FAST_DTYPES: dict[np.dtype, int] = {np.dtype(np.float32): 0, np.dtype(np.float64): 1,
                                     np.dtype(np.int32): 2, np.dtype(np.int64): 3}
# Looked up with the op an allreduce was given, None when the Python road must run: no code.
_FAST_CODES: dict[tuple[str, np.dtype], int] = {
    (op, dtype): code << 4 | t for op, code in _FAST_OPS.items()
    for dtype, t in _FAST_DTYPES.items()}


class ShmGroup(SmallRoad, SharedRoad):
    """The local ranks of one host, joined by one shared segment (set up once, reused).

    Collectives on one group must be issued by one thread at a time, in the same order on
    every local rank (the sequence numbers pair them up).

    Args:
        segment: the mapped segment (``create_group_segment`` or ``attach_segment``).
        local_rank: this process's index among the host's ranks.
        ranks: the global rank of each local rank, for error messages (default: local ranks).
        small_bytes, sleep, fast, stream: as for ``open``.

    Attributes:
        fast: whether small allreduces can take the compiled road (``_shmfast.c``).
        stores: how the pieces road writes this rank's slot (``segment_stores.py``).
    """

    def __init__(self, segment: mmap.mmap, local_rank: int, ranks: "Sequence[int] | None" = None,
                 small_bytes: int = DEFAULT_SMALL_BYTES, sleep: str = "auto",
                 fast: bool = True, stream: str = "auto"):
        super().__init__(segment, local_rank, ranks, sleep)
        self.small_bytes = min(small_bytes, self.slot_bytes)
        # Load only: this runs inside init()'s connect window, so a first-use compile happens
        # earlier (World.connect builds before its deadline starts; _native.py says why).
        module = _native.load("_shmfast", build=False) if fast else None
        self._fast_call = self._fast_fold = self._fast_group = None  # (``SmallRoad``'s)
        self._fast_prepared = None
        if module is not None:
            # The compiled wait climbs the same ladder (``wait.py``), handed over here once.
            self._fast_group = module.open(segment, local_rank, self.size, self.slot_bytes,
                                           _control_bytes(self.size), self._futex is not None,
                                           *native_ladder(self._may_spin))
            self._fast_call, self._fast_fold = module.call, module.fold
            self._fast_prepared = module.Prepared
        self.fast = self._fast_group is not None
        self.stores = Stores(module.stream if module is not None else None, stream)
        self._shared, self._mapped = {}, collections.OrderedDict()  # (``SharedRoad``'s)

    @classmethod
    def open(cls, job: str, local_rank: int, local_size: int, barrier: Callable[[], None],
             slot_bytes: int = DEFAULT_SLOT_BYTES, ranks: "Sequence[int] | None" = None,
             tag: str = "host", small_bytes: int = DEFAULT_SMALL_BYTES,
             sleep: str = "auto", fast: bool = True, stream: str = "auto") -> "ShmGroup":
        """Sets up the host's group; every local rank calls it at the same time.

        Local rank 0 creates the segment; ``barrier()``; the others attach; ``barrier()``;
        local rank 0 unlinks it, so nothing remains in /dev/shm however the job ends.

        Args:
            job: the job id (letters, digits, ``_.-``), the same on every local rank.
            local_rank: this process's index among the host's ``local_size`` ranks.
            barrier: returns only once every local rank has called it (a store barrier).
            slot_bytes: the piece size; local rank 0's value wins. A piece about the size
                of a core's L2 cache is fastest (docs/benchmarks-history.md, "Measurement
                notes moved out of the code").
            ranks: the global rank of each local rank, for error messages.
            tag: tells apart several groups of one job on one host.
            small_bytes: an allreduce of at most this many bytes takes the one-step road.
            sleep: how waits sleep after spinning: ``futex``, ``nap`` (``time.sleep``), or
                ``auto`` (futex where available).
            fast: let small allreduces take the compiled road where it can be built
                (``Config.shm_fast``); False keeps every collective on the Python road.
            stream: how the pieces road writes this rank's slot: ``auto`` (measured),
                ``never`` or ``always`` streamed past the cache (``Config.shm_stream``,
                ``segment_stores.py``); without the compiled module, never.
        """
        name = group_segment_name(job, tag)
        seg = create_group_segment(name, local_size, slot_bytes) if local_rank == 0 else None
        try:
            barrier()  # the segment exists before anyone attaches
            group = cls(seg if seg is not None else attach_segment(name), local_rank, ranks,
                        small_bytes, sleep, fast, stream)
            if group.size != local_size:
                raise ValueError(f"segment {name} is for {group.size} ranks, not {local_size}")
            barrier()  # everyone has mapped it (and registered its pid) before it is unlinked
        finally:
            if local_rank == 0:
                unlink_segment(name)
        return group

    # --- collectives ---------------------------------------------------------------------

    def allreduce(self, data: np.ndarray, reducer: Reducer, deadline: float,
                  on_idle: Callable[[float], None] = lambda waited: None,
                  signature: int = 0,
                  finish: Callable[[np.ndarray], None] | None = None,
                  op: "enum.Enum | None" = None, divisor: int = 0, trunc: bool = False) -> None:
        """Reduces ``data`` in place across the local ranks; all end with identical bytes.

        Args:
            data: a C-contiguous NumPy array, same dtype and size on every local rank.
            reducer: ``reducer(dst, src)`` folds ``src`` into ``dst`` (``ops.make_reducer``).
            deadline: ``time.monotonic()`` value after which GradsyncTimeoutError is raised.
            on_idle: called with the seconds waited, about every 50 ms of waiting.
            signature: 64-bit hash of the collective; ranks that pass different ones raise
                CollectiveMismatchError.
            finish: applied in place to every reduced element exactly once, by the rank that
                computed it, before the others copy it (an Average's division): the same
                result as applying it to ``data`` afterwards, without another pass over it.
            op, divisor, trunc: what ``reducer`` and ``finish`` compute, for the compiled
                road: ``op``, then (``divisor`` > 0) a division by ``divisor`` in the element
                type, integers rounded down (toward zero with ``trunc``), as
                ``collectives.ops.scale`` does. Leave ``op`` None when ``finish`` does anything
                else: the Python road then runs.
        """
        flat = self._flat(data, writable=True)
        if self.size == 1:
            return
        self.moved += 2 * flat.nbytes
        shared = self._shared_of(flat)
        if shared is not None and flat.nbytes < self.slot_bytes:
            with self._guard():
                self._allreduce_shared(flat, shared, reducer, finish, deadline, on_idle,
                                       signature)
            return
        if flat.nbytes <= self.small_bytes:
            try:  # what _guard does, without a context manager's cost on the small road
                code = (_FAST_CODES.get((op._value_, flat.dtype))
                        if self._fast_call and op is not None else None)
                if code is not None:
                    self._allreduce_fast(flat, code, divisor, trunc, deadline, on_idle,
                                         signature)
                    return
                self._allreduce_small(flat, reducer, deadline, on_idle, signature)
                if finish is not None and flat.size:
                    finish(flat)
            except BaseException as exc:
                self._fail(exc)
                raise
            return
        with self._guard():
            if flat.nbytes >= self.slot_bytes:  # shared buffers on every rank, or the pieces
                seq = self._offer(flat, shared, deadline, on_idle, signature)
                if seq:
                    self._fold_shared(flat, seq, reducer, finish, deadline, on_idle)
                    return
            views = self._views_of(flat.dtype)
            step = self.slot_bytes // flat.itemsize
            align = max(1, CACHE_LINE // flat.itemsize)
            stores = self.stores
            # The pieces after a call's first, of a whole slot, are timed for ``stores``.
            timed, ended = stores.measuring and flat.nbytes >= 2 * self.slot_bytes, None
            # An empty array still takes one (empty) piece, so that its signature is checked.
            for start in range(0, max(flat.size, 1), step):
                piece = flat[start:start + step]
                seq = self._next_seq()
                slots = [v[seq & 1] for v in views]
                bounds = self._split(piece.size, align)
                lo, hi = bounds[self.rank], bounds[self.rank + 1]
                copy = stores.copy if stores.stream_now() else None
                self._copy_in(piece, slots[self.rank], lo, hi, copy)
                self._arrive(seq, _ALLREDUCE, flat.nbytes, signature, deadline, on_idle)
                self._reduce(piece, slots, lo, hi, reducer, finish, copy)
                self._publish(_REDUCED, seq)
                self._wait(_REDUCED, seq, deadline, on_idle, "finish reducing")
                self._copy_out(piece, slots, bounds)
                if timed:
                    now = time.perf_counter()
                    if ended is not None and piece.nbytes == self.slot_bytes:
                        stores.record(now - ended)
                    ended = now

    def fast_code(self, op: enum.Enum, dtype: np.dtype) -> "int | None":
        """The compiled road's kernel code for ``op`` on ``dtype``, or None when an allreduce
        of them takes the Python road (or the compiled one is not built)."""
        return _FAST_CODES.get((op._value_, dtype)) if self._fast_call else None

    def broadcast(self, data: np.ndarray, root: int, deadline: float,
                  on_idle: Callable[[float], None] = lambda waited: None,
                  signature: int = 0) -> None:
        """Copies local rank ``root``'s ``data`` into every other local rank's ``data``.

        Arguments as for ``allreduce``; ``root`` is a local rank.
        """
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} outside the group's {self.size} local ranks")
        flat = self._flat(data, writable=self.rank != root)
        if self.size == 1:
            return
        self.moved += flat.nbytes
        with self._guard():
            views = self._views_of(flat.dtype)
            step = self.slot_bytes // flat.itemsize
            for start in range(0, max(flat.size, 1), step):
                piece = flat[start:start + step]
                seq = self._next_seq()
                slot = views[root][seq & 1][:piece.size]
                if self.rank == root:
                    slot[...] = piece
                self._arrive(seq, _BROADCAST | root << 8, flat.nbytes, signature, deadline,
                             on_idle)
                if self.rank != root:
                    piece[...] = slot

    def barrier(self, deadline: float, on_idle: Callable[[float], None] = lambda waited: None,
                signature: int = 0) -> None:
        """Returns once every local rank has entered the barrier (in one C call where the
        compiled road is built)."""
        if self.size == 1:
            return
        if self._fast_call is not None:
            self._barrier_fast(deadline, on_idle, signature)
            return
        with self._guard():
            self._arrive(self._next_seq(), _BARRIER, 0, signature, deadline, on_idle)

    def close(self) -> None:
        """Leaves the group: the others' waits on this rank raise PeerLostError. Unmaps."""
        if self._segment is None:
            return
        self._ctl[self._mine + _CLOSED] = 1
        self._slots, self._views = [], {}
        for fd, _, _, owned in self._shared.values():
            if owned:
                os.close(fd)
        self._shared, self._mapped = {}, collections.OrderedDict()
        self._fast_call = self._fast_fold = self._fast_group = None  # it holds the address
        self._fast_prepared = None
        self._ctl.release()
        try:
            self._segment.close()
        except BufferError:
            pass  # a caller still holds a view of a slot; the mapping goes when it does
        self._segment = None

    # --- the steps of a piece (separate methods so that a profiler can time each) --------

    # ``copy(dst, src)``: the streaming copy where this piece streams (``segment_stores.py``)

    def _copy_in(self, piece: np.ndarray, slot: np.ndarray, lo: int, hi: int,
                 copy: "Callable[[np.ndarray, np.ndarray], None] | None" = None) -> None:
        if copy is None:
            slot[:lo] = piece[:lo]
            slot[hi:piece.size] = piece[hi:]
        else:
            copy(slot[:lo], piece[:lo])
            copy(slot[hi:piece.size], piece[hi:])

    def _reduce(self, piece: np.ndarray, slots: list[np.ndarray], lo: int, hi: int,
                reducer: Reducer, finish: Callable[[np.ndarray], None] | None,
                copy: "Callable[[np.ndarray, np.ndarray], None] | None" = None) -> None:
        own = piece[lo:hi]
        if own.size:
            for r in self._others:  # a fixed order: the bits never depend on timing
                reducer(own, slots[r][lo:hi])
            if finish is not None:
                finish(own)
        if copy is None:
            slots[self.rank][lo:hi] = own
        else:
            copy(slots[self.rank][lo:hi], own)

    def _copy_out(self, piece: np.ndarray, slots: list[np.ndarray], bounds: list[int]) -> None:
        for r in self._others:
            lo, hi = bounds[r], bounds[r + 1]
            piece[lo:hi] = slots[r][lo:hi]
