"""The host segment's bytes: where each local rank's counters, issued words and slots lie.

``host_segment.py`` teaches the protocol that runs on the segment; this module fixes the
layout that every part of it reads and writes, and that ``collectives/_shmfast.c`` (the
compiled one-step road) must match word for word:

    line 0              the header: magic, local size, slot bytes (the creator writes the
                        magic last: an attacher that sees it sees the layout)
    lines 1+2r, 2+2r    local rank r's counters, then the words of what it issued at its
                        latest two pieces; only r writes them
    from a page on      the slots: two of ``slot_bytes`` per local rank, parity 0 then 1

Each rank's lines are cache lines of its own, so each counter has one writer and no other
rank's store shares its line (``segment_sync.py`` says why that is all the ordering the
protocol needs). The segment is made once per job and host (``create_group_segment``, by
local rank 0), under a name no other job's can take (``group_segment_name``); its size
(``segment_bytes``) is what the job's /dev/shm must hold.
"""

from __future__ import annotations

import mmap

from .shm import CACHE_LINE, check_job_id, create_segment

__all__ = ["segment_bytes", "group_segment_name", "create_group_segment"]

_MAGIC = 0x31505247_4E595347  # "GSYNGRP1" read as little-endian bytes
_WORDS = CACHE_LINE // 8
# Line 0 holds the layout: magic, local size, slot bytes. Then two lines per local rank r,
# written only by r: its counters, and what it issued (kind, bytes, signature) at its latest
# two pieces, by parity. The issued words need two copies because a broadcast or a barrier
# synchronises once per piece: a rank past its arrival wait at piece k may already write
# piece k+1's words while a slower rank still compares piece k's. It cannot reach k+2, whose
# arrival needs the slower rank's arrival at k+1.
_ARRIVED, _REDUCED, _PID, _STARTED, _CLOSED, _SLEEPING, _SHARED_FD, _SHARED_ID = range(8)
# _SLEEPING holds 0, or 1 + (local rank << 4 | counter word) of the counter its owner sleeps on.
# _SHARED_FD and _SHARED_ID: the descriptor and file identity (segment_shared._identity) of the
# shared buffer that the line's owner passed at its latest allreduce on shared buffers, or
# offered at its latest allreduce of at least a slot (0 and 0: none).
_ISSUED = _WORDS  # + 3 * parity: kind (| root << 8), total bytes, signature
# _ALLREDUCE_OFFER: the first arrival of an allreduce of at least a slot, where the ranks say
# whether they pass shared buffers (segment_shared.py, ``_offer``).
_ALLREDUCE, _BROADCAST, _BARRIER, _ALLREDUCE_SHARED, _ALLREDUCE_OFFER = 1, 2, 3, 4, 5
_KIND_NAMES = {_ALLREDUCE: "allreduce", _BROADCAST: "broadcast", _BARRIER: "barrier",
               _ALLREDUCE_SHARED: "allreduce", _ALLREDUCE_OFFER: "allreduce"}
_MASK64 = (1 << 64) - 1
_PAGE = 4096


def segment_bytes(local_size: int, slot_bytes: int) -> int:
    """Bytes of /dev/shm the host's allreduce segment takes for ``local_size`` ranks with
    slots of ``slot_bytes`` (rounded up to whole cache lines, as ``create_group_segment``
    does)."""
    slot_bytes = -(-slot_bytes // CACHE_LINE) * CACHE_LINE
    return _control_bytes(local_size) + 2 * local_size * slot_bytes


def _control_bytes(local_size: int) -> int:
    return -(-(1 + 2 * local_size) * CACHE_LINE // _PAGE) * _PAGE


def group_segment_name(job: str, tag: str = "host") -> str:
    """Name of the host's segment; ``tag`` tells apart several groups of one job."""
    return f"gradsync-{check_job_id(job)}-{check_job_id(tag)}"


def create_group_segment(name: str, local_size: int, slot_bytes: int) -> mmap.mmap:
    """Creates and lays out the segment (called by local rank 0 only).

    ``slot_bytes`` is rounded up to a multiple of 64 bytes.
    """
    if local_size < 1:
        raise ValueError(f"local_size must be at least 1, got {local_size}")
    if slot_bytes < 1:
        raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
    slot_bytes = -(-slot_bytes // CACHE_LINE) * CACHE_LINE
    seg = create_segment(name, _control_bytes(local_size) + 2 * local_size * slot_bytes)
    header = memoryview(seg)[:CACHE_LINE].cast("Q")
    header[1], header[2] = local_size, slot_bytes
    header[0] = _MAGIC  # last: an attacher that sees the magic sees the layout
    header.release()
    return seg


def _describe(kind: int, nbytes: int, signature: int) -> str:
    """What a rank issued at a piece, in words (for a mismatch's message)."""
    what = _KIND_NAMES.get(kind & 0xFF, f"kind {kind & 0xFF}")
    if kind & 0xFF == _BROADCAST:
        what += f" from local rank {kind >> 8}"
    elif kind & 0xFF == _ALLREDUCE_SHARED:
        what += " on shared buffers"
    return f"{what} of {nbytes} bytes (signature {signature:#x})"
