"""Sleeping until another process changes a word of shared memory: Linux futexes, via ctypes.

A shared-memory collective waits for a counter that another local rank will raise. Spinning
on it answers in well under a microsecond but burns a core, which on a host with more ranks
(or other jobs) than cores delays the very rank being waited for; ``time.sleep`` naps give
the core back but wake late. A futex gives both: the waiter asks the kernel to sleep *while
the word still holds the value it saw*, and the writer, after changing the word, asks the
kernel to wake whoever sleeps on it.

The protocol, with W the waiter and P the publisher of a counter C:

    W: flag := "asleep on C"      P: C := new value
       futex_wait(C, seen)           fence
       flag := 0                     if flag == "asleep on C": futex_wake(C)

No wake-up is lost. The kernel compares C with ``seen`` after W has joined the futex's wait
queue, behind a full memory barrier, and sleeps only if they are still equal. If P read the
flag as 0, P's read came before W's flag store became visible; P's store to C came before
that read (the fence stops x86 from letting a load pass an earlier store), so C's new value
was visible before W's flag, hence before the kernel's comparison, and W does not sleep. If
P saw the flag, its ``futex_wake`` finds W queued or W never slept. The fence is an
acquire/release of an uncontended ``threading.Lock``: CPython takes it with an atomic
compare-and-exchange (``lock cmpxchg``), a full barrier on x86. Every sleep has a timeout
too (the caller checks deadlines and liveness between sleeps), so even a broken assumption
would cost a late wake-up, never a hang.

Where futexes cannot be reached (not Linux x86-64, no libc through ctypes) ``open`` returns
None and callers nap instead (``segment_sync.py``, the host segment's waits).
"""

from __future__ import annotations

import ctypes
import errno
import platform
import sys
import threading

__all__ = ["Futex", "fence"]

_SYS_FUTEX = {"x86_64": 202, "amd64": 202}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the waiters are other processes
_WAKE_ALL = 0x7FFFFFFF
_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (see the module's docstring)."""
    _fence_lock.acquire()
    _fence_lock.release()


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """Futex operations on the 32-bit words of one writable shared buffer (an mmap).

    Offsets are in bytes from the buffer's start and must be multiples of 4; on a
    little-endian machine the word at a 64-bit counter's offset is the counter's low half.
    """

    def __init__(self, address: int, nbytes: int, syscall, number: int):
        self._address, self._nbytes = address, nbytes
        self._syscall, self._number = syscall, number

    @classmethod
    def open(cls, buffer) -> "Futex | None":
        """Futexes on ``buffer``, or None where this platform has none."""
        number = _SYS_FUTEX.get(platform.machine().lower())
        if number is None or not sys.platform.startswith("linux"):
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            syscall = libc.syscall
            view = ctypes.c_char.from_buffer(buffer)
        except (OSError, AttributeError, TypeError, ValueError):
            return None
        address = ctypes.addressof(view)
        del view  # releases the export, so that the owner can still close the mapping
        syscall.restype = ctypes.c_long
        return cls(address, len(buffer), syscall, number)

    def wait(self, offset: int, expected: int, timeout: float) -> bool:
        """Sleeps while the word at ``offset`` equals ``expected`` (its low 32 bits), at most
        ``timeout`` seconds. Returns False only when the kernel refused (then nap instead)."""
        self._check(offset)
        ts = _Timespec(int(timeout), int((timeout % 1) * 1e9))
        r = self._syscall(self._number, ctypes.c_void_p(self._address + offset), _FUTEX_WAIT,
                          ctypes.c_uint32(expected & 0xFFFFFFFF), ctypes.byref(ts), None, 0)
        if r == 0:
            return True
        return ctypes.get_errno() in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR)

    def wake(self, offset: int) -> None:
        """Wakes every process sleeping on the word at ``offset``."""
        self._check(offset)
        self._syscall(self._number, ctypes.c_void_p(self._address + offset), _FUTEX_WAKE,
                      _WAKE_ALL, None, None, 0)

    def _check(self, offset: int) -> None:
        if offset % 4 or not 0 <= offset <= self._nbytes - 4:
            raise ValueError(f"futex offset {offset} is not a 4-byte word of the "
                             f"{self._nbytes}-byte buffer")
