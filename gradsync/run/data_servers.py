"""An elastic job's data servers: started once, outside the generations, ended with the job.

``gradsync run -np W --min-np m --max-np M --data-servers D python train.py``: the workers of
an elastic job come and go in generations (``elastic.py``); its D data servers
(``gradsync.data``) do not. They are not workers:

- **Start.** Once, before the first generation, on this machine: launch ranks ``W .. W+D-1``
  of a launch size ``W + D`` (so ``launch_env`` makes data server ``d`` of ``d = rank - W``,
  as in a static job), under the name this machine has among the job's hosts. Before they
  start, the store key ``data/elastic`` tells them that their workers come and go: a data
  server then admits any worker id (a worker's id is no rank there) and does not end when
  the workers it knows have gone (``gradsync/data/server.py``).
- **Apart.** In no generation, counted in no ``--min-np``/``--max-np`` and no ``WORLD_SIZE``
  (the workers' launch size counts them and ``launch_env`` takes them out, as in a static
  job); a data server's failure blacklists no host.
- **A failure** is reported at once and the job goes on: every worker hands the lost server's
  batches to the others (``Loader._adopt``). At the end the job's status is the first failed
  data server's, unless a worker failed (as in a static job).
- **End.** Once every worker has ended, the launcher writes ``data/end``; each data server
  sees it within a second and ends; those still running ``SERVER_LINGER`` seconds later are
  stopped with the rest of the job.
"""

from __future__ import annotations

import time
from typing import Callable

from .launcher import SERVER_LINGER, LaunchSpec, Rank, Slot, Starter, informs, rank_line
from .processes import Output, describe, exit_status

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
        self.failed: dict[int, int] = {}  # data server -> exit status, in failure order

    def start(self, host: str) -> None:
        """Starts the data servers on ``host``, a name of this machine."""
        count = self.spec.data_servers
        if not count:
            return
        from ..data.server import ELASTIC_KEY

        self.store.set(ELASTIC_KEY, "1")  # read once by each data server, at its start
        first = self.spec.num_proc
        for d in range(count):
            slot = Slot(first + d, host, d, count, 0, 1)
            self.ranks.append(self.starter.start(slot, self.port, first + count))
            if informs(self.spec):
                self.output.message(rank_line(self.ranks[-1], f"data server {d}"))

    def watch(self) -> None:
        """Reports each data server that failed since the last look."""
        for d, rank in enumerate(self.ranks):
            code = rank.proc.poll()
            if code in (None, 0) or d in self.failed:
                continue
            self.failed[d] = exit_status(code)
            self.output.message(f"rank {rank.slot.rank} (data server {d}) on host "
                                f"{rank.slot.host} {describe(code)}; the workers go on (the "
                                "other data servers serve its share)")

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
        self.watch()
        if any(r.proc.poll() is None for r in self.ranks):
            self.output.message(f"data servers still running {SERVER_LINGER:g}s after the last "
                                "worker ended are stopped")
        if status == 0 and self.failed:
            d, code = next(iter(self.failed.items()))
            return code, (f"data server {d} failed earlier ({len(self.failed)} of "
                          f"{len(self.ranks)} failed); the job ran to its end")
        return status, summary
