"""Sending a buffer into a socket by reference: vmsplice(2) into a pipe, splice(2) to the socket.

A plain ``send`` copies the payload into the socket's buffers, and the receiver's ``recv_into``
copies it out again: every byte crosses memory twice on its way through loopback TCP.
``vmsplice`` instead puts references to the sender's own pages into a pipe (no copy), and
``splice`` moves those references into the socket's buffers (still no copy), so the receiver's
copy is the only one. On loopback the receiver reads straight from the sender's pages.

The price: the pages are *lent*. Until the receiver has read them, whatever the sender writes
into that memory is what the receiver gets; TCP's acknowledgements don't help, since on
loopback the kernel acknowledges data once it is queued at the receiver, before it is read
(``SIOCOUTQ`` reads 0 while the receiver has yet to copy a byte). So the receiver acknowledges
each lent frame once it holds all of it (``TcpPair``), and the sender writes into lent memory
only after those acknowledgements came back (``Comm.settle``).

Linux only: ``Splicer.available()`` is false elsewhere (or where the C library has no
``vmsplice``), and the transport then copies as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import sys

__all__ = ["Splicer", "available"]

_F_SETPIPE_SZ = 1031
_SPLICE_F_NONBLOCK = 2
_SPLICE_F_MORE = 4
# The pipe holds at most this much of a frame at a time (one vmsplice call); the kernel grants
# up to /proc/sys/fs/pipe-max-size (1 MiB by default) to an unprivileged process.
PIPE_BYTES = 1 << 20


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load_vmsplice():
    if not sys.platform.startswith("linux") or not hasattr(os, "splice"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.vmsplice
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    return fn


_vmsplice = _load_vmsplice()


def available() -> bool:
    """True where buffers can be lent to sockets (Linux with vmsplice and ``os.splice``)."""
    return _vmsplice is not None


class Splicer:
    """One pipe that carries page references from user buffers into one socket.

    ``push`` vmsplices the next piece of a buffer into the pipe, ``drain`` splices what the pipe
    holds into the socket; both are non-blocking. ``piped`` is the number of bytes in the pipe:
    they belong to the frame being sent and leave before any other byte does.
    """

    def __init__(self, sock_fd: int):
        self.sock_fd = sock_fd
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self.capacity = fcntl.fcntl(self.write_fd, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:  # pipe-max-size below PIPE_BYTES: keep the default (64 KiB)
            self.capacity = 64 << 10
        self.piped = 0
        self._iov = _Iovec()

    def push(self, address: int, nbytes: int) -> int:
        """Lends up to ``nbytes`` from ``address`` to the pipe; returns how many (0: pipe full).

        Raises:
            OSError: vmsplice failed for another reason than a full pipe.
        """
        self._iov.iov_base = address
        self._iov.iov_len = min(nbytes, self.capacity)
        n = _vmsplice(self.write_fd, ctypes.byref(self._iov), 1, _SPLICE_F_NONBLOCK)
        if n < 0:
            err = ctypes.get_errno()
            if err in (11, 4):  # EAGAIN, EINTR
                return 0
            raise OSError(err, f"vmsplice: {os.strerror(err)}")
        self.piped += n
        return n

    def drain(self, more: bool) -> int:
        """Splices what the pipe holds into the socket; returns bytes moved.

        Args:
            more: more of the frame follows (``SPLICE_F_MORE``: don't push a short packet).

        Raises:
            BlockingIOError: the socket's send buffer is full.
            OSError: the connection failed.
        """
        flags = _SPLICE_F_NONBLOCK | (_SPLICE_F_MORE if more else 0)
        n = os.splice(self.read_fd, self.sock_fd, self.piped, flags=flags)
        self.piped -= n
        return n

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:
                pass
