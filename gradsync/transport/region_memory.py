"""The memory of one-sided regions: the bytes a process can touch, and their stripe locks.

Both sides of a region use this: the owner (``regions.py``) for its own regions, and a peer
(``region_peer.py``) for its mapping of a same-host region in shared memory. A region is cut
into *stripes* (``STRIPE_BYTES``); a write or an accumulate holds one stripe's lock at a time,
a read takes each stripe's lock shared. The lock of a stripe is a ``threading.Lock`` inside a
process and, for a shared segment, an ``fcntl`` record lock on the stripe's bytes across
processes (the design, and why a read may see stripes of different moments, is in
``regions.py``). The owner's ``Fence`` says which writers its fenced regions still take.
"""

from __future__ import annotations

import errno
import fcntl
import threading
import time

import numpy as np

__all__ = ["Memory", "Stripes", "Fence", "STRIPE_BYTES", "as_bytes"]

STRIPE_BYTES = 1 << 20


def as_bytes(buf, writable: bool) -> np.ndarray:
    """A flat uint8 NumPy view of a contiguous array or CPU tensor (no copy)."""
    if hasattr(buf, "detach") and hasattr(buf, "numpy"):
        buf = buf.detach().numpy()
    arr = np.asarray(buf)
    if not arr.flags.c_contiguous:
        raise ValueError("region buffers must be contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("the destination of a read must be writable")
    return arr.reshape(-1).view(np.uint8)


class Stripes:
    """Per-stripe locks of one region, across the threads of a process and (with ``fd``,
    the region's shared segment) across processes.

    POSIX record locks belong to a process, so two threads of one process would both get
    them; the thread lock in front of each makes them exclusive between threads too.
    """

    def __init__(self, nbytes: int, fd: int | None, stripe: int = STRIPE_BYTES):
        self.nbytes, self.fd, self.stripe = nbytes, fd, stripe
        self.count = max(1, -(-nbytes // stripe))
        self._locks = [threading.Lock() for _ in range(self.count)]

    def pieces(self, lo: int, hi: int, start: int = 0):
        """``[lo, hi)`` cut at stripe boundaries, beginning with the piece in stripe ``start``
        (mod the stripes it spans) and wrapping around."""
        if hi <= lo:
            return []
        first, last = lo // self.stripe, (hi - 1) // self.stripe
        span = last - first + 1
        out = []
        for k in range(span):
            s = first + (start + k) % span
            out.append((max(lo, s * self.stripe), min(hi, (s + 1) * self.stripe)))
        return out

    def acquire(self, at: int, shared: bool = False) -> None:
        """Locks the stripe holding byte ``at``."""
        s = at // self.stripe
        self._locks[s].acquire()
        if self.fd is not None:
            try:
                _lock_range(self.fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX,
                            self.stripe, s * self.stripe)
            except BaseException:
                self._locks[s].release()
                raise

    def release(self, at: int) -> None:
        s = at // self.stripe
        if self.fd is not None:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, self.stripe, s * self.stripe)
        self._locks[s].release()


class Fence:
    """An owner's fence: the oldest epoch whose writes its fenced regions still store.

    A writer acting for epoch ``t`` (a parameter server's view number) may store into a fenced
    region only while ``t >= level``. The owner raises the level when it enters a newer epoch,
    and ``raise_to`` returns once every store admitted under the old level has finished: from
    then on no byte of an older epoch lands, not even the rest of a write that was under way.

    Stores are admitted a stripe at a time, and only by the owner's own threads, once the
    stripe's bytes are already in hand (received into scratch memory): so an admitted store is
    a memcpy or an add, never a wait on a peer, and raising the fence never waits for a slow or
    stopped writer. (A peer's own copy into a mapped segment could not be waited for that way:
    which is why fenced regions are written through their owner, ``regions.py``.)
    """

    def __init__(self, level: int = 0):
        self.level = level
        self._storing = 0
        self._cv = threading.Condition()

    def enter(self, epoch: int) -> bool:
        """Admits one store of epoch ``epoch`` (True; call ``leave`` after), or refuses it."""
        with self._cv:
            if epoch < self.level:
                return False
            self._storing += 1
            return True

    def leave(self) -> None:
        with self._cv:
            self._storing -= 1
            if not self._storing:
                self._cv.notify_all()

    def raise_to(self, level: int) -> None:
        """Refuses every store of an epoch below ``level`` from now on, and returns once the
        stores admitted before have finished. A level at or below the current one is a no-op:
        a fence never goes down."""
        with self._cv:
            if level <= self.level:
                return
            self.level = level  # first: no new store of an older epoch gets in
            while self._storing:
                self._cv.wait()


def _lock_range(fd: int, how: int, length: int, start: int) -> None:
    """``fcntl.lockf`` that waits through the kernel's false deadlock reports.

    The kernel looks for deadlocks between processes, not threads: while a thread of process A
    holds a stripe and another thread of A waits for a stripe that B holds, B asking for A's
    stripe looks like a cycle and fails with EDEADLK. Every holder of a stripe here releases it
    without waiting for another, so the cycle is never real: wait a moment and ask again.
    """
    while True:
        try:
            return fcntl.lockf(fd, how, length, start)
        except OSError as exc:
            if exc.errno != errno.EDEADLK:
                raise
        time.sleep(0.001)


class Memory:
    """Bytes of a region that this process can touch, with the region's dtype and locks.

    The owner's ``Region`` is one; so is a peer's mapping of a shared region.
    """

    def __init__(self, u8: np.ndarray, dtype: np.dtype, stripes: Stripes):
        self.u8, self.dtype, self.stripes = u8, np.dtype(dtype), stripes
        self.nbytes = u8.nbytes

    def read(self, out: np.ndarray, offset: int) -> None:
        for a, b in self.stripes.pieces(offset, offset + out.nbytes):
            self.stripes.acquire(a, shared=True)
            try:
                np.copyto(out[a - offset:b - offset], self.u8[a:b])
            finally:
                self.stripes.release(a)

    def write(self, src: np.ndarray, offset: int) -> None:
        for a, b in self.stripes.pieces(offset, offset + src.nbytes):
            self.write_piece(src[a - offset:b - offset], a)

    def write_piece(self, src: np.ndarray, at: int) -> None:
        """Copies the bytes ``src`` to ``at``, within one stripe."""
        self.stripes.acquire(at)
        try:
            np.copyto(self.u8[at:at + src.nbytes], src)
        finally:
            self.stripes.release(at)

    def accumulate(self, src: np.ndarray, offset: int, start: int = 0) -> None:
        for a, b in self.stripes.pieces(offset, offset + src.nbytes, start):
            self.add_piece(src[a - offset:b - offset], a)

    def add_piece(self, src: np.ndarray, at: int) -> None:
        """Adds the bytes ``src`` (this region's elements) at ``at``, within one stripe."""
        dst = self.u8[at:at + src.nbytes].view(self.dtype)
        self.stripes.acquire(at)
        try:
            np.add(dst, src.view(self.dtype), out=dst)
        finally:
            self.stripes.release(at)
