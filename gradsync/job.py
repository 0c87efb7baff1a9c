"""The process's job: the World it is connected to and the Engine that runs its operations.

A process takes part in one job at a time: from ``gradsync.init()`` to ``gradsync.shutdown()``,
or, in an elastic job, one generation after another (``elastic.worker.reset`` closes the
generation's World and installs the next one's). This module is the one owner of that job.
Everything above it (the NumPy API, the Horovod API and its process sets, the
``torch.distributed`` backend, the parameter-server client, elastic mode, the benchmarks)
reads it through ``current()``, ``world()`` and ``engine()``; only ``start``, ``install`` and
``close`` change it.

Why one object. The World and its Engine are installed and removed together as one ``Job``,
replaced in a single assignment. A reader takes ``current()`` once and holds a World and the
Engine of that same World, even while another thread shuts the job down (``api``'s size-1
and small-call fast cases read it so, once per call). Writers take one lock, so two threads that call
``init()`` at once connect once, and a shutdown never interleaves with an install. Readers
take no lock: one module-global read is atomic, and the hot path pays nothing more for it.
"""

from __future__ import annotations

import threading
from typing import Callable

from .flight_recorder import recorder
from .liveness.pace import meter
from .pipeline.engine import Engine

__all__ = ["Job", "current", "world", "engine", "start", "install", "close"]

_NOT_INITIALISED = "gradsync has not been initialised: call gradsync.init() first"


class Job:
    """A connected World and the Engine that runs its operations in issue order."""

    __slots__ = ("world", "engine", "pace")

    def __init__(self, world):
        self.world = world
        # The job's settings reach the process's flight recorder here, with the NumPy API's
        # track on this World (each elastic generation's World has its own).
        config = world.config
        root_job, root_ranks = world.root
        recorder.configure(config, root_ranks[world.rank], root_job)
        self.engine = Engine(world, recorder.track(
            f"numpy:{world.env.job_id}", "numpy API", root_ranks, "numpy",
            config.timeout, world))
        # The pace meter counts this job's steps from 1 (an elastic generation renumbers
        # them on every rank alike); its publisher names stragglers (straggler_watch.py).
        meter.reset(config.straggler_ops, on=config.straggler_interval > 0)
        self.pace = None
        if config.straggler_interval > 0 and world.size > 1:
            from .liveness.straggler_watch import Publisher
            self.pace = Publisher(world, world.generation)


_lock = threading.Lock()  # held by the writers: start, install, close
_job: Job | None = None


def current() -> Job | None:
    """The process's job, or None before ``init()`` and after ``shutdown()``."""
    return _job


def world():
    """The job's World.

    Raises:
        ValueError: gradsync has not been initialised.
    """
    return _installed().world


def engine() -> Engine:
    """The job's Engine.

    Raises:
        ValueError: gradsync has not been initialised.
    """
    return _installed().engine


def _installed() -> Job:
    job = _job  # one read: a concurrent close() cannot split the World from its Engine
    if job is None:
        raise ValueError(_NOT_INITIALISED)
    return job


def start(connect: Callable[[], object]) -> bool:
    """Installs the World that ``connect()`` returns, unless a job is installed already.

    ``connect`` runs under the writers' lock, so concurrent callers connect once and the
    others return when the job is there.

    Returns:
        True if this call installed the job, False if one was installed already.
    """
    global _job
    with _lock:
        if _job is not None:
            return False
        _job = Job(connect())
        return True


def install(world) -> Job:
    """Makes ``world`` the job's World, with a new Engine (an elastic generation's World,
    after ``close()`` ended the previous one). Returns the new Job."""
    global _job
    with _lock:
        _job = Job(world)
        return _job


def close() -> None:
    """Finishes the queued operations and closes every connection; nothing without a job.

    The job is removed first, under the lock, so new calls fail fast with "not initialised"
    while the old operations drain outside it.
    """
    global _job
    with _lock:
        job, _job = _job, None
    if job is None:
        return
    if job.pace is not None:
        job.pace.stop()
    try:
        if job.world.failure is None:
            job.engine.drain()
    finally:
        job.engine.stop()
        job.world.close()
