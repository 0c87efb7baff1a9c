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
can be answered by ERROR, whose JSON payload names the error's class and message.

The owner validates a header before it touches a byte of the region (``check_access``): a
region that does not exist, a range outside it, or an accumulate that is not aligned to the
region's elements is answered with ERROR; a bad magic, version or op, or a control message
longer than ``MAX_CALL``, means the stream cannot be trusted and the connection is dropped.
"""

from __future__ import annotations

import struct

from ..errors import ProtocolError

__all__ = ["HEADER", "HEADER_SIZE", "MAGIC", "VERSION", "Op", "Request", "pack", "unpack",
           "MAX_CALL", "check_access"]

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
