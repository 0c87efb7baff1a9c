"""The host segment's shared road: an allreduce on buffers that every local rank can map.

Shared buffers. A caller that allocates its data with ``shared_buffer`` (a ``memfd`` of its
own; the other local ranks map it through ``/proc/<pid>/fd`` at the first allreduce that
needs it, so no name is ever left in /dev/shm) lets the allreduce skip the slots. Every rank
passes a shared buffer (a distinct issued kind: a rank that passes another array raises
CollectiveMismatchError) and publishes which one beside its counters. After one arrival, local
rank i folds sub-slice i of every rank's buffer into its own, in the fold order of the piece
road (``host_segment.py``: the owner's value first, then the others by local rank), and
writes the result into the others' buffers; once every rank has published ``reduced``, every
buffer holds the result and the allreduce returns. Between the two synchronisations
sub-slice i of every buffer is read and written by rank i only, and no rank touches its
buffer before the first or after the second, so nothing races. For n = 2, counting reads and
writes, each byte of data costs a rank 2.5 bytes of memory traffic this way and 4.5 through
the slots: the copy-in, the publish copy and the copy-out are gone. DistributedOptimizer's
buckets are shared buffers (``gradsync/torch/buckets.py``).

Adopted buffers. A caller may also hand over memory that already lives in a shared file
(``adopt``): the torch backend moves a tensor that it reduces again and again (DDP's buckets)
into one with torch's own ``UntypedStorage._share_fd_cpu_`` (every view of the storage
follows it), so a DDP bucket takes this road as DistributedOptimizer's buckets do. The
descriptor stays torch's: an adopted buffer is looked at again at each use (its descriptor
must still be that file), and forgetting it closes nothing.

Who is shared is agreed, not assumed, for an allreduce of at least a slot (``slot_bytes``):
every rank publishes its buffer, or none, and arrives once (``_offer``); if every rank
published one, the fold above runs on the buffers, and otherwise the piece road runs as for
any array (``host_segment.py``), so a rank whose tensor was not moved, or could not be, meets
the others all the same. Smaller shared buffers (DistributedOptimizer's small buckets, which
every rank shares or none) arrive as ``_ALLREDUCE_SHARED`` with no second choice: a rank
that passes another array raises CollectiveMismatchError.

A buffer is known by its descriptor and its file's identity (device and inode, ``_identity``:
tmpfs numbers its files afresh), so a rank that maps a peer's buffer checks that the file it
opened through the descriptor is the buffer published, not another file that took its
number. Each rank keeps the
mappings it made, ``_MAPPED_KEPT`` per peer in all (the least recently used go first), and
drops a peer's mappings of buffers that the peer has released (``release``) when it maps a
new one of that peer's.
"""

from __future__ import annotations

import collections
import itertools
import mmap
import os
from typing import Callable

import numpy as np

from ..errors import CollectiveMismatchError, GradsyncError
from .segment_layout import (_ALLREDUCE_OFFER, _ALLREDUCE_SHARED, _PID, _REDUCED, _SHARED_FD,
                             _SHARED_ID)
from .segment_sync import Reducer, SegmentRank
from .shm import CACHE_LINE

__all__ = ["SharedRoad"]

# How many of each other rank's shared buffers stay mapped (a DistributedOptimizer shares at
# most 16: torch/buckets.py, SHARED_MAX; DDP has a few buckets; a dropped mapping is made again
# when needed).
_MAPPED_KEPT = 32
# Shared buffers made here, numbered in their memfd names (for a reader of /proc only).
_made = itertools.count(1)


