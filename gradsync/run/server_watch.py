"""The launcher's watch on a replicated parameter-server job: a server that its shard fenced
out while it is silent is replaced at once, not when its process ends.

**Why.** With ``--ps-replicas R`` a server that is stopped, hung or cut off is found by its
peers within ``heartbeat_timeout`` (its beat counter in the store stands still:
``ps/replication.py``) and fenced: the shard's next view goes on without it. But the launcher
starts a lost server again when its process ends (``launcher._Job.turn``), and a stopped
process ends only once it is woken, a cut-off one once its host is back. Until then the shard
runs on one copy fewer, and a second fault on it finds none: the chaos soak measured 19 s on
one copy after a 20 s stop and 9.5 s after a 10 s partition, against 1.1 s after a kill.

**What the launcher reads.** It hosts the store, so every ``WATCH_EVERY`` seconds its job loop
reads, under the job's prefix ``gradsync/<job id>/``: each shard's views ``ps/view/<shard>/<n>``
(``Views.after``: every view since the last look, oldest first) and each server's beat
counter ``ps/beat/<server>``. A look is one store request per shard and per server, on
loopback, plus one per new view.

**Fenced.** A server index is *held* while the process the launcher runs for it has been a
member of its shard: the first processes are the members of view 0; a replacement is held
once a view after its start holds it (its join, ``ps/join.py``). A view that leaves a held
server out fences that process for good: a view never takes a member back, and only a new
process's join brings the index in again. So a replacement that has not joined (still
copying, or behind a cut and unable to reach the store) is never in a view and can never be
taken for fenced; and ``restarted`` reads every view before it forgets the old process, so
that no view of the old process is taken for the new one's.

**Silent.** A fenced server that is awake goes on beating (every ``heartbeat_interval``,
0.25 s by default) until it sees the view, within a beat, and ends with status 1; the
launcher then starts it again as any failed server. One whose counter the launcher has seen
stand still for ``SILENT`` seconds is stopped, hung or cut off, and would end only once it
wakes. Such a server is *stranded*: the launcher kills it (SIGKILL ends a stopped process
too; a remote rank's lifeline, ``processes.py``, sends SIGTERM and ``stop_grace`` seconds later
SIGKILL) and starts its replacement at once, which joins as every replacement does, with a copy
from the live primary. The kill is that server's failure, reported once: the old process is
no longer the rank's, and its end is not looked at again. (A counter that stands still for
another reason, a beat late on a loaded machine or a ``heartbeat_interval`` above ``SILENT``,
makes the launcher kill a process that was fenced and about to end by itself: nothing is lost.)

**How soon.** The view comes first, and it sets the time: a peer (the primary forwarding an
update, a worker pushing) fences a server whose counter has stood still for
``heartbeat_timeout`` (2 s by default) from its first look during a request left unanswered, so
the view is written about ``heartbeat_timeout`` plus a look (0.25 s) after the server fell
silent. By then its counter has stood still longer than ``SILENT``, and the launcher kills it
at its next look, within ``WATCH_EVERY`` and a turn of its job loop. ``SILENT`` adds nothing to
that time; it keeps the launcher from killing a fenced server that is awake (beating) and about
to end by itself. Measured in ``tests/test_ps_partition.py`` (heartbeat every 0.5 s, timeout 2
s, the shared 2-core machine at a load of 4-7, the job's lines timestamped as they came): the
cut at 3.60 s of the job, the view at 5.85 s, the kill at 6.02 s; in another run 5.23, 7.48 and
7.65 s. The kill's message gives how long the launcher saw the counter stand still: since the
server's last beat, at most one ``heartbeat_interval`` before it fell silent, because a server
beats once as soon as its beat thread starts (``ps/server.py``, ``_beat``). When the first beat
waited an interval, that server, cut off 0.05 s after its beat thread started, had never moved
its counter, and the message counted from the launcher's first look at the job's start: "silent
for 3.8s" and "4.8s" in those runs, for kills 2.4 s after the cut (7.8 s in a run on a loaded
machine).

**Where the replacement starts** (``spare_host``). The silent server's host may be cut off,
and a replacement there would reach nobody. So a host of the job with a free slot that holds
no other copy of the shard comes first; else the same host (the chaos soak's layout, one slot
per server host, has no room). A replacement on a cut-off host waits for the store (its client
retries for ``GRADSYNC_CONNECT_TIMEOUT``, 60 s by default) and joins once the host is back. One
that cannot within that time, or whose ssh cannot connect, exits non-zero and is started again
as any failed server, ``--server-restarts`` times at most: never a loop. Never having joined,
it never was in a view, so it leaves none behind.

**A stale copy that wakes.** The kill reaches a stopped process at once, and through the
testbed's ssh stand-in (``testbed/netns.py``) a cut-off one too; over real ssh a process on a
host cut off from the launcher gets it only when the host is back. If that process wakes
first it is still fenced by the view numbers: its writes are refused at its former peers'
fences (``transport/regions.py``), and its own look at the views ends it with status 1, even
when the newest view already holds its index again for the replacement (a view it missed left
it out: ``ps/server.py``, ``Server._adopt``). Nothing counts it again: the launcher no longer
watches that process, and the index is the replacement's.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ..ps.replication import View, Views, beat_key

__all__ = ["ServerWatch", "Stranded", "spare_host", "SILENT", "WATCH_EVERY"]

WATCH_EVERY = 0.25
"""Seconds between two of the launcher's looks at the views and beats."""

