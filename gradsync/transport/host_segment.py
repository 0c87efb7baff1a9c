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

Small pieces take a shorter road, with one synchronisation instead of two. When the whole
allreduce fits one piece of at most ``small_bytes``, every rank copies all of its data into
its slot, arrives, waits for every arrival, and computes the whole result itself, folding
the slots in local-rank order (rank 0's first): each rank does the same operations on the same
operands in the same order, so all end bitwise identical. The two-slot argument below holds
unchanged (every read of a slot of piece k still happens before the reader arrives at k+1).
The choice depends on the size only, so every rank takes the same road.

The one-step road is also compiled (``_shmfast.c``, installed or built by ``_native.py``):
one C call copies in, publishes, waits, checks the issued words, folds and divides an
Average, for sums, products, minima, maxima and averages of float32, float64, int32 and
int64. It is the same protocol on the same layout, so a rank on the compiled road and a rank
on the Python road meet in the same collective; its wait spins, yields and sleeps like
``_wait`` for up to ``CHECK_EVERY`` and then hands the wait back to ``_wait``, which owns
the deadline, the liveness checks and ``on_idle``. Other dtypes and ops, a postscale, no C
compiler, or ``GRADSYNC_SHM_FAST=0`` (``fast=False``) take the Python road.

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

Shared buffers. A caller that allocates its data with ``shared_buffer`` (a ``memfd`` of its
own; the other local ranks map it through ``/proc/<pid>/fd`` at the first allreduce that
needs it, so no name is ever left in /dev/shm) lets the allreduce skip the slots. Every rank
passes a shared buffer (a distinct issued kind: a rank that passes another array raises
CollectiveMismatchError) and publishes which one beside its counters. After one arrival, local
rank i folds sub-slice i of every rank's buffer into its own, in the fold order above, and
writes the result into the others' buffers; once every rank has published ``reduced``, every
buffer holds the result and the allreduce returns. Between the two synchronisations
sub-slice i of every buffer is read and written by rank i only, and no rank touches its
buffer before the first or after the second, so nothing races. For n = 2, counting reads and
writes, each byte of data costs a rank 2.5 bytes of memory traffic this way and 4.5 through
the slots: the copy-in, the publish copy and the copy-out are gone. DistributedOptimizer's
buckets are shared buffers (``gradsync/torch/buckets.py``).

Why two slots suffice. Every read of a parity-p buffer for piece k (another rank reading my
slot in step 2 or 3 of piece k) happens before that reader publishes arrived = k+1, because
it publishes arrived k+1 only after finishing piece k. I write my parity-p slot again only
for piece k+2, and only after my arrival wait of piece k+1 saw arrived >= k+1 from every
rank: so every reader has finished with piece k. Meanwhile piece k+1 uses the other slot,
which is why a fast rank may copy in piece k+1 while a slow one still copies out piece k.
The same holds when broadcasts and barriers interleave with allreduces: all of them arrive
once per piece and read only after their arrival wait.

Why no locks. Each counter has one writer and each rank's counters sit on their own cache
line, written after the bytes they publish; a reader loads the counter, then the bytes. On
x86-64 (TSO) stores become visible in program order, loads happen in program order, and a
store is never moved ahead of an earlier load, which is what the two arguments above need
(``transport/shm.py`` spells out the assumptions; this module refuses to run elsewhere).

Every wait climbs the transport's one ladder (``transport/wait.py``, which holds the figures
and what they were measured from): it spins while the ranks it waits for can be close (each
has a core of its own: up to ``MAX_SPIN`` in the compiled wait, which releases the GIL, and
``PY_SPIN`` in the Python one, which holds it; ``MIN_SPIN`` otherwise), then yields the core
between looks (until ``YIELD_FOR`` from the wait's start in the compiled wait, and
``PY_YIELD_FOR`` in the Python one), then sleeps on the counter with a futex
(``transport/futex.py``: no lost wake-ups; the rank that publishes a counter wakes a rank that
announced it sleeps on it), or naps where futexes are missing.
Between sleeps (at most 50 ms each) it checks the deadline, calls ``on_idle``, and checks
that the ranks it waits for are alive (pid and start time registered in their counter line)
and have not left the group.
A group on which a collective failed is not used again: the failing rank marks itself gone,
so the others raise at once instead of waiting for their deadline.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import itertools
import mmap
import os
import time
from typing import Callable, Sequence

