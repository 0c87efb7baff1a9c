"""The request header of one-sided memory access (``regions.py``) over TCP.

Every request from a peer, and every reply from a region's owner, starts with this header::

    offset  size  field
    0       4     magic      b"GSRM"
    4       1     version    2
    5       1     op         READ, WRITE, ACCUMULATE, CALL (requests); REPLY, ERROR (replies)
    6       2     flags      FENCED (1) on a WRITE or ACCUMULATE that carries a fence; else 0
    8       8     request    the requester's number for it; a reply carries the same number
    16      4     region     index of the region in the owner's table (0 for CALL)
    20      4     fence      with FENCED: the writer's epoch (below); else 0
    24      8     offset     first byte of the region to access
    32      8     length     READ: bytes wanted (no payload); otherwise payload bytes that follow

A READ is answered by a REPLY whose payload is the bytes; a WRITE or an ACCUMULATE carries its
bytes and is answered by an empty REPLY; a CALL carries a small JSON object (a control message
such as "my gradient is in place") and is answered by a REPLY with a JSON object. Any request
can be answered by ERROR, whose JSON payload names the error's class and message
(``error_payload`` writes it, ``error_from`` reads it back as the same class, from ``ERRORS``).

The owner validates a header before it touches a byte of the region (``check_access``): a
region that does not exist, a range outside it, or an accumulate that is not aligned to the
region's elements is answered with ERROR; a bad magic, version, op or flags, a fence where
none belongs, or a control message longer than ``MAX_CALL``, means the stream cannot be
trusted and the connection is dropped.

**Fences** (version 2; version 1 had neither the flag nor the field, so a version-1 owner,
which would store a fenced write unchecked, refuses to talk instead). An owner may mark a
region *fenced*: it is written only by peers that act for an *epoch* (a parameter server's
view number), and the owner keeps a fence level, raised when it enters a newer epoch. A
WRITE or ACCUMULATE into a fenced region must carry the writer's epoch, and one below the
owner's level is refused with ``StaleWriteError`` before a byte of it is stored
(``check_fence`` at the header; ``region_memory.Fence`` again for every stripe, as the level
may rise while the bytes arrive). Unfenced regions take no fence, and a fenced write into
one is refused as a caller's mistake.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Literal, overload

import numpy as np

from ..errors import (AuthenticationError, CollectiveMismatchError, ConfigError, GradsyncError,
                      GradsyncTimeoutError, PeerLostError, ProtocolError)

__all__ = ["HEADER", "HEADER_SIZE", "MAGIC", "VERSION", "FENCED", "MAX_FENCE", "Op",
           "Request", "pack", "unpack", "MAX_CALL", "check_access", "check_fence",
           "check_epoch", "RegionAccessError", "StaleWriteError", "ERRORS", "error_payload",
           "error_from", "recv_exact", "recv_into", "send_parts", "Incoming"]

MAGIC = b"GSRM"
VERSION = 2
HEADER = struct.Struct("<4sBBHQIIQQ")
HEADER_SIZE = HEADER.size  # 40
MAX_CALL = 1 << 20  # control messages are small; more is a broken or hostile peer
_PARTS_PER_SEND = 64  # buffers per sendmsg, far below the kernel's IOV_MAX (1024)
_READ_AHEAD = 16 << 10  # bytes an owner's receive of a request takes at most (``Incoming``)
FENCED = 1  # flags: the request carries the writer's epoch in the fence field
MAX_FENCE = (1 << 32) - 1  # the field's width; views are numbered from 0, one per change


class Op:
    READ = 1
    WRITE = 2
    ACCUMULATE = 3
    CALL = 4
    REPLY = 5
    ERROR = 6
    REQUESTS = frozenset({READ, WRITE, ACCUMULATE, CALL})
    REPLIES = frozenset({REPLY, ERROR})
    NAMES = {READ: "read", WRITE: "write", ACCUMULATE: "accumulate", CALL: "call",
             REPLY: "reply", ERROR: "error"}


class Request:
    """A parsed header; ``fence`` is the writer's epoch, or None when it carries none."""

    __slots__ = ("op", "request", "region", "offset", "length", "fence")

    def __init__(self, op: int, request: int, region: int, offset: int, length: int,
                 fence: int | None = None):
        self.op, self.request, self.region = op, request, region
        self.offset, self.length, self.fence = offset, length, fence

    def __repr__(self) -> str:
        fence = "" if self.fence is None else f", fence={self.fence}"
        return (f"{Op.NAMES.get(self.op, self.op)}(request={self.request}, region={self.region}, "
                f"offset={self.offset}, length={self.length}{fence})")


