"""The launcher's one job loop: every ``gradsync run`` job, static or elastic, runs in it.

What a run does that does not depend on how its ranks come and go:

1. **Catch** SIGINT, SIGTERM and SIGHUP for the whole run (``processes.Interrupts``): the first
   ends the job, a second skips the stop's grace.
2. **Begin.** The policy hosts the store through the loop (``host_store``, which publishes
   the job file, ``jobfile.py``: where ``gradsync top`` finds the store) and starts its first
   ranks.
3. **Turn**, every ``POLL`` seconds: a signal received ends the job; else the ranks the policy
   stopped while the job goes on (``stop_one``: SIGTERM at once) that still run after
   ``stop_grace`` get SIGKILL, and the policy looks at its ranks once and says whether the job
   has ended, with what status and summary.
4. **End**, on every path (an exception's too), so that no rank outlives the job: the job file
   withdrawn, the policy's own ending (an elastic job tells waiting workers it gave up), every
   rank still running stopped (SIGTERM, then SIGKILL after ``stop_grace``), the job's names in
   this host's /dev/shm removed (a SIGKILLed rank cannot unlink its own), the last output
   drained; then the summary line, and the launcher exits with the status.

The policies (what a turn decides) are the static job (``launcher._Job``: a fixed set of ranks,
where a failed rank stops the job unless its role lets the others go on) and the elastic job
(``elastic._ElasticJob``: generations of workers re-formed around failures). Both start ranks
through one ``ranks.Starter``, each with the command of its role, and both have their
ranks stopped by the loop: every one at the end, and one at a time while the job goes on (an
elastic job's workers on a blacklisted host, or no longer wanted).
"""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING, Optional, Tuple

from . import jobfile
from .processes import Interrupts, Output, StartError, clear_shared_memory, stop
from .ranks import LaunchSpec, Rank, Starter

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from .keeper import StoreKeeper

__all__ = ["JobLoop", "End", "POLL"]

POLL = 0.05
"""Seconds between two turns: the delay before a failure is seen."""

_DRAIN = 2.0  # seconds to wait for the last output after the ranks are gone

End = Tuple[int, Optional[str], Optional[str]]
"""How a job ended: (exit status, summary line or None, what the ranks the end stops are
called in the summary: ``"other "`` after one rank's failure, ``""`` after a signal, None to
leave them uncounted)."""


class JobLoop:
    """One run of a job (see the module docstring); a policy subclasses it.

    Args:
        spec: the job.
        output: where the ranks' output and the launcher's messages go.
    """

    count_stopped = True
    """Whether the summary counts the ranks the end stopped (``; stopped 2 other ranks``); an
    elastic job's does not, its workers having come and gone."""

    def __init__(self, spec: LaunchSpec, output: Output):
        self.spec, self.output = spec, output
        self.interrupts = Interrupts()
        # The policy's Starter, from its __init__ or begin(): the end removes the names of its
        # job id from /dev/shm.
        self.starter: Starter | None = None
        self.jobfile: "str | None" = None  # published by host_store, withdrawn by the end
        self._stopping: list[tuple[Rank, float]] = []  # (rank stop_one stopped, SIGKILL time)

    # ------------------------------------------------------------------ the policy's part
    def begin(self) -> None:
        """Hosts the store, publishes the job file and starts the first ranks.

        Raises:
            StartError: the job cannot start (its status is the launcher's).
        """
        raise NotImplementedError

    def turn(self) -> End | None:
        """Looks at the ranks once; returns how the job ended (``End``), or None."""
        raise NotImplementedError

    def started(self) -> list[Rank]:
        """Every rank started so far that the end must stop."""
        raise NotImplementedError

    def ending(self, status: int, summary: str | None) -> None:
        """Called at the end before the ranks are stopped: what the policy itself stops."""

    # ------------------------------------------------------------------ for the policy
    def host_store(self, size: int, client: bool = True) -> "TCPStore | StoreKeeper":
        """Starts the job's store where every rank of the policy's Starter reaches it
        (``Starter.host_store``: hosted here, a ``TCPStore`` this process is a client of, or,
        where the policy needs no ``client``, held by a store keeper, ``keeper.py``)
        and publishes the job file (``jobfile.py``: where ``gradsync top`` finds the store;
        ``size``: the job's size it records), which the end withdraws. The policy holds the
        store for the whole run: it outlives every rank.

        Raises:
            StartError: the store cannot be started.
        """
        assert self.starter is not None  # made first: the store listens on its address
        store = self.starter.host_store(client)
        self.jobfile = jobfile.publish(self.starter.job_id, self.starter.store_addr, store.port,
                                       size)
        return store

    def stop_one(self, rank: Rank) -> None:
        """Stops one rank while the job goes on: SIGTERM now (over ssh:
        its lifeline), SIGKILL once ``stop_grace`` has passed if it still runs (looked at
        before each turn). It stays among ``started()``, so the end stops it in any case."""
        rank.signal(signal.SIGTERM)
        self._stopping.append((rank, time.monotonic() + self.spec.stop_grace))

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Runs the job to its end; returns the launcher's exit status."""
        ranks: list[Rank] = []
        with self.interrupts.catching():
            status, summary, others = 1, None, None
            try:
                self.begin()
                end = None
                while end is None:
                    end = self._interrupted()
                    if end is None:
                        self._reap()
                        end = self.turn()
                    if end is None:
                        time.sleep(POLL)
                status, summary, others = end
            except StartError as exc:
                status, summary, others = exc.status, str(exc), "other "
            finally:
                jobfile.withdraw(self.jobfile)
                self.ending(status, summary)
                ranks = self.started()
                stopped = stop([r.process for r in ranks], self.spec.stop_grace,
                               hurry=lambda: self.interrupts.hurry,
                               on_stuck=lambda i: self.output.message(
                                   f"rank {ranks[i].slot.rank} (pid {ranks[i].proc.pid}) did "
                                   "not exit after SIGKILL"))
                if self.starter is not None:
                    self.starter.close()
                    clear_shared_memory(self.starter.job_id)
                self.output.drain(_DRAIN)
        if summary and ranks and others is not None and self.count_stopped:
            summary += f"; stopped {stopped} {others}rank{'' if stopped == 1 else 's'}"
        if summary:
            self.output.message(summary)
        return status

    def _reap(self) -> None:
        """SIGKILLs the ranks ``stop_one`` stopped that still run after the stop grace."""
        now = time.monotonic()
        for entry in list(self._stopping):
            rank, kill_at = entry
            if rank.proc.poll() is None and now < kill_at:
                continue
            if rank.proc.poll() is None:
                rank.signal(signal.SIGKILL)
            self._stopping.remove(entry)

    def _interrupted(self) -> End | None:
        received = self.interrupts.received
        if received is None:
            return None
        return 128 + received, f"interrupted by {signal.Signals(received).name}", ""