import numpy as np

from .. import _native
from ..errors import CollectiveMismatchError, GradsyncError, GradsyncTimeoutError, PeerLostError
from .futex import Futex, fence
from .shm import (CACHE_LINE, attach_segment, check_job_id, create_segment, process_start_time,
                  require_tso, unlink_segment)
from .wait import (CHECK_EVERY, MAX_NAP, MIN_SPIN, PY_SPIN, PY_YIELD_FOR, Nap, may_spin,
                   native_ladder)

__all__ = ["ShmGroup", "segment_bytes", "DEFAULT_SLOT_BYTES", "DEFAULT_SMALL_BYTES", "group_segment_name",
           "create_group_segment"]

Reducer = Callable[[np.ndarray, np.ndarray], None]
"""``reducer(dst, src)`` folds ``src`` into ``dst`` in place (``collectives/ops.py``'s)."""

DEFAULT_SLOT_BYTES = 1 << 20
DEFAULT_SMALL_BYTES = 32 << 10

_MAGIC = 0x31505247_4E595347  # "GSYNGRP1" read as little-endian bytes
_WORDS = CACHE_LINE // 8
# Line 0 holds the layout: magic, local size, slot bytes. Then two lines per local rank r,
# written only by r: its counters, and what it issued (kind, bytes, signature) at its latest
# two pieces, by parity. The issued words need two copies because a broadcast or a barrier
# synchronises once per piece: a rank past its arrival wait at piece k may already write
# piece k+1's words while a slower rank still compares piece k's. It cannot reach k+2, whose
# arrival needs the slower rank's arrival at k+1.
_ARRIVED, _REDUCED, _PID, _STARTED, _CLOSED, _SLEEPING, _SHARED_FD, _SHARED_SERIAL = range(8)
# _SLEEPING holds 0, or 1 + (local rank << 4 | counter word) of the counter its owner sleeps on.
# _SHARED_FD and _SHARED_SERIAL: the descriptor and serial number of the shared buffer that the
# line's owner passed at its latest allreduce on shared buffers.
_ISSUED = _WORDS  # + 3 * parity: kind (| root << 8), total bytes, signature
_ALLREDUCE, _BROADCAST, _BARRIER, _ALLREDUCE_SHARED = 1, 2, 3, 4
_KIND_NAMES = {_ALLREDUCE: "allreduce", _BROADCAST: "broadcast", _BARRIER: "barrier",
               _ALLREDUCE_SHARED: "allreduce"}
_MASK64 = (1 << 64) - 1
_PAGE = 4096
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
_FAST_DONE, _FAST_WAITING, _FAST_MISMATCH = 0, 1, 2
# Shared buffers: serial numbers, unique in this process, and how many of each other rank's
# buffers stay mapped (a DistributedOptimizer shares at most 16: torch/buckets.py,
# SHARED_MAX; a dropped mapping is made again when needed).
_serials = itertools.count(1)
_MAPPED_KEPT = 32