def pack(op: int, request: int, region: int, offset: int, length: int,
         fence: int | None = None) -> bytes:
    if fence is None:
        return HEADER.pack(MAGIC, VERSION, op, 0, request, region, 0, offset, length)
    if op not in (Op.WRITE, Op.ACCUMULATE):
        raise ValueError(f"only a write or an accumulate carries a fence, not a {Op.NAMES[op]}")
    return HEADER.pack(MAGIC, VERSION, op, FENCED, request, region, check_epoch(fence), offset,
                       length)


def check_epoch(fence) -> int:
    """``fence`` as the header's field holds it; ValueError outside 0 .. MAX_FENCE."""
    if isinstance(fence, bool) or not isinstance(fence, (int, np.integer)) or \
            not 0 <= fence <= MAX_FENCE:
        raise ValueError(f"a fence is an epoch from 0 to {MAX_FENCE}, got {fence!r}")
    return int(fence)


def unpack(raw, allowed: frozenset) -> Request:
    """Parses a header and checks its fixed fields; raises ProtocolError (drop the stream)."""
    magic, version, op, flags, request, region, fence, offset, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a gradsync "
                            f"region request")
    if version != VERSION:
        raise ProtocolError(f"region protocol version {version}, this gradsync speaks {VERSION}")
    if op not in allowed:
        raise ProtocolError(f"unexpected region op {op}")
    if op in (Op.CALL, Op.ERROR) and length > MAX_CALL:
        raise ProtocolError(f"control message of {length} bytes (limit {MAX_CALL})")
    if flags & ~FENCED:
        raise ProtocolError(f"unknown region request flags {flags:#x}")
    if flags & FENCED and op not in (Op.WRITE, Op.ACCUMULATE):
        raise ProtocolError(f"a {Op.NAMES[op]} carries a fence: only writes do")
    if not flags & FENCED and fence:
        raise ProtocolError(f"fence field {fence} without the FENCED flag")
    return Request(op, request, region, offset, length, fence if flags & FENCED else None)


def check_access(req: Request, regions: list, itemsize_of) -> str | None:
    """Why the owner must refuse ``req`` (a READ, WRITE or ACCUMULATE), or None if it is fine.

    Args:
        regions: the owner's region table, indexed by ``req.region``; entries have ``name``
            and ``nbytes``.
        itemsize_of: returns a region's element size (accumulate must be element-aligned).
    """
    if req.region >= len(regions):
        return f"no region #{req.region} (the owner has {len(regions)})"
    region = regions[req.region]
    if req.offset > region.nbytes or req.length > region.nbytes - req.offset:
        return (f"{Op.NAMES[req.op]} of {req.length} bytes at offset {req.offset} is outside "
                f"region '{region.name}' of {region.nbytes} bytes")
    if req.op == Op.ACCUMULATE:
        size = itemsize_of(region)
        if req.offset % size or req.length % size:
            return (f"accumulate at offset {req.offset} of {req.length} bytes is not aligned "
                    f"to the {size}-byte elements of region '{region.name}'")
    return None


