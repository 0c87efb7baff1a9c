"""Shared-memory set-up for the ranks of one host, called by ``World.connect``.

Every rank of a host replaces the TCP pair of each same-host peer with a ``ShmPair`` (two
byte rings) and, when the whole job is on one host, also joins the host's ``ShmGroup``, the
segment that the shared-memory allreduce, broadcast and barrier use. Same-host peers get no
TCP connection at all: a ShmPair notices a dead peer by its pid and start time, and the abort
record in the store carries every other failure.

The segments are named after the job and the store's address, so that two jobs on one host
never meet even if their launchers gave them the same job id (torchrun's default run id is
``none``), and are unlinked as soon as every rank has mapped them.

Two environments cannot hold them, and each gets one clear line rather than a failure deep in
the set-up:

- **A small /dev/shm.** The host's ranks need one ring per ordered pair (``L * (L - 1)`` rings
  of about 4 MiB for L ranks) plus, in a one-host job, the allreduce segment (``2 * L`` slots).
  Docker gives a container 64 MB: 4 ranks already need 56 MiB, 8 need 240 MiB. ``check_room``
  compares that with the size of /dev/shm, the same on every rank of the host (so they all
  stop, before any segment is made), and with the room left, before this rank's segments.
- **A platform the rings do not support.** They rely on x86's store ordering (and Linux's
  futex and /dev/shm): elsewhere ``usable`` says no once, with a warning naming the fallback,
  TCP between the host's ranks (``GRADSYNC_TRANSPORT=shm`` there is an error).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import platform
import re
import sys
import time

from ..errors import ConfigError
from ..transport import host_segment, shm
from ..transport.host_segment import ShmGroup

__all__ = ["connect", "segment_job", "check_room", "host_bytes", "usable", "platform_problem"]

log = logging.getLogger("gradsync")
_MiB = 1 << 20
_warned_platform = False  # the unsupported-platform warning is given once per process


def platform_problem() -> str | None:
    """Why the shared-memory transport cannot run here, or None when it can."""
    machine = platform.machine().lower()
    if not sys.platform.startswith("linux"):
        return f"it needs Linux (futex, /dev/shm) and this is {sys.platform}"
    if not shm.keeps_store_order(machine):
        return f"it relies on x86-64's store ordering and this CPU is {machine}"
    return None


def usable(config) -> bool:
    """Whether the host's ranks may use shared memory (``transport`` auto or shm).

    On an unsupported platform: False with ``auto``, after one warning naming the fallback;
    a ``ConfigError`` with ``shm``.
    """
    global _warned_platform
    problem = platform_problem()
    if problem is None:
        return True
    if config.transport == "shm":
        raise ConfigError(f"GRADSYNC_TRANSPORT=shm: gradsync's shared-memory transport is not "
                          f"available: {problem}; use GRADSYNC_TRANSPORT=auto or tcp")
    if not _warned_platform:
        _warned_platform = True
        log.warning("gradsync's shared-memory transport is not available (%s): ranks on one "
                    "host talk over TCP (loopback) instead, which is slower for them", problem)
    return False


def host_bytes(local_size: int, slot_bytes: int, group: bool) -> tuple[int, int]:
    """Bytes of /dev/shm a host's ``local_size`` ranks need, and local rank 0's share.

    Args:
        slot_bytes: ``Config.shm_slot_bytes``.
        group: whether the host's allreduce segment is made too (a one-host job).

    Returns:
        ``(host, rank0)``: every rank makes ``local_size - 1`` rings; rank 0 also the segment.
    """
    rings = (local_size - 1) * shm.ring_bytes()
    segment = host_segment.segment_bytes(local_size, slot_bytes) if group else 0
    return local_size * rings + segment, rings + segment


def check_room(local_size: int, own: int, host: int, directory: str = shm.SHM_DIR) -> None:
    """Raises ConfigError, in one line naming the fix, when /dev/shm cannot hold the
    segments: smaller than the host's ``host`` bytes, or with less than this rank's ``own``
    bytes left."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return  # no /dev/shm to look at: creating the segments reports it
    size, free = stat.f_blocks * stat.f_frsize, stat.f_bavail * stat.f_frsize
    fix = ("give it more room (docker run --shm-size=1g; Kubernetes: an emptyDir volume of "
           "medium Memory at /dev/shm) or use TCP between them (GRADSYNC_TRANSPORT=tcp)")
    if size < host:
        raise ConfigError(f"{directory} holds {size / _MiB:.0f} MiB but the {local_size} ranks "
                          f"on this host need {host / _MiB:.0f} MiB of shared memory: {fix}")
    if free < own:
        raise ConfigError(f"{directory} has {free / _MiB:.0f} MiB free but this rank needs "
                          f"{own / _MiB:.0f} MiB (the {local_size} ranks on this host "
                          f"{host / _MiB:.0f} MiB): free it (old gradsync-* segments?) or {fix}")


def segment_job(env) -> str:
    """A name for this job's segments that is unique on the host and valid in /dev/shm."""
    tag = f"{env.job_id}|{env.store_addr}|{env.store_port}"
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", env.job_id)[:40]
    return shm.check_job_id(f"{readable}-{hashlib.sha1(tag.encode()).hexdigest()[:12]}")


def connect(config, env, store, peers, pairs, use_shm, deadline):
    """Returns ``(pairs, group)``: ``pairs`` plus a ShmPair to each rank in ``use_shm``, and
    the host's ShmGroup when every rank of the job is on this host (else None)."""
    local = sorted({env.rank} | set(use_shm))
    counter = itertools.count()

    def barrier() -> None:  # the host's ranks only; each call uses a fresh key
        store.barrier(f"shm/{env.hostname}/{next(counter)}", len(local),
                      max(1.0, deadline - time.monotonic()))

    job = segment_job(env)
    group_here = len(local) == env.size
    host, rank0 = host_bytes(len(local), config.shm_slot_bytes, group_here)
    own = rank0 if local.index(env.rank) == 0 else (len(local) - 1) * shm.ring_bytes()
    check_room(len(local), own, host)
    pids = {p.rank: p.pid for p in peers if p.rank in use_shm}
    shm_pairs = shm.open_pairs(job, env.rank, pids, barrier)
    pairs = {**pairs, **shm_pairs}
    group = None
    if group_here:
        group = ShmGroup.open(job, local.index(env.rank), len(local), barrier,
                              slot_bytes=config.shm_slot_bytes, ranks=local,
                              fast=config.shm_fast, stream=config.shm_stream)
    return pairs, group
