"""Shared-memory set-up for the ranks of one host, called by ``World.connect``.

Every rank of a host replaces the TCP pair of each same-host peer with a ``ShmPair`` (two
byte rings) and, when the whole job is on one host, also joins the host's ``ShmGroup``, the
segment that the shared-memory allreduce, broadcast and barrier use. Same-host peers get no
TCP connection at all: a ShmPair notices a dead peer by its pid and start time, and the abort
record in the store carries every other failure.

The segments are named after the job and the store's address, so that two jobs on one host
never meet even if their launchers gave them the same job id (torchrun's default run id is
``none``), and are unlinked as soon as every rank has mapped them.
"""

from __future__ import annotations

import hashlib
import itertools
import re
import time

from .collectives.shm import ShmGroup
from .transport import shm

__all__ = ["connect", "segment_job"]


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
    pids = {p.rank: p.pid for p in peers if p.rank in use_shm}
    shm_pairs = shm.open_pairs(job, env.rank, pids, barrier)
    pairs = {**pairs, **shm_pairs}
    group = None
    if len(local) == env.size:
        group = ShmGroup.open(job, local.index(env.rank), len(local), barrier,
                              slot_bytes=config.shm_slot_bytes, ranks=local,
                              fast=config.shm_fast)
    return pairs, group