def check_fence(req: Request, region, level: int, owner: str = "the owner"
                ) -> "GradsyncError | None":
    """The error that refuses ``req`` (a WRITE or ACCUMULATE that ``check_access`` passed)
    under the owner's fence ``level``, or None if it may be stored.

    Args:
        region: the request's region; ``fenced`` says whether writes must carry an epoch.
        level: the owner's fence: the oldest epoch whose writes it still takes.
        owner: how the error names the owner.
    """
    what = f"{Op.NAMES[req.op]} into region '{region.name}'"
    if not region.fenced:
        if req.fence is not None:
            return RegionAccessError(f"{owner}: {what} carries fence {req.fence}, but the "
                                     f"region is not fenced (write it without one)")
        return None
    if req.fence is None:
        return RegionAccessError(f"{owner}: {what} carries no fence, but the region is "
                                 f"fenced: only a writer acting for an epoch may write it")
    if req.fence < level:
        return StaleWriteError.refusing(owner, what, req.fence, level)
    return None


# --- errors across the wire -----------------------------------------------------------------

class RegionAccessError(GradsyncError, ValueError):
    """The owner refused an access: no such region, or a range outside it."""


class StaleWriteError(GradsyncError):
    """The owner refused a write into a fenced region: the writer acts for an older epoch.

    Attributes:
        fence: the writer's epoch, which the write carried.
        level: the owner's fence, the oldest epoch it still takes writes from.
    """

    def __init__(self, message: str, fence: int | None = None, level: int | None = None):
        super().__init__(message)
        self.fence, self.level = fence, level

    @classmethod
    def refusing(cls, owner: str, what: str, fence: int, level: int) -> "StaleWriteError":
        return cls(f"{owner} refused a {what} of epoch {fence}: it is fenced at epoch "
                   f"{level} (the writer acts for an older epoch; nothing was stored)",
                   fence, level)


#: The classes an ERROR reply may name, by name; any other error travels as GradsyncError (or
#: ValueError for a caller's mistake).
ERRORS = {cls.__name__: cls for cls in
          (PeerLostError, CollectiveMismatchError, GradsyncTimeoutError, AuthenticationError,
           ProtocolError, ConfigError, RegionAccessError, StaleWriteError, GradsyncError)}


def error_payload(exc: BaseException) -> bytes:
    """The JSON payload of an ERROR reply that reports ``exc``."""
    kind = type(exc).__name__ if type(exc).__name__ in ERRORS else (
        "ValueError" if isinstance(exc, (ValueError, TypeError, KeyError)) else "GradsyncError")
    record = {"kind": kind, "message": str(exc), "peer": getattr(exc, "peer", None)}
    if isinstance(exc, StaleWriteError):
        record.update(fence=exc.fence, level=exc.level)
    return json.dumps(record).encode()


def error_from(record: dict, peer: int) -> GradsyncError | ValueError:
    """The exception an ERROR reply's decoded payload ``record`` reports (from ``peer``)."""
    kind = record.get("kind")
    cls = None if kind is None else ERRORS.get(kind)
    if cls is None:
        return ValueError(record.get("message", "")) if kind == "ValueError" \
            else GradsyncError(record.get("message", ""))
    if cls is PeerLostError:
        return cls(record["message"], peer=record.get("peer"))
    if cls is StaleWriteError:  # numbers from the wire: kept only if they are numbers
        return cls(record["message"], _epoch_or_none(record.get("fence")),
                   _epoch_or_none(record.get("level")))
    return cls(record["message"])


