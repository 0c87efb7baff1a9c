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

A buffer is known by its descriptor and a serial number that this process never reuses (the
memfd's name carries it), so a rank that maps a peer's buffer checks that the descriptor is
still the buffer published, not another file that took its number. Each rank keeps the
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
from .segment_layout import _ALLREDUCE_SHARED, _PID, _REDUCED, _SHARED_FD, _SHARED_SERIAL
from .segment_sync import Reducer, SegmentRank
from .shm import CACHE_LINE

__all__ = ["SharedRoad"]

# Shared buffers: serial numbers, unique in this process, and how many of each other rank's
# buffers stay mapped (a DistributedOptimizer shares at most 16: torch/buckets.py,
# SHARED_MAX; a dropped mapping is made again when needed).
_serials = itertools.count(1)
_MAPPED_KEPT = 32


class SharedRoad(SegmentRank):
    """The shared road of ``ShmGroup`` (a base of it): this rank's shared buffers, the other
    ranks' mapped here, and the allreduce on them."""

    # This rank's shared buffers (``shared_buffer``) by the address of their first byte:
    # (descriptor, serial, bytes); and the other ranks' buffers mapped here, by (local
    # rank, pid, serial), least recently used first: (their descriptor, the mapping).
    # ``ShmGroup.__init__`` makes both empty.
    _shared: dict[int, tuple[int, int, int]]
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
