"""The request header of one-sided memory access (``regions.py``) over TCP.

Every request from a peer, and every reply from a region's owner, starts with this header::

    offset  size  field
    0       4     magic      b"GSRM"
    4       1     version    1
    5       1     op         READ, WRITE, ACCUMULATE, CALL (requests); REPLY, ERROR (replies)
    6       2     flags      0
    8       8     request    the requester's number for it; a reply carries the same number
    16      4     region     index of the region in the owner's table (0 for CALL)
    20      4     reserved   0
    24      8     offset     first byte of the region to access
    32      8     length     READ: bytes wanted (no payload); otherwise payload bytes that follow

A READ is answered by a REPLY whose payload is the bytes; a WRITE or an ACCUMULATE carries its
bytes and is answered by an empty REPLY; a CALL carries a small JSON object (a control message
such as "my gradient is in place") and is answered by a REPLY with a JSON object. Any request
can be answered by ERROR, whose JSON payload names the error's class and message
(``error_payload`` writes it, ``error_from`` reads it back as the same class, from ``ERRORS``).

The owner validates a header before it touches a byte of the region (``check_access``): a
region that does not exist, a range outside it, or an accumulate that is not aligned to the
region's elements is answered with ERROR; a bad magic, version or op, or a control message
longer than ``MAX_CALL``, means the stream cannot be trusted and the connection is dropped.
"""

from __future__ import annotations

import json
import socket
import struct

import numpy as np

from ..errors import (AuthenticationError, CollectiveMismatchError, ConfigError, GradsyncError,
                      GradsyncTimeoutError, PeerLostError, ProtocolError)

__all__ = ["HEADER", "HEADER_SIZE", "MAGIC", "VERSION", "Op", "Request", "pack", "unpack",
           "MAX_CALL", "check_access", "RegionAccessError", "ERRORS", "error_payload",
           "error_from", "recv_exact", "recv_into"]

MAGIC = b"GSRM"
VERSION = 1
HEADER = struct.Struct("<4sBBHQIIQQ")
HEADER_SIZE = HEADER.size  # 40
MAX_CALL = 1 << 20  # control messages are small; more is a broken or hostile peer


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
    __slots__ = ("op", "request", "region", "offset", "length")

    def __init__(self, op: int, request: int, region: int, offset: int, length: int):
        self.op, self.request, self.region = op, request, region
        self.offset, self.length = offset, length

    def __repr__(self) -> str:
        return (f"{Op.NAMES.get(self.op, self.op)}(request={self.request}, region={self.region}, "
                f"offset={self.offset}, length={self.length})")


def pack(op: int, request: int, region: int, offset: int, length: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, 0, request, region, 0, offset, length)


def unpack(raw, allowed: frozenset) -> Request:
    """Parses a header and checks its fixed fields; raises ProtocolError (drop the stream)."""
    magic, version, op, _flags, request, region, _reserved, offset, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a gradsync "
                            f"region request")
    if version != VERSION:
        raise ProtocolError(f"region protocol version {version}, this gradsync speaks {VERSION}")
    if op not in allowed:
        raise ProtocolError(f"unexpected region op {op}")
    if op in (Op.CALL, Op.ERROR) and length > MAX_CALL:
        raise ProtocolError(f"control message of {length} bytes (limit {MAX_CALL})")
    return Request(op, request, region, offset, length)


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


# --- errors across the wire -----------------------------------------------------------------

class RegionAccessError(GradsyncError, ValueError):
    """The owner refused an access: no such region, or a range outside it."""


#: The classes an ERROR reply may name, by name; any other error travels as GradsyncError (or
#: ValueError for a caller's mistake).
ERRORS = {cls.__name__: cls for cls in
          (PeerLostError, CollectiveMismatchError, GradsyncTimeoutError, AuthenticationError,
           ProtocolError, ConfigError, RegionAccessError, GradsyncError)}


def error_payload(exc: BaseException) -> bytes:
    """The JSON payload of an ERROR reply that reports ``exc``."""
    kind = type(exc).__name__ if type(exc).__name__ in ERRORS else (
        "ValueError" if isinstance(exc, (ValueError, TypeError, KeyError)) else "GradsyncError")
    return json.dumps({"kind": kind, "message": str(exc),
                       "peer": getattr(exc, "peer", None)}).encode()


def error_from(record: dict, peer: int) -> GradsyncError | ValueError:
    """The exception an ERROR reply's decoded payload ``record`` reports (from ``peer``)."""
    cls = ERRORS.get(record.get("kind"))
    if cls is None:
        return ValueError(record.get("message", "")) if record.get("kind") == "ValueError" \
            else GradsyncError(record.get("message", ""))
    if cls is PeerLostError:
        return cls(record["message"], peer=record.get("peer"))
    return cls(record["message"])


# --- reading the stream ---------------------------------------------------------------------

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
    view, got, n = memoryview(dst), 0, dst.nbytes
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError(f"connection closed after {got} of {n} bytes")
        got += k
