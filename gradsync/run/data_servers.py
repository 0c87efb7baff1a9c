"""An elastic job's data servers: started once, outside the generations, ended with the job.

``gradsync run -np W --min-np m --max-np M --data-servers D python train.py``: the workers of
an elastic job come and go in generations (``elastic.py``); its D data servers
(``gradsync.data``) do not. They are not workers:

- **Start.** Once, before the first generation: launch ranks ``W .. W+D-1`` of a launch size
  ``W + D`` (so ``launch_env`` makes data server ``d`` of ``d = rank - W``, as in a static
  job). Where: on the hosts of ``--data-hosts``, filled in order as ``-H`` fills a static
  job's (``ranks.place``: with ``--data-hosts d0:1,d1:2`` and D = 3, server 0 on d0,
  servers 1 and 2 on d1), here or over ssh as a worker starts; without it on this machine,
  under the name it has among the job's hosts. Before they start, the store key
  ``data/elastic`` tells them that their workers come and go: a data server then admits any
  worker id (a worker's id is no rank there) and does not end when the workers it knows have
  gone (``gradsync/data/server.py``). Workers find them wherever they run: each publishes
  its address in the store (``connect/server_links.py``).
- **Apart.** In no generation, counted in no ``--min-np``/``--max-np`` and no ``WORLD_SIZE``
  (the workers' launch size counts them and ``launch_env`` takes them out, as in a static
  job); a data server's failure blacklists no host. A data host takes no worker, even when
  ``-H`` or the discovery script lists it (``host_pool.HostPool.free``).
- **A failure** is reported at once and the job goes on: every worker hands the lost server's
  batches to the others (``Loader._adopt``). The rank is started again on its host, as a
  replicated parameter server's is in a static job (at most ``--server-restarts`` times,
  default 3; not once the job is finishing): the new process counts itself (its
  *incarnation*), publishes its address in place of the lost one's and then its ready
  record. The workers agree, at their next commit or re-formation, on the epoch from which
  it serves them all, and each connects to it at that epoch's start, new workers included
  (``gradsync/data/returns.py``); nothing here takes part. At the end the job's status is
  the first failed data server's, unless a worker failed (as in a static job).
- **End.** Once every worker has ended, the launcher writes ``data/end``; each data server
  sees it within a second and ends; those still running ``SERVER_LINGER`` seconds later are
  stopped with the rest of the job.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from .hosts import Host
from .ranks import (SERVER_LINGER, LaunchSpec, Rank, Slot, Starter, informs, place, rank_line,
                    restart_allowed)
from .processes import Output, StartError, describe, exit_status

__all__ = ["DataServers"]

_POLL = 0.05


class DataServers:
    """The data servers of one elastic job (see the module docstring).

    Args:
        spec: the job (``spec.data_servers`` of them, after ``spec.num_proc`` workers).
        starter: starts a rank with its identity.
        output: where messages go.
        base: the launcher's store (a torch ``TCPStore``).
        port: the store's port, which every rank is given.

    Attributes:
        ranks: the started data servers, in index order.
    """

    def __init__(self, spec: LaunchSpec, starter: Starter, output: Output, base, port: int):
        from ..cluster.rendezvous import Store

        self.spec, self.starter, self.output, self.port = spec, starter, output, port
        self.store = Store.over(base, starter.job_id, 30.0)
        self.ranks: list[Rank] = []
        self.failed: list[tuple[int, int]] = []  # (data server, exit status), in failure order
        self._reported: list[Rank] = []  # the processes whose failure was reported
        self.restarts: dict[int, int] = {}  # data server -> times started again

    def start(self, hosts: Sequence[Host]) -> None:
        """Starts the data servers on ``hosts``, filled in order (``ranks.place``).

        Raises:
            ValueError: the hosts have fewer slots than the job has data servers.
        """
        count = self.spec.data_servers
        if not count:
            return
        from ..data.server import ELASTIC_KEY

        self.store.set(ELASTIC_KEY, "1")  # read once by each data server, at its start
        first = self.spec.num_proc
        for d, slot in enumerate(place(hosts, count)):
            slot = Slot(first + d, slot.host, slot.local_rank, slot.local_size,
                        slot.cross_rank, slot.cross_size)
            self.ranks.append(self.starter.start(slot, self.port, first + count))
            if informs(self.spec):
                self.output.message(rank_line(self.ranks[-1], f"data server {d}"))

    def watch(self, restart: bool = True) -> None:
        """Reports each data server that failed since the last look and, when ``restart``
        (the job is not finishing), starts it again on its host while its restarts last."""
        for d, rank in enumerate(self.ranks):
            code = rank.proc.poll()
            if code in (None, 0) or any(r is rank for r in self._reported):
                continue
            self._reported.append(rank)
            self.failed.append((d, exit_status(code)))
            self.output.message(f"rank {rank.slot.rank} (data server {d}) on host "
                                f"{rank.slot.host} {describe(code)}; the workers go on (the "
                                "other data servers serve its share)")
            if restart:
                self._restart(d)

    def _restart(self, d: int) -> None:
        """Starts data server ``d`` again in its slot (its predecessor has exited): the
        replica rule of a static job's parameter servers (``--server-restarts``)."""
        rank = self.ranks[d]
        if not restart_allowed(self.restarts, d, self.spec.server_restarts,
                               self.output.message, f"data server {d}"):
            return
        try:
            self.ranks[d] = self.starter.start(rank.slot, self.port,
                                               self.spec.num_proc + len(self.ranks))
        except StartError as exc:
            self.output.message(f"could not start data server {d} again: {exc}")
            return
        self.output.message(f"data server {d} started again on host {rank.slot.host} "
                            f"({self.restarts[d]} of {self.spec.server_restarts}): the workers "
                            "take it back from an epoch they agree on")
        if informs(self.spec):
            self.output.message(rank_line(self.ranks[d], f"data server {d}"))

    def end(self, status: int, summary: str | None,
            interrupted: Callable[[], int | None] = lambda: None) -> tuple[int, str | None]:
        """Every worker has ended with ``status`` (and ``summary``): tells the data servers
        to end and waits for them up to ``SERVER_LINGER`` seconds, or until ``interrupted()``
        is not None. Returns the job's status and summary: the workers', else the first
        failed data server's."""
        if not self.ranks:
            return status, summary
        from ..data.server import END_KEY

        try:
            self.store.set(END_KEY, "1")
        except (RuntimeError, OSError) as exc:  # the store is the launcher's own: unlikely
            self.output.message(f"cannot tell the data servers to end ({exc}); they are stopped")
        deadline = time.monotonic() + SERVER_LINGER
        while any(r.proc.poll() is None for r in self.ranks) and \
                time.monotonic() < deadline and interrupted() is None:
            time.sleep(_POLL)
        self.watch(restart=False)
        if any(r.proc.poll() is None for r in self.ranks):
            self.output.message(f"data servers still running {SERVER_LINGER:g}s after the last "
                                "worker ended are stopped")
        if status == 0 and self.failed:
            d, code = self.failed[0]
            lost = len({s for s, _ in self.failed})
            return code, (f"data server {d} failed earlier ({lost} of {len(self.ranks)} "
                          "failed); the job ran to its end")
        return status, summary