class SharedRoad(SegmentRank):
    """The shared road of ``ShmGroup`` (a base of it): this rank's shared buffers, the other
    ranks' mapped here, and the allreduce on them."""

    # This rank's shared buffers (``shared_buffer``, ``adopt``) by the address of their first
    # byte: (descriptor, identity, bytes, whether this group owns the descriptor); and the
    # other ranks' buffers mapped here, by (local rank, pid, identity), least recently used
    # first: (their descriptor, the mapping). ``ShmGroup.__init__`` makes both empty.
    _shared: dict[int, tuple[int, int, int, bool]]
    _mapped: "collections.OrderedDict[tuple[int, int, int], tuple[int, np.ndarray]]"

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
        fd = os.memfd_create(f"gradsync-shared{next(_made)}", os.MFD_CLOEXEC)
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
        self._shared[mine.ctypes.data] = (fd, _identity(os.fstat(fd)), nbytes, True)
        return mine

    def adopt(self, address: int, fd: int, nbytes: int) -> bool:
        """Takes the ``nbytes`` at ``address``, the mapping of the shared file open as ``fd``
        from its first byte (torch's ``_share_fd_cpu_``), as a shared buffer of this rank's
        that the caller keeps owning (module docstring, "Adopted buffers"). Not a
        collective. Returns whether it is one now (False: one rank, no /proc, or ``fd``
        is not a file of at least ``nbytes``)."""
        if self.size == 1 or self._segment is None or nbytes < 1:
            return False
        held = self._shared.get(address)
        if held is not None and held[0] == fd and held[2] == nbytes:
            return True
        try:
            status = os.fstat(fd)
            if status.st_size < nbytes or not os.path.exists(f"/proc/{os.getpid()}/fd/{fd}"):
                return False
        except OSError:
            return False
        self.release(address)
        self._shared[address] = (fd, _identity(status), nbytes, False)
        return True

    def is_shared(self, data: np.ndarray) -> bool:
        """Whether an allreduce of ``data`` takes the shared road (see ``shared_buffer``)."""
        return self._shared_of(data) is not None

    def _shared_of(self, data: np.ndarray) -> "tuple[int, int, int, bool] | None":
        """The shared buffer ``data`` starts and fits in, or None (without looking up the
        address, which costs a microsecond, while this rank has none). An adopted buffer
        counts only for an allreduce of a slot or more, whose road the ranks agree on (a
        smaller one at its address, a gradient viewing a DDP bucket's first bytes, takes the
        slots, whatever the other ranks moved); one whose descriptor no longer holds its file
        (its owner freed it, and the address now holds other memory) is forgotten here."""
        if not self._shared or not data.size:
            return None
        address = data.ctypes.data
        shared = self._shared.get(address)
        if shared is None or data.nbytes > shared[2]:
            return None
        if shared[3]:  # made here: the descriptor is this group's own
            return shared
        if data.nbytes < self.slot_bytes:  # adopted buffers take the agreed road alone
            return None
        try:
            same = _identity(os.fstat(shared[0])) == shared[1]
        except OSError:
            same = False
        if not same:
            del self._shared[address]
            return None
        return shared

    def release(self, address: int) -> None:
        """Forgets the shared buffer whose first byte is at ``address`` (no-op for any other
        address): its memory goes once no array of it is left here and the other ranks have
        dropped their mappings, which they do when they next map a buffer of this rank's.
        An adopted buffer's descriptor stays open: it is its owner's."""
        shared = self._shared.pop(address, None)
        if shared is not None and shared[3]:
            os.close(shared[0])

    def _allreduce_shared(self, flat: np.ndarray, shared: tuple[int, int, int, bool],
                          reducer: Reducer, finish: Callable[[np.ndarray], None] | None,
                          deadline: float, on_idle: Callable[[float], None],
                          signature: int) -> None:
        """The allreduce on shared buffers below a slot's size (see the module's docstring):
        two synchronisations, whatever the size; no slot is used."""
        seq = self._next_seq()
        c = self._ctl
        c[self._mine + _SHARED_FD], c[self._mine + _SHARED_ID] = shared[0], shared[1]
        self._arrive(seq, _ALLREDUCE_SHARED, flat.nbytes, signature, deadline, on_idle)
        self._fold_shared(flat, seq, reducer, finish, deadline, on_idle)

    def _offer(self, flat: np.ndarray, shared: "tuple[int, int, int, bool] | None",
               deadline: float, on_idle: Callable[[float], None], signature: int) -> int:
        """The first step of an allreduce of at least a slot: publishes this rank's shared
        buffer (or none), arrives, and returns the sequence number of that arrival if every
        local rank published one (``_fold_shared`` follows), else 0 (the piece road
        follows). Every rank sees the same words, so every rank takes the same road."""
        seq = self._next_seq()
        c, mine = self._ctl, self._mine
        c[mine + _SHARED_FD], c[mine + _SHARED_ID] = shared[:2] if shared else (0, 0)
        self._arrive(seq, _ALLREDUCE_OFFER, flat.nbytes, signature, deadline, on_idle)
        lines = self._lines
        if shared is None or not all(c[lines[r] + _SHARED_ID] for r in self._others):
            return 0
        return seq

    def _fold_shared(self, flat: np.ndarray, seq: int, reducer: Reducer,
                     finish: Callable[[np.ndarray], None] | None, deadline: float,
                     on_idle: Callable[[float], None]) -> None:
        """The allreduce on shared buffers once every rank arrived at ``seq`` having published
        its buffer: folds this rank's sub-slice of every buffer into all of them, then waits
        until every rank did."""
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
        pid, fd, identity = c[line + _PID], c[line + _SHARED_FD], c[line + _SHARED_ID]
        key = (r, pid, identity)
        entry = self._mapped.get(key)
        if entry is None:
            # A new buffer of r's: first drop the mappings of those r has released (their
            # memory lives as long as a mapping does), then keep at most _MAPPED_KEPT a rank.
            for old in [k for k in self._mapped if k[0] == r]:
                if not _published(old[1], self._mapped[old][0], old[2]):
                    del self._mapped[old]
            entry = (fd, _map_peer_buffer(pid, fd, identity, self.ranks[r]))
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


def _identity(status: os.stat_result) -> int:
    """A file's identity in one nonzero 64-bit word: its device and its inode. Files of tmpfs
    (memfds, /dev/shm) are numbered afresh, so a descriptor number that was closed and
    reused names another identity."""
    return ((status.st_dev & 0xFFFFFF) << 40 | status.st_ino & (1 << 40) - 1) or 1


def _published(pid: int, fd: int, identity: int) -> bool:
    """Whether process ``pid`` still holds the shared buffer ``identity`` as descriptor
    ``fd``."""
    try:
        return _identity(os.stat(f"/proc/{pid}/fd/{fd}")) == identity
    except OSError:
        return False


def _map_peer_buffer(pid: int, fd: int, identity: int, rank: int) -> np.ndarray:
    """Maps all of another process's shared buffer, descriptor ``fd`` of ``pid``."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        peer = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise GradsyncError(f"cannot map rank {rank}'s shared buffer {path}: {exc} (shared "
                            "buffers need /proc, and the local ranks run as one user)") from exc
    try:
        status = os.fstat(peer)
        if _identity(status) != identity:
            raise GradsyncError(f"rank {rank}'s descriptor {fd} is another file than the "
                                "shared buffer it published")
        mapping = mmap.mmap(peer, status.st_size)
    finally:
        os.close(peer)
    return np.frombuffer(mapping, np.uint8)
