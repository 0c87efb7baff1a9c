"""The frame: a fixed header in front of every message on every transport.

    offset  size  field
    0       4     magic      b"GSYN"
    4       1     version    1
    5       1     kind       DATA (1), ACK (6); HELLO, WELCOME, PROOF, REJECT during the handshake
    6       2     flags      LENT (1) on a DATA frame whose payload the sender lent (splice.py)
    8       8     seq        the collective's sequence number on this communicator
    16      4     step       index of this message among those the pair exchanged in the collective
    20      4     reserved   0
    24      8     signature  64-bit hash of what the collective is (op, shape, dtype, name, ...)
    32      8     length     payload bytes that follow

The receiver validates every field before it trusts a byte of payload: a wrong magic, version
or kind, or a length other than the one it expects, is a protocol error; another seq or
signature means the ranks issued different collectives.

An ACK frame (no payload) goes back for each LENT frame once the receiver holds all of it, so
the sender knows when it may write into the memory it lent; ``step`` counts nothing there.
"""

from __future__ import annotations

import hashlib
import struct

from ..errors import ProtocolError

__all__ = ["HEADER", "HEADER_SIZE", "MAGIC", "VERSION", "Kind", "Header", "pack", "unpack",
           "signature_of", "MAX_CONTROL_PAYLOAD", "LENT"]

MAGIC = b"GSYN"
VERSION = 2  # 2: ACK frames and the LENT flag
HEADER = struct.Struct("<4sBBHQIIQQ")
HEADER_SIZE = HEADER.size  # 40
MAX_CONTROL_PAYLOAD = 64 << 10  # handshake and other control frames are small; more is hostile
LENT = 1  # flags: the receiver must send an ACK frame once it holds the whole payload


class Kind:
    DATA = 1
    HELLO = 2
    WELCOME = 3
    PROOF = 4
    REJECT = 5
    ACK = 6
    ALL = frozenset({DATA, HELLO, WELCOME, PROOF, REJECT, ACK})


class Header:
    __slots__ = ("kind", "seq", "step", "signature", "length", "flags")

    def __init__(self, kind: int, seq: int, step: int, signature: int, length: int,
                 flags: int = 0):
        self.kind, self.seq, self.step, self.signature, self.length = kind, seq, step, signature, length
        self.flags = flags

    def __repr__(self) -> str:
        return (f"Header(kind={self.kind}, seq={self.seq}, step={self.step}, "
                f"signature={self.signature:#x}, length={self.length})")


def pack(kind: int, seq: int, step: int, signature: int, length: int, flags: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, kind, flags, seq, step, 0, signature, length)


def unpack(raw) -> Header:
    """Parses and validates the fixed fields of a header; raises ProtocolError."""
    magic, version, kind, flags, seq, step, _reserved, signature, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a gradsync peer")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this gradsync speaks {VERSION}")
    if kind not in Kind.ALL:
        raise ProtocolError(f"unknown frame kind {kind}")
    return Header(kind, seq, step, signature, length, flags)


def signature_of(description: str) -> int:
    """64-bit signature of a collective's description; equal descriptions, equal signatures."""
    return int.from_bytes(hashlib.blake2b(description.encode(), digest_size=8).digest(), "little")
