"""Generations: how an elastic job's launcher and workers agree on who is in the job.

An elastic job runs as a sequence of *generations*. Generation ``g`` is a list of workers in
rank order; its World has the job id ``<job>.e<g>``, so its store keys (addresses, barriers,
the abort record) and its shared-memory segments never meet another generation's. Only
``gradsync run`` (the launcher, which hosts the store) writes a generation; workers read it.
The keys live under ``gradsync/<job>/elastic/``:

=================  ============================================================================
``members/<g>``    JSON list ``[{"id": "localhost[3]", "host": "localhost"}, ...]``: rank i is
                   entry i. Survivors keep their old order; new workers come last, so the
                   lowest surviving rank becomes rank 0 and state is synced from it.
``gen``            the newest generation, written after its ``members/<g>``
``failed``         the launcher's reason for ending the job, once it has given up (below
                   ``--min-np`` past the elastic timeout, the reset limit); waiting workers
                   raise it
=================  ============================================================================

The launcher starts a new generation when a member of the newest one exits or is reported lost
(the abort record of its World, which the heartbeat marks ``silent`` for a stopped peer), and
when discovery finds room for more workers. It posts a ``PeerLostError`` into the abort record
of the generations it replaces, so that survivors stop waiting at once; workers that were
training reach the new generation at their next collective (a failure) or ``commit()`` (new
hosts: ``check_host_updates`` sees a newer ``gen``).

Example: workers a, b, c, d form generation 0 (ranks 0-3); b is killed. The launcher writes
``members/1 = [a, c, d]`` and ``gen = 1`` and posts the loss into ``<job>.e0``'s abort record;
a, c and d raise PeerLostError, roll back, and connect as ranks 0, 1, 2 of ``<job>.e1``.
"""

from __future__ import annotations

import json
import time

from ..errors import GradsyncError, PeerLostError
from ..rendezvous import Store

__all__ = ["Control", "generation_job", "ElasticJobFailed"]

_POLL = 0.02


class ElasticJobFailed(GradsyncError):
    """The launcher gave up on an elastic job (its reason is the message)."""


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
            raise PeerLostError(f"lost the launcher's store: {exc} (has gradsync run "
                                "died?)") from None

    def members(self, gen: int) -> list[dict]:
        return json.loads(self.store.get(f"members/{gen}"))

    def wait_newer(self, after: int, deadline: float) -> int:
        """Waits for a generation newer than ``after``; returns the newest.

        Raises:
            ElasticJobFailed: the launcher gave up, or none came before ``deadline``.
        """
        while True:
            gen = self.generation()
            if gen > after:
                return gen
            if self.store.check("failed"):
                raise ElasticJobFailed(self.store.get("failed").decode())
            if time.monotonic() > deadline:
                raise ElasticJobFailed(
                    f"no new generation of the elastic job after generation {after} within "
                    "the elastic timeout; see gradsync run's messages")
            time.sleep(_POLL)