def segment_bytes(local_size: int, slot_bytes: int) -> int:
    """Bytes of /dev/shm the host's allreduce segment takes for ``local_size`` ranks with
    slots of ``slot_bytes`` (rounded up to whole cache lines, as ``create_group_segment``
    does)."""
    slot_bytes = -(-slot_bytes // CACHE_LINE) * CACHE_LINE
    return _control_bytes(local_size) + 2 * local_size * slot_bytes


def _control_bytes(local_size: int) -> int:
    return -(-(1 + 2 * local_size) * CACHE_LINE // _PAGE) * _PAGE


def group_segment_name(job: str, tag: str = "host") -> str:
    """Name of the host's segment; ``tag`` tells apart several groups of one job."""
    return f"gradsync-{check_job_id(job)}-{check_job_id(tag)}"


def create_group_segment(name: str, local_size: int, slot_bytes: int) -> mmap.mmap:
    """Creates and lays out the segment (called by local rank 0 only).

    ``slot_bytes`` is rounded up to a multiple of 64 bytes.
    """
    if local_size < 1:
        raise ValueError(f"local_size must be at least 1, got {local_size}")
    if slot_bytes < 1:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
    slot_bytes = -(-slot_bytes // CACHE_LINE) * CACHE_LINE
    seg = create_segment(name, _control_bytes(local_size) + 2 * local_size * slot_bytes)
    header = memoryview(seg)[:CACHE_LINE].cast("Q")
    header[1], header[2] = local_size, slot_bytes
    header[0] = _MAGIC  # last: an attacher that sees the magic sees the layout
    header.release()
    return seg


class ShmGroup:
    """The local ranks of one host, joined by one shared segment (set up once, reused).

    Collectives on one group must be issued by one thread at a time, in the same order on
    every local rank (the sequence numbers pair them up).

    Args:
        segment: the mapped segment (``create_group_segment`` or ``attach_segment``).
        local_rank: this process's index among the host's ranks.
        ranks: the global rank of each local rank, for error messages (default: local ranks).
        small_bytes, sleep, fast: as for ``open``.

    Attributes:
        fast: whether small allreduces can take the compiled road (``_shmfast.c``).
    """

    def __init__(self, segment: mmap.mmap, local_rank: int, ranks: "Sequence[int] | None" = None,
                 small_bytes: int = DEFAULT_SMALL_BYTES, sleep: str = "auto",
                 fast: bool = True):
        require_tso()
        if sleep not in ("auto", "futex", "nap"):
            raise ValueError(f"sleep must be 'auto', 'futex' or 'nap', got {sleep!r}")
        header = memoryview(segment)[:CACHE_LINE].cast("Q")
        magic, size, slot_bytes = header[0], header[1], header[2]
        header.release()
        if magic != _MAGIC or len(segment) != _control_bytes(size) + 2 * size * slot_bytes:
            raise ValueError("not a gradsync shared-memory group segment (bad magic or size)")
        if not 0 <= local_rank < size:
            raise ValueError(f"local_rank {local_rank} outside the group's {size} ranks")
        self.rank, self.size, self.slot_bytes = local_rank, size, slot_bytes
        self.ranks = list(ranks) if ranks is not None else list(range(size))
        if len(self.ranks) != size:
            raise ValueError(f"ranks has {len(self.ranks)} entries for {size} local ranks")
        self._segment: mmap.mmap | None = segment  # None once closed
        self._ctl = memoryview(segment)[:_control_bytes(size)].cast("Q")
        self._mine = self._line(local_rank)
        self._lines = [self._line(r) for r in range(size)]
        self._others = [r for r in range(size) if r != local_rank]
        self.small_bytes = min(small_bytes, slot_bytes)
        self._futex = Futex.open(segment) if sleep != "nap" else None
        if sleep == "futex" and self._futex is None:
            raise ValueError("futexes are not available here (Linux x86-64 with ctypes)")
        # Spinning pays only when every local rank can have a core of its own.
        self._may_spin = may_spin(size)
        base = _control_bytes(size)
        self._slots = [[np.frombuffer(segment, np.uint8, slot_bytes,
                                      base + (2 * r + parity) * slot_bytes)
                        for parity in (0, 1)] for r in range(size)]
        self._views: dict[np.dtype, list[list[np.ndarray]]] = {}
        self._seq = 0
        self.moved = 0
        """Bytes this rank put into and took out of the segment, counted by the payload of
        each collective (an allreduce's twice: in, then out); read by ``traffic.py``."""
        self._failed: "BaseException | None" = None
        self._ctl[self._mine + _STARTED] = max(process_start_time(os.getpid()) or 0, 0)
        self._ctl[self._mine + _PID] = os.getpid()
        # Load only: this runs inside init()'s connect window, so a first-use compile happens
        # earlier (World.connect builds before its deadline starts; _native.py says why).
        module = _native.load("_shmfast", build=False) if fast else None
        # The compiled road's entry points and its group, all None where it is not built.
        self._fast_call: Callable[..., int] | None = None
        self._fast_fold: Callable[..., int] | None = None
        self._fast_group: object | None = None
        if module is not None:
            # The compiled wait climbs the same ladder (``wait.py``), handed over here once.
            self._fast_group = module.open(segment, local_rank, size, slot_bytes, base,
                                           self._futex is not None,
                                           *native_ladder(self._may_spin))
            self._fast_call, self._fast_fold = module.call, module.fold
        self.fast = self._fast_group is not None
        # This rank's shared buffers (``shared_buffer``) by the address of their first byte:
        # (descriptor, serial, bytes); and the other ranks' buffers mapped here, by (local
        # rank, pid, serial), least recently used first: (their descriptor, the mapping).
        self._shared: dict[int, tuple[int, int, int]] = {}
        self._mapped: "collections.OrderedDict[tuple[int, int, int], tuple[int, np.ndarray]]" \
            = collections.OrderedDict()

    @classmethod
    def open(cls, job: str, local_rank: int, local_size: int, barrier: Callable[[], None],
             slot_bytes: int = DEFAULT_SLOT_BYTES, ranks: "Sequence[int] | None" = None,
             tag: str = "host", small_bytes: int = DEFAULT_SMALL_BYTES,
             sleep: str = "auto", fast: bool = True) -> "ShmGroup":
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
        """
        name = group_segment_name(job, tag)
        seg = create_group_segment(name, local_size, slot_bytes) if local_rank == 0 else None
        try:
            barrier()  # the segment exists before anyone attaches
            group = cls(seg if seg is not None else attach_segment(name), local_rank, ranks,
                        small_bytes, sleep, fast)
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
        if shared is not None:
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
            views = self._views_of(flat.dtype)
            step = self.slot_bytes // flat.itemsize
            align = max(1, CACHE_LINE // flat.itemsize)
            # An empty array still takes one (empty) piece, so that its signature is checked.
            for start in range(0, max(flat.size, 1), step):
                piece = flat[start:start + step]
                seq = self._next_seq()
                slots = [v[seq & 1] for v in views]
                bounds = self._split(piece.size, align)
                lo, hi = bounds[self.rank], bounds[self.rank + 1]
                self._copy_in(piece, slots[self.rank], lo, hi)
                self._arrive(seq, _ALLREDUCE, flat.nbytes, signature, deadline, on_idle)
                self._reduce(piece, slots, lo, hi, reducer, finish)
                self._publish(_REDUCED, seq)
                self._wait(_REDUCED, seq, deadline, on_idle, "finish reducing")
                self._copy_out(piece, slots, bounds)

    def shared_buffer(self, nbytes: int) -> "np.ndarray | None":
        """Allocates ``nbytes`` of zeros that the other local ranks can map, for allreduces
        without the slots' copies (see the module's docstring).

        Not a collective. An allreduce takes the shared road when the array passed starts at
        the first byte of a shared buffer and fits it; then every local rank must pass such
        an array (CollectiveMismatchError otherwise). Any other collective treats it as any
        array. Call ``release`` with its address when it is no longer used.

        Returns:
            A writable uint8 array, or None when the group has one rank or this system has
            no ``memfd_create`` or no ``/proc`` to map it through.
        """
        if nbytes < 1:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        if self.size == 1 or not hasattr(os, "memfd_create") or self._segment is None:
            return None
        serial = next(_serials)
        fd = os.memfd_create(_memfd_name(serial), os.MFD_CLOEXEC)
        try:
            if not os.path.exists(f"/proc/{os.getpid()}/fd/{fd}"):  # no /proc: none can map it
                os.close(fd)
                return None
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        mine = np.frombuffer(mapping, np.uint8, nbytes)
        self._shared[mine.ctypes.data] = (fd, serial, nbytes)
        return mine

    def is_shared(self, data: np.ndarray) -> bool:
        """Whether an allreduce of ``data`` takes the shared road (see ``shared_buffer``)."""
        return self._shared_of(data) is not None

    def _shared_of(self, data: np.ndarray) -> "tuple[int, int, int] | None":
        """The shared buffer ``data`` starts and fits in, or None (without looking up the
        address, which costs a microsecond, while this rank has none)."""
        if not self._shared or not data.size:
            return None
        shared = self._shared.get(data.ctypes.data)
        return shared if shared is not None and data.nbytes <= shared[2] else None

    def release(self, address: int) -> None:
        """Forgets the shared buffer whose first byte is at ``address`` (no-op for any other
        address): its memory goes once no array of it is left here and the other ranks have
        dropped their mappings, which they do when they next map a buffer of this rank's."""
        shared = self._shared.pop(address, None)
        if shared is not None:
            os.close(shared[0])

    def fast_code(self, op: enum.Enum, dtype: np.dtype) -> "int | None":
        """The compiled road's kernel code for ``op`` on ``dtype``, or None when an allreduce
        of them takes the Python road (or the compiled one is not built)."""
        return _FAST_CODES.get((op._value_, dtype)) if self._fast_call else None

    def allreduce_express(self, flat: np.ndarray, code: int, divisor: int, deadline: float,
                          on_idle: Callable[[float], None], signature: int) -> None:
        """``allreduce`` on the compiled road, for a caller that has checked what it checks
        (a prepared allreduce, ``pipeline/operations.Prepared``): ``flat`` a writable C-contiguous 1-d array of 1 to ``small_bytes``
        bytes, ``code`` from ``fast_code``, ``divisor`` as for ``allreduce`` (no ``trunc``)."""
        if self._failed is not None or self._segment is None:
            self._flat(flat, writable=True)  # raises what allreduce raises
        self.moved += 2 * flat.nbytes
        seq = self._seq = self._seq + 1
        try:
            # The common case is this one C call and no other Python frame: every rank
            # arrived within the C wait's budget and issued the same.
            call = self._fast_call
            assert call is not None  # ``code`` came from fast_code: the road is built
            status = call(self._fast_group, flat, seq, signature, code, divisor, False)
            if status != _FAST_DONE:
                self._fast_rest(status, flat, seq, signature & _MASK64, code, divisor, False,
                                deadline, on_idle)
        except BaseException as exc:  # what _guard does
            self._fail(exc)
            raise

    def _allreduce_small(self, flat: np.ndarray, reducer: Reducer, deadline: float,
                         on_idle: Callable[[float], None], signature: int) -> None:
        """The one-step road (see the module's docstring): one piece, one synchronisation."""
        seq = self._seq = self._seq + 1
        n, parity = flat.size, seq & 1
        views = self._views.get(flat.dtype) or self._views_of(flat.dtype)
        views[self.rank][parity][:n] = flat
        self._arrive(seq, _ALLREDUCE, flat.nbytes, signature, deadline, on_idle)
        if n:
            if self.rank:
                flat[...] = views[0][parity][:n]
            for r in range(1, self.size):  # a fixed order: the bits never depend on timing
                reducer(flat, views[r][parity][:n])

    def _allreduce_fast(self, flat: np.ndarray, code: int, divisor: int, trunc: bool,
                        deadline: float, on_idle: Callable[[float], None],
                        signature: int) -> None:
        """The one-step road in one C call (``_shmfast.c``); waits past its budget and
        mismatches come back here to be handled as on the Python road."""
        seq = self._seq = self._seq + 1
        signature &= _MASK64
        call = self._fast_call
        assert call is not None  # there is a ``code`` only where the road is built
        status = call(self._fast_group, flat, seq, signature, code, divisor, trunc)
        if status != _FAST_DONE:
            self._fast_rest(status, flat, seq, signature, code, divisor, trunc, deadline,
                            on_idle)

    def _fast_rest(self, status: int, flat: np.ndarray, seq: int, signature: int, code: int,
                   divisor: int, trunc: bool, deadline: float,
                   on_idle: Callable[[float], None]) -> None:
        """What follows a C call that did not finish: the wait, then the fold; or the report."""
        if status == _FAST_WAITING:
            # The C wait spun, yielded and slept for CHECK_EVERY: check now, then go on.
            self._wait(_ARRIVED, seq, deadline, on_idle, "arrive",
                       started=time.perf_counter() - CHECK_EVERY)
            fold = self._fast_fold
            assert fold is not None  # built with ``_fast_call``, which made ``status``
            status = fold(self._fast_group, flat, seq, signature, code, divisor, trunc)
        if status == _FAST_MISMATCH:
            self._check_issued(seq, _ALLREDUCE, flat.nbytes, signature)

    def _allreduce_shared(self, flat: np.ndarray, shared: tuple[int, int, int],
                          reducer: Reducer, finish: Callable[[np.ndarray], None] | None,
                          deadline: float, on_idle: Callable[[float], None],
                          signature: int) -> None:
        """The allreduce on shared buffers (see the module's docstring): two synchronisations,
        whatever the size; no slot is used."""
        seq = self._next_seq()
        c = self._ctl
        c[self._mine + _SHARED_FD], c[self._mine + _SHARED_SERIAL] = shared[0], shared[1]
        self._arrive(seq, _ALLREDUCE_SHARED, flat.nbytes, signature, deadline, on_idle)
        views = [flat if r == self.rank else self._peer_buffer(r, flat.nbytes).view(flat.dtype)
                 for r in range(self.size)]
        bounds = self._split(flat.size, max(1, CACHE_LINE // flat.itemsize))
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        step = self.slot_bytes // flat.itemsize  # a piece stays in cache while it is copied
        for start in range(lo, hi, step):
            stop = min(start + step, hi)
            own = flat[start:stop]
            for r in self._others:  # a fixed order: the bits never depend on timing
                reducer(own, views[r][start:stop])
            if finish is not None:
                finish(own)
            for r in self._others:
                views[r][start:stop] = own
        self._publish(_REDUCED, seq)
        self._wait(_REDUCED, seq, deadline, on_idle, "finish reducing")

    def _peer_buffer(self, r: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of the shared buffer that local rank ``r`` passed to the
        allreduce now running (it published which after arriving), mapped once."""
        c, line = self._ctl, self._lines[r]
        pid, fd, serial = c[line + _PID], c[line + _SHARED_FD], c[line + _SHARED_SERIAL]
        key = (r, pid, serial)
        entry = self._mapped.get(key)
        if entry is None:
            # A new buffer of r's: first drop the mappings of those r has released (their
            # memory lives as long as a mapping does), then keep at most _MAPPED_KEPT a rank.
            for old in [k for k in self._mapped if k[0] == r]:
                if not _published(old[1], self._mapped[old][0], old[2]):
                    del self._mapped[old]
            entry = (fd, _map_peer_buffer(pid, fd, serial, self.ranks[r]))
            self._mapped[key] = entry
            if len(self._mapped) > _MAPPED_KEPT * (self.size - 1):
                self._mapped.popitem(last=False)
        else:
            self._mapped.move_to_end(key)
        view = entry[1]
        if view.nbytes < nbytes:
            raise CollectiveMismatchError(
                f"rank {self.ranks[r]}'s shared buffer has {view.nbytes} bytes, fewer than the "
                f"{nbytes} of the allreduce")
        return view[:nbytes]

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
        """Returns once every local rank has entered the barrier."""
        if self.size == 1:
            return
        with self._guard():
            self._arrive(self._next_seq(), _BARRIER, 0, signature, deadline, on_idle)

    def close(self) -> None:
        """Leaves the group: the others' waits on this rank raise PeerLostError. Unmaps."""
        if self._segment is None:
            return
        self._ctl[self._mine + _CLOSED] = 1
        self._slots, self._views = [], {}
        for fd, _, _ in self._shared.values():
            os.close(fd)
        self._shared, self._mapped = {}, collections.OrderedDict()
        self._fast_call = self._fast_fold = self._fast_group = None  # it holds the address
        self._ctl.release()
        try:
            self._segment.close()
        except BufferError:
            pass  # a caller still holds a view of a slot; the mapping goes when it does
        self._segment = None

    # --- the steps of a piece (separate methods so that a profiler can time each) --------

    def _copy_in(self, piece: np.ndarray, slot: np.ndarray, lo: int, hi: int) -> None:
        slot[:lo] = piece[:lo]
        slot[hi:piece.size] = piece[hi:]

    def _reduce(self, piece: np.ndarray, slots: list[np.ndarray], lo: int, hi: int,
                reducer: Reducer, finish: Callable[[np.ndarray], None] | None) -> None:
        own = piece[lo:hi]
        if own.size:
            for r in self._others:  # a fixed order: the bits never depend on timing
                reducer(own, slots[r][lo:hi])
            if finish is not None:
                finish(own)
        slots[self.rank][lo:hi] = own

    def _copy_out(self, piece: np.ndarray, slots: list[np.ndarray], bounds: list[int]) -> None:
        for r in self._others:
            lo, hi = bounds[r], bounds[r + 1]
            piece[lo:hi] = slots[r][lo:hi]

    def _arrive(self, seq: int, kind: int, nbytes: int, signature: int, deadline: float,
                on_idle: Callable[[float], None]) -> None:
        """Publishes this rank's arrival at piece ``seq``, waits for all, checks they agree."""
        c, mine = self._ctl, self._mine
        at = _ISSUED + 3 * (seq & 1)
        c[mine + at], c[mine + at + 1], c[mine + at + 2] = kind, nbytes, signature & _MASK64
        self._publish(_ARRIVED, seq)  # last: publishes the slot's bytes and the words above
        self._wait(_ARRIVED, seq, deadline, on_idle, "arrive")
        self._check_issued(seq, kind, nbytes, signature)

    def _check_issued(self, seq: int, kind: int, nbytes: int, signature: int) -> None:
        """Raises CollectiveMismatchError unless every rank issued the same at piece ``seq``."""
        c, at = self._ctl, _ISSUED + 3 * (seq & 1)
        lines, signature = self._lines, signature & _MASK64
        for r in self._others:
            i = lines[r] + at
            if c[i] != kind or c[i + 1] != nbytes or c[i + 2] != signature:
                break
        else:
            return
        issued = [tuple(c[lines[r] + at:lines[r] + at + 3]) for r in range(self.size)]
        raise CollectiveMismatchError(
            f"local ranks issued different collectives at shared-memory piece #{seq}: " +
            "; ".join(f"local rank {r} (rank {self.ranks[r]}) {_describe(*issued[r])}"
                      for r in range(self.size)))

    def _publish(self, word: int, seq: int) -> None:
        """Raises this rank's counter ``word`` to ``seq``, waking a rank asleep on it."""
        c = self._ctl
        c[self._mine + word] = seq
        if self._futex is None:
            return
        fence()  # the store above is visible before the flags below are read
        asleep_on_me = 1 + (self.rank << 4 | word)
        lines = self._lines
        for r in self._others:
            if c[lines[r] + _SLEEPING] == asleep_on_me:
                self._futex.wake((self._mine + word) * 8)
                return

    def _wait(self, word: int, seq: int, deadline: float, on_idle: Callable[[float], None],
              phase: str, started: "float | None" = None) -> None:
        """Waits until counter ``word`` of every other local rank reaches ``seq``.

        Spins up to ``PY_SPIN`` when every local rank can have a core (only ``MIN_SPIN``
        when they outnumber the cores: spinning would delay the rank it waits for), yields
        the core between looks until ``PY_YIELD_FOR`` after the start, then sleeps on the
        counter of a rank still awaited until it moves. Closeness is judged by the cores,
        not by recent waits: a wait that slept is long because it slept, which would keep
        the next waits from spinning. ``started``
        (``time.perf_counter()``): when the wait began, if earlier than now (the compiled
        road's wait continues here).
        """
        c, lines = self._ctl, self._lines
        waiting = [r for r in self._others if c[lines[r] + word] < seq]
        if not waiting:
            return
        clock = time.perf_counter
        started = clock() if started is None else started
        spin_until = started + (PY_SPIN if self._may_spin else MIN_SPIN)
        while clock() < spin_until:
            waiting = [r for r in waiting if c[lines[r] + word] < seq]
            if not waiting:
                return
        yield_until = started + PY_YIELD_FOR
        while clock() < yield_until:
            os.sched_yield()
            waiting = [r for r in waiting if c[lines[r] + word] < seq]
            if not waiting:
                return
        nap = Nap()
        next_check = started + CHECK_EVERY
        while True:
            waiting = [r for r in waiting if c[lines[r] + word] < seq]
            if not waiting:
                return
            now = clock()
            if now >= next_check:
                self._check_alive(waiting)
                mono = time.monotonic()
                if mono >= deadline:
                    raise GradsyncTimeoutError(
                        f"local rank {self.rank} (rank {self.ranks[self.rank]}) timed out after "
                        f"{now - started:.1f}s at shared-memory piece #{seq} waiting for local "
                        f"rank(s) {waiting} (rank(s) {[self.ranks[r] for r in waiting]}) to "
                        f"{phase}; they are alive: are they in another collective?")
                on_idle(now - started)
                next_check = now + CHECK_EVERY
            if self._futex is not None:
                self._sleep_on(self._futex, waiting[0], word, seq, max(next_check - now, 1e-4))
            else:
                nap()

    def _sleep_on(self, futex: Futex, r: int, word: int, seq: int, timeout: float) -> None:
        """Sleeps until local rank ``r`` raises counter ``word`` (to ``seq`` or not), at most
        ``timeout`` seconds, announcing it in this rank's ``_SLEEPING`` word."""
        c, mine, at = self._ctl, self._mine, self._lines[r] + word
        c[mine + _SLEEPING] = 1 + (r << 4 | word)
        try:
            seen = c[at]
            if seen < seq and not futex.wait(at * 8, seen, timeout):
                time.sleep(min(timeout, MAX_NAP))  # the kernel refused: nap instead
        finally:
            c[mine + _SLEEPING] = 0

    def _check_alive(self, local_ranks: list[int]) -> None:
        c = self._ctl
        for r in local_ranks:
            line = self._line(r)
            why = None
            if c[line + _CLOSED]:
                why = "left the group (it closed it or failed a collective)"
            elif c[line + _PID]:
                started = process_start_time(c[line + _PID])
                if started is None or started not in (c[line + _STARTED], -1):
                    why = f"(pid {c[line + _PID]}) exited or was killed"
            if why:
                raise PeerLostError(f"local rank {self.rank} (rank {self.ranks[self.rank]}): "
                                    f"local rank {r} (rank {self.ranks[r]}) {why}",
                                    peer=self.ranks[r])

    # --- helpers -----------------------------------------------------------------------------

    def _line(self, local_rank: int) -> int:
        return (1 + 2 * local_rank) * _WORDS

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _split(self, count: int, align: int) -> list[int]:
        """Boundaries of the n sub-slices of ``count`` elements, on multiples of ``align``."""
        units = -(-count // align)
        return [min(count, (j * units // self.size) * align) for j in range(self.size + 1)]

    def _views_of(self, dtype: np.dtype) -> list[list[np.ndarray]]:
        views = self._views.get(dtype)
        if views is None:
            usable = self.slot_bytes - self.slot_bytes % dtype.itemsize
            views = [[s[:usable].view(dtype) for s in pair] for pair in self._slots]
            self._views[dtype] = views
        return views

    def _flat(self, data: np.ndarray, writable: bool) -> np.ndarray:
        if self._failed is not None:
            raise GradsyncError(f"this shared-memory group is unusable after an earlier "
                                f"failure: {self._failed}")
        if self._segment is None:
            raise ValueError("the shared-memory group is closed")
        if not isinstance(data, np.ndarray) or not data.flags.c_contiguous:
            raise TypeError("shared-memory collectives take C-contiguous NumPy arrays")
        if writable and not data.flags.writeable:
            raise ValueError("the array is read-only but the collective writes into it")
        if data.itemsize > self.slot_bytes:
            raise ValueError(f"{data.dtype} elements do not fit a {self.slot_bytes}-byte slot")
        return data.reshape(-1)

    @contextlib.contextmanager
    def _guard(self):
        """Marks the group failed, and this rank gone, when a collective raises midway.

        The counters of a half-done collective cannot be reconciled, so the others must not
        wait for this rank until their deadline: seeing it gone they raise PeerLostError now.
        """
        try:
            yield
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        self._failed = exc
        self._ctl[self._mine + _CLOSED] = 1


def _memfd_name(serial: int) -> str:
    """The name of shared buffer #``serial``: serials are never reused, so the name tells a
    buffer from another that got its descriptor number after it was closed."""
    return f"gradsync-shared{serial}"


def _names(target: str, serial: int) -> bool:
    """Whether ``target``, a descriptor's link in /proc, is shared buffer #``serial``."""
    return target.split(" ")[0] == "/memfd:" + _memfd_name(serial)


def _published(pid: int, fd: int, serial: int) -> bool:
    """Whether process ``pid`` still holds shared buffer #``serial`` as descriptor ``fd``."""
    try:
        return _names(os.readlink(f"/proc/{pid}/fd/{fd}"), serial)
    except OSError:
        return False


def _map_peer_buffer(pid: int, fd: int, serial: int, rank: int) -> np.ndarray:
    """Maps all of another process's shared buffer, descriptor ``fd`` of ``pid``."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        target = os.readlink(path)
        peer = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise GradsyncError(f"cannot map rank {rank}'s shared buffer {path}: {exc} (shared "
                            "buffers need /proc, and the local ranks run as one user)") from exc
    try:
        if not _names(target, serial):
            raise GradsyncError(f"rank {rank}'s descriptor {fd} is {target!r}, not its shared "
                                f"buffer #{serial}")
        mapping = mmap.mmap(peer, os.fstat(peer).st_size)
    finally:
        os.close(peer)
    return np.frombuffer(mapping, np.uint8)


def _describe(kind: int, nbytes: int, signature: int) -> str:
    what = _KIND_NAMES.get(kind & 0xFF, f"kind {kind & 0xFF}")
    if kind & 0xFF == _BROADCAST:
        what += f" from local rank {kind >> 8}"
    elif kind & 0xFF == _ALLREDUCE_SHARED:
        what += " on shared buffers"
    return f"{what} of {nbytes} bytes (signature {signature:#x})"