SILENT = 1.0
"""Seconds a fenced server's beat counter must stand still, as the launcher sees it, for the
server to count as stranded: four beats at the default interval. Its peers have already
waited ``heartbeat_timeout`` (2 s) before they fenced it, so a stranded one is usually killed
at the first look after the view change."""


@dataclass(frozen=True)
class Stranded:
    """A server fenced out of its shard while silent."""

    server: int
    view: View
    """The view that left it out."""
    quiet: float
    """Seconds the launcher has seen its beat counter stand still."""


class ServerWatch:
    """The launcher's reading of a replicated job's views and beats (see the module docstring).

    Args:
        store: the job-scoped store (``rendezvous.Store``: keys under ``gradsync/<job id>/``).
        servers, replicas: the job's parameter servers and copies of each shard.
        timeout: seconds a read of a view may wait (a view is read only once its key exists).
        silent: ``SILENT``.
        clock: the time (seconds, monotonic); injected by the tests.
    """

    def __init__(self, store, servers: int, replicas: int, timeout: float = 30.0,
                 silent: float = SILENT, clock: Callable[[], float] = time.monotonic):
        self.store, self.servers, self.silent, self.clock = store, servers, silent, clock
        self.views = [Views(store, k, servers, replicas, timeout)
                      for k in range(servers // replicas)]
        self.known = [views.first for views in self.views]
        self.held = set(range(servers))  # the first processes are view 0's members
        self.fenced: dict[int, View] = {}  # held server -> the view that left it out
        self._beats: dict[int, tuple[int, float]] = {}  # server -> (count, when it changed)

    def look(self) -> list[Stranded]:
        """Reads the new views and every beat counter; returns the servers stranded now."""
        self._read_views()
        now = self.clock()
        for server in range(self.servers):
            count = int(self.store.add(beat_key(server), 0))
            seen = self._beats.get(server)
            if seen is None or seen[0] != count:
                self._beats[server] = (count, now)
        return [Stranded(s, view, now - self._beats[s][1])
                for s, view in sorted(self.fenced.items())
                if now - self._beats[s][1] >= self.silent]

    def restarted(self, server: int) -> None:
        """A new process runs for ``server`` from now on: it is held once a later view holds
        it. Every view written so far is read first: they were the old process's."""
        try:
            self._read_views()
        finally:
            # Even when the read fails: a view of the old process taken for the new one's
            # could fence only a replacement that also falls silent (a joining one beats).
            self.held.discard(server)
            self.fenced.pop(server, None)

    def forget(self, server: int) -> None:
        """No longer reports ``server``'s fenced process (it ended, or it may not be replaced:
        it ends when it wakes, and the launcher sees that end)."""
        self.fenced.pop(server, None)

    def _read_views(self) -> None:
        for k, views in enumerate(self.views):
            for view in views.after(self.known[k]):
                for server in views.first.members:
                    if server in view.members:
                        self.held.add(server)  # a join (or a member all along)
                    elif server in self.held:
                        self.held.discard(server)
                        self.fenced[server] = view
                self.known[k] = view


def spare_host(hosts: Sequence, running: Iterable[str], avoid: Iterable[str]) -> str | None:
    """The first of ``hosts`` (each with ``name`` and ``slots``) that has a free slot, given
    the hosts of the ranks ``running``, and is not in ``avoid``; None if there is none."""
    used, avoid = Counter(running), set(avoid)
    for host in hosts:
        if host.name not in avoid and used[host.name] < host.slots:
            return host.name
    return None
