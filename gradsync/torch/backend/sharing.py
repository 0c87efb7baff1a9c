"""DDP's buckets in shared memory: a tensor reduced again and again moves once into a file
that the host's other ranks map, so its allreduces skip the segment's copies.

The host segment reduces a shared buffer where it lies: each rank folds its share of every
rank's buffer and writes the result into all of them (``transport/segment_shared.py``). For n
= 2 that is 2.5 bytes of memory traffic per byte of data, against 4.5 through the segment's
slots (copy in, fold, publish, copy out). DistributedOptimizer allocates its buckets there; DDP
allocates its own, in private memory, and hands the same bucket tensors to every step's
allreduces. So the backend moves such a tensor's storage into shared memory with torch's own
``UntypedStorage._share_fd_cpu_`` (what ``Tensor.share_memory_`` does for the
``file_descriptor`` strategy): torch copies the bytes into a new /dev/shm file, unlinked at
once, and points the storage at it, so every view of the storage (DDP's per-parameter views,
the gradients themselves with ``gradient_as_bucket_view``) follows. The descriptor stays
torch's, freed with the storage; the segment only looks it up (``World.adopt_shared``).

Which tensors: those of allreduces issued inside a backward pass (DDP's reducer, or a comm
hook it calls: ``ProcessGroupGradsync.allreduce`` looks at autograd's graph task), contiguous,
on the CPU, of at least ``World.adopt_above`` bytes (a slot: below it the segment's one-step
and piece roads cost little), reduced in place from the first byte of their storage, the
second time the same tensor (the same Python object, which torch keeps for as long as its C++
side lives) comes back: one tensor made afresh each step is never moved, however often the
allocator gives it the same address. Only there, because a moved tensor can no longer grow:
torch 2.13 crashes (a segmentation fault) on a ``resize_`` past a shared storage's size, and
DDP never resizes its buckets, while a user's tensor reduced by ``dist.all_reduce`` might be.
``GRADSYNC_TORCH_SHARE_BUCKETS=0`` (``Config.torch_share_buckets``) moves nothing. A storage
that is shared already (a DataLoader worker's, for instance) is adopted as it is. Whether to
run on shared buffers is agreed by the ranks at each such allreduce (``ShmGroup._offer``), so
a rank whose tensor was not moved, or could not be (/dev/shm full: torch raises, and the
tensor stays where it is), meets the others on the slots.

Room. A moved tensor takes its bytes of /dev/shm, which other users of the host need too
(DataLoader workers hand their batches over in /dev/shm files, and a container's /dev/shm is
often 64 MB). A tensor moves only where at least half of /dev/shm stays free after it
(``_room_for``); otherwise it stays in private memory and meets the others on the slots.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ...connect.world import World

__all__ = ["Sharing"]

log = logging.getLogger("gradsync")

# Tensors remembered as seen once, at most (the oldest forgotten first).
_SEEN_KEPT = 64


class Sharing:
    """One process group's choice of the tensors it moves into shared memory (module
    docstring); ``offer`` is called before each in-place allreduce."""

    def __init__(self, world: "World", on: bool = True):
        self._world = world
        self.on = on
        """Whether tensors may move at all (``Config.torch_share_buckets``)."""
        self._above = world.adopt_above()
        # storage address -> (the tensor seen there, whether torch refused to move it)
        self._seen: dict[int, tuple[weakref.ref, bool]] = {}
        self._told = False  # the first move was said (INFO, once per group)

    def offer(self, t: torch.Tensor) -> None:
        """Makes ``t``'s storage a shared buffer of this rank's where that pays (module
        docstring); does nothing otherwise. ``t`` is reduced in place next."""
        above = self._above
        if above is None or t.nbytes < above or t.storage_offset() or not t.is_cpu:
            return
        storage = t.untyped_storage()
        if storage.is_shared():
            fd = _descriptor(storage)
            if fd is not None:  # (None: shared by a file name, which is not mapped here)
                self._world.adopt_shared(storage.data_ptr(), fd, storage.nbytes())
            return
        address = storage.data_ptr()
        seen = self._seen.get(address)
        if seen is None or seen[0]() is not t:
            self._seen.pop(address, None)
            self._seen[address] = (weakref.ref(t), False)
            if len(self._seen) > _SEEN_KEPT:
                del self._seen[next(iter(self._seen))]
            return
        if seen[1]:  # refused before
            return
        why = _room_for(storage.nbytes())
        if not why:
            try:
                storage._share_fd_cpu_()
            except RuntimeError as exc:  # /dev/shm full or missing: the tensor stays
                why = str(exc)
        if why:
            self._seen[address] = (seen[0], True)
            log.info("a %d-byte tensor stays in private memory (%s); its allreduces "
                     "go through the host segment's slots", t.nbytes, why)
            return
        del self._seen[address]
        fd = _descriptor(storage)
        if fd is not None:
            self._world.adopt_shared(storage.data_ptr(), fd, storage.nbytes())
        if not self._told:
            self._told = True
            log.info("a %d-byte tensor reduced in backward passes (a DDP bucket) moved "
                     "into shared memory, where the host's ranks fold it without copies; so do "
                     "the next ones (GRADSYNC_TORCH_SHARE_BUCKETS=0 keeps them where they are)",
                     t.nbytes)


def _room_for(nbytes: int, where: str = "/dev/shm") -> str:
    """Why ``nbytes`` more of ``where`` may not be taken (at least half of it must stay free),
    or "" where they may."""
    try:
        fs = os.statvfs(where)
    except OSError as exc:
        return f"{where}: {exc.strerror}"
    free, size = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    if free - nbytes < size // 2:
        return (f"{where} has {free >> 20} MiB free of {size >> 20} MiB, and at least half of "
                "it stays free for its other users")
    return ""


def _descriptor(storage: torch.UntypedStorage) -> "int | None":
    """The descriptor of the file a shared storage lives in, or None where it has none (shared
    by a file name: torch's ``file_system`` strategy). Not in torch's type stubs."""
    try:
        return storage._get_shared_fd()  # type: ignore[attr-defined]
    except RuntimeError:
        return None