def _epoch_or_none(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and \
        0 <= value <= MAX_FENCE else None


# --- reading the stream ---------------------------------------------------------------------

# Only a caller that takes the end of the stream (``eof_ok=True``) can be given None.
@overload
def recv_exact(sock: socket.socket, n: int, eof_ok: Literal[False] = False) -> bytes: ...


@overload
def recv_exact(sock: socket.socket, n: int, eof_ok: bool) -> bytes | None: ...


def recv_exact(sock: socket.socket, n: int, eof_ok: bool = False) -> bytes | None:
    """The next ``n`` bytes of ``sock``; None at a clean end of stream before any (``eof_ok``)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if eof_ok and got == 0:
                return None
            raise ConnectionResetError(f"connection closed after {got} of {n} bytes")
        got += k
    return bytes(buf)


def recv_into(sock: socket.socket, dst: np.ndarray) -> None:
    """Fills ``dst`` (a contiguous array) from ``sock``, straight into its memory."""
    view, got, n = dst.data, 0, dst.nbytes
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError(f"connection closed after {got} of {n} bytes")
        got += k


def send_parts(sock: socket.socket, parts) -> None:
    """Sends the buffers of ``parts`` (bytes, or contiguous uint8 arrays) one after the other,
    as ``sendall`` of each would, in as few system calls as the socket takes them: one
    ``sendmsg`` for a reply and the batches attached to it (``regions.Attached``), where a
    ``sendall`` each cost a call (and, with the socket's timeout, a ``poll``) per part."""
    views = [view for view in (memoryview(part).cast("B") for part in parts) if view.nbytes]
    while views:
        sent = sock.sendmsg(views[:_PARTS_PER_SEND])
        while sent:
            if sent >= views[0].nbytes:
                sent -= views.pop(0).nbytes
            else:
                views[0], sent = views[0][sent:], 0


class Incoming:
    """An owner's reading of one peer's requests (``regions.Endpoint._serve``), with a
    receive of up to ``_READ_AHEAD`` bytes where the request's size is not known yet.

    A header and a small payload that arrived together (a control message, which the peer
    sends in one piece; a small write) then cost one receive, where a receive of the header
    and another of the payload cost two, each with the GIL given up and taken back (on a
    data server whose producer holds it, a wait for the switch interval each time). Bytes
    read beyond the current request are the next requests' (a peer pipelines them), and are
    served first. The socket keeps its timeout: a peer may idle between requests as long as
    it likes (a timeout with nothing of a request read waits on), but once a request has
    begun its bytes must keep coming.
    """

    __slots__ = ("sock", "buf", "view", "start", "end")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray(_READ_AHEAD)
        self.view = memoryview(self.buf)
        self.start = self.end = 0  # the bytes read and not yet used: buf[start:end]

    def header(self) -> bytes | None:
        """The next request's header bytes; None at a clean end of stream between requests."""
        while self.end - self.start < HEADER_SIZE:
            if self.start:  # what is left of the stream goes to the front
                left = self.end - self.start
                self.buf[:left] = self.view[self.start:self.end]
                self.start, self.end = 0, left
            try:
                k = self.sock.recv_into(self.view[self.end:])
            except socket.timeout:
                if self.end == self.start:  # idle between requests: no stall
                    continue
                raise
            if k == 0:
                if self.end == self.start:
                    return None
                raise ConnectionResetError(f"connection closed after {self.end - self.start} "
                                           f"of a header's {HEADER_SIZE} bytes")
            self.end += k
        self.start += HEADER_SIZE
        return bytes(self.view[self.start - HEADER_SIZE:self.start])

    def _take(self, n: int) -> memoryview:
        """Up to ``n`` of the bytes already read."""
        k = min(n, self.end - self.start)
        self.start += k
        return self.view[self.start - k:self.start]

    def exact(self, n: int) -> bytes:
        """The next ``n`` bytes of the stream."""
        have = bytes(self._take(n))
        return have if len(have) == n else have + recv_exact(self.sock, n - len(have))

    def into(self, dst: np.ndarray) -> None:
        """Fills ``dst`` (a contiguous uint8 array): the bytes already read, then straight
        from the socket into its memory."""
        have = self._take(dst.nbytes)
        if have.nbytes:
            dst[:have.nbytes] = np.frombuffer(have, dtype=np.uint8)
        if have.nbytes < dst.nbytes:
            recv_into(self.sock, dst[have.nbytes:])
