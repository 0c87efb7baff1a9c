"""Generations: how an elastic job's launcher and workers agree on who is in the job.

An elastic job runs as a sequence of *generations*. Generation ``g`` is a list of workers in
rank order; its World has the job id ``<job>.e<g>``, so its store keys (addresses, barriers,
the abort record) and its shared-memory segments never meet another generation's. Only
``gradsync run`` (the launcher, which hosts the store) writes a generation, all through
``run/generations.py``; workers read it. The keys live under ``gradsync/<job>/elastic/``:

=================  ============================================================================
``members/<g>``    JSON list ``[{"id": "localhost[3]", "host": "localhost"}, ...]``: rank i is
                   entry i. Survivors keep their old order; new workers come last, so the
                   lowest surviving rank becomes rank 0 and state is synced from it.
``gen``            the newest generation, written after its ``members/<g>``
``failed``         the launcher's reason for ending the job, once it has given up (below
                   ``--min-np`` past the elastic timeout, the reset limit); waiting workers
                   raise it
``excluded/<id>``  why worker ``<id>`` is out of the job ("excluded from the job at generation
                   g: ..."), written when the launcher fails or stops it
``ready/<id>``     written by a new worker once it has started (imported its framework) and
                   waits to be listed: the launcher lists a new worker only once it is ready
=================  ============================================================================

The launcher starts a new generation when a member of the newest one exits or is reported lost
(the abort record of its World, which the heartbeat marks ``silent`` for a stopped peer), and
when new workers it started for free slots are ready (``ready/<id>``): a worker that starts,
imports torch and connects costs seconds, and the job trains on meanwhile instead of waiting
for it in the new generation. After a loss it posts a ``PeerLostError`` into the abort record
of the generations it replaces, so that survivors stop waiting at once; workers that were
training reach the new generation at their next collective (a failure) or ``commit()`` (only
new workers: ``check_host_updates`` sees a newer ``gen``; the older generation is not aborted
once it has formed, so nothing is rolled back; one not yet formed is, so that its members
never wait for each other in two generations). A new worker that is not yet listed waits for
a generation that lists it; one that is excluded before that (it died, or never became ready)
stops waiting.

**Fencing.** A worker that comes back after the job moved on without it (SIGCONT after a
SIGSTOP, a partitioned host whose link returns, a kill that did not arrive) can write nothing
into a newer generation: every connection proves the generation's job id in its handshake
(``transport/tcp.py``; regions too), so the newer World's listeners drop it; shared-memory
rings and segments are named by the job id and unlinked once attached; the survivors closed
every connection of the old World, so its late frames meet closed sockets; and an abort
record it posts into the old generation loses to the one already there (``post_abort`` is a
compare-and-set). Its own collectives fail, ``hvd.elastic.run`` tries to join the next
generation, finds itself unlisted and raises ``ExcludedError`` with the launcher's reason.

Example: workers a, b, c, d form generation 0 (ranks 0-3); b is killed. The launcher writes
``members/1 = [a, c, d]`` and ``gen = 1`` and posts the loss into ``<job>.e0``'s abort record;
a, c and d raise PeerLostError, connect as ranks 0, 1, 2 of ``<job>.e1`` and agree where to go
on from (``recovery.py``).
"""

from __future__ import annotations

import json
import time

from ..cluster.rendezvous import Store
from ..errors import GradsyncError

__all__ = ["Control", "generation_job", "ElasticJobFailed", "ExcludedError"]

_POLL = 0.02


class ElasticJobFailed(GradsyncError):
    """The launcher gave up on an elastic job (its reason is the message)."""


class ExcludedError(ElasticJobFailed):
    """This worker is out of the elastic job, which went on without it: it failed, was
    reported lost or silent, or its host left (the launcher's reason is the message)."""


def generation_job(job: str, gen: int) -> str:
    """The job id of generation ``gen``'s World."""
    return f"{job}.e{gen}"


class Control:
    """The elastic job's control keys in the store (see the module docstring).

    Args:
        base: the torch store the launcher hosts.
        job: the job id.
        timeout: seconds for store operations.
    """

    def __init__(self, base, job: str, timeout: float):
        self.base, self.job, self.timeout = base, job, timeout
        self.store = Store.over(base, f"{job}/elastic", timeout)

    # ------------------------------------------------------------------ launcher
    def publish(self, gen: int, members: list[dict]) -> None:
        """Makes ``members`` generation ``gen`` (the launcher only)."""
        self.store.set(f"members/{gen}", json.dumps(members))
        self.store.set("gen", str(gen))

    def exclude(self, worker: str, reason: str) -> None:
        """Records why ``worker`` is out of the job (the launcher only), for it to read if it
        comes back."""
        self.store.set(f"excluded/{worker}", reason)

    def is_ready(self, worker: str) -> bool:
        """Whether new worker ``worker`` has announced that it is ready to join."""
        return self.store.check(f"ready/{worker}")

    def give_up(self, reason: str) -> None:
        """Tells waiting workers why the job ends (the launcher only)."""
        self.store.set("failed", reason)

    def world_store(self, gen: int) -> Store:
        """The job-scoped store of generation ``gen``'s World (to read or post its abort)."""
        return Store.over(self.base, generation_job(self.job, gen), self.timeout)

    def abort(self, gen: int, message: str, peer: int | None) -> None:
        """Posts a lost peer into generation ``gen``'s abort record, unless one is there."""
        self.world_store(gen).post_abort({"kind": "PeerLostError", "rank": -1,
                                          "message": message, "peer": peer})

    # ------------------------------------------------------------------ workers
    def generation(self) -> int:
        """The newest generation (-1 before the first)."""
        try:
            if not self.store.check("gen"):
                return -1
            return int(self.store.get("gen"))
        except (RuntimeError, OSError) as exc:
            # Not a lost peer: with the launcher gone there is no next generation to recover
            # into (a worker that comes back after the job ended would retry for ever).
            raise ElasticJobFailed(f"lost the launcher's store: {exc} (the job has ended, or "
                                   "gradsync run died)") from None

    def announce_ready(self, worker: str) -> None:
        """Tells the launcher that ``worker`` has started and waits to be listed."""
        self.store.set(f"ready/{worker}", "1")

    def exclusion(self, worker: str) -> str | None:
        """Why ``worker`` was excluded (None: it was not)."""
        if not self.store.check(f"excluded/{worker}"):
            return None
        return self.store.get(f"excluded/{worker}").decode()

    def members(self, gen: int) -> list[dict]:
        return json.loads(self.store.get(f"members/{gen}"))

    def wait_newer(self, after: int, deadline: float, worker: str | None = None) -> int:
        """Waits for a generation newer than ``after``; returns the newest.

        Args:
            worker: also stop waiting when this worker is excluded (a new worker waiting to
                be listed, which the launcher may give up on before any generation comes).

        Raises:
            ExcludedError: ``worker`` was excluded (the launcher's reason).
            ElasticJobFailed: the launcher gave up, or none came before ``deadline``.
        """
        while True:
            gen = self.generation()
            if gen > after:
                return gen
            if self.store.check("failed"):
                raise ElasticJobFailed(self.store.get("failed").decode())
            reason = None if worker is None else self.exclusion(worker)
            if reason is not None:
                raise ExcludedError(f"{reason}; the job went on without it")
            if time.monotonic() > deadline:
                raise ElasticJobFailed(
                    f"no new generation of the elastic job after generation {after} within "
                    "the elastic timeout; see gradsync run's messages")
            time.sleep(_POLL)
