"""The server jobs of ``gradsync bench chaos``: who runs where, what a fault hits, when the
job is whole again.

    gradsync bench chaos --servers 2 [--ps-replicas 2] [--ps-mode sync|async] ...
    gradsync bench chaos --data-servers 2 ...

``--servers S`` makes the soak's job a parameter-server job: ``gradsync run -np W --servers S
--ps-replicas R`` running ``chaos_server_rank.py --job ps`` (``--ps-mode``, ``sync`` by
default). ``--data-servers D`` makes it a data-server job: ``gradsync run -np W
--data-servers D`` running ``chaos_server_rank.py --job data``. Of the ``--hosts`` emulated
hosts, the last S (or D) hold one server each and the others ``--ranks-per-host`` workers
each (W in all), so that cutting a server's host cuts that server and no worker, and the
copies of a shard are on different hosts.

The workers of a server job are not elastic (docs/ps.md, docs/data.md: a lost ``sync``
worker ends the job), so every fault hits a **server**, drawn with ``--seed`` among those
hit least so far (the launcher starts a lost parameter server again, ``--server-restarts``
times at most: below):

- ``kill``: SIGKILL; ``stop``: SIGSTOP for ``--stop-seconds``, then SIGCONT; ``partition``:
  the server's host cut off for ``--partition-seconds``; ``straggler``: its link slower;
- ``server``: the three that lose a server in turn, ``kill,stop,partition`` (the default
  ``--faults`` of a server job).

A parameter server that is lost comes back: the launcher starts it again and it joins its
shard with a copy (docs/ps.md); the next fault waits until every shard has its R copies. A
lost data server is started again too, but serves only workers that connect after it
(docs/data.md), and a server job's workers are all there from the start: for them it stays
lost (the others serve its share), so a data-server soak stops injecting once one data
server is left: at most D - 1 faults that lose one. A
parameter-server soak passes the launcher ``--server-restarts`` large enough for every fault
it can inject (``restarts_for``: a 10-minute soak with a fault every 30 s on 2 servers hits
each about 10 times, past the launcher's default of 3), and would stop injecting only once
every server rank was started again that many times.

A ``sync`` soak is followed by a **reference run**: the same job, fault-free, to the soak's
last step, with no emulated compute (a sleep, which changes no number), whose parameters the
soak's must equal bit for bit (``chaos_server_report.py``).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

from ..run.ranks import SERVER_RESTARTS
from . import chaos_server_report as csr
from ..testbed.netns import alive  # a pid that still runs (the one check)

__all__ = ["ServerJob", "kinds", "plan", "restarts_for"]

_SERVER_FAULTS = ("kill", "stop", "partition")
_DATA_SAMPLES = 1024  # rows of the data job's data set


def kinds(text: str | None, allowed: tuple[str, ...]) -> list[str]:
    """``--faults`` of a server job -> the kinds in turn (``server`` is kill, stop,
    partition; None: ``server``).

    Raises:
        ValueError: an unknown kind.
    """
    out = []
    for k in [k.strip() for k in (text or "server").split(",") if k.strip()]:
        if k not in allowed:
            raise ValueError(f"--faults: unknown kinds ['{k}']; the kinds are {','.join(allowed)}")
        out += list(_SERVER_FAULTS) if k == "server" else [k]
    if not out:
        raise ValueError("--faults: no fault kind given")
    return out


@dataclass
class ServerJob:
    """The shape of a server soak's job (``plan``) and the questions the soak asks of it."""

    job: str
    """``ps-sync``, ``ps-async`` or ``data``."""
    workers: int
    servers: int
    replicas: int
    worker_hosts: list[str]
    server_hosts: list[str]
    restarts: int = SERVER_RESTARTS
    """``--server-restarts`` of a parameter-server job (``restarts_for``)."""

    @property
    def kind(self) -> str:
        return "data" if self.job == "data" else "ps"

    def launcher_args(self) -> list[str]:
        if self.kind == "data":
            return ["--data-servers", str(self.servers)]
        return ["--servers", str(self.servers), "--ps-replicas", str(self.replicas),
                "--server-restarts", str(self.restarts)]

    def script_args(self, options, stop_file: str) -> list[str]:
        args = [sys.executable, "-m", "gradsync.bench.chaos_server_rank", "--job", self.kind,
                "--stop-file", stop_file, "--params", str(options.params),
                "--compute", f"{options.compute:g}"]
        if self.kind == "ps":
            args += ["--mode", self.job.split("-")[1]]
        else:
            args += ["--samples", str(_DATA_SAMPLES)]
        return args

    def server_pids(self, log: csr.ServerLog) -> dict[int, str]:
        """Server index -> the pid of its newest incarnation (its hello)."""
        out = {}
        for pid, rank in log.ranks.items():  # in the order of the hellos: newest last
            if rank >= self.workers:
                out[rank - self.workers] = pid
        return out

    def lost_data_servers(self, log: csr.ServerLog) -> set[int]:
        return {d for _, _, d in log.lost}

    def whole(self, log: csr.ServerLog) -> bool:
        """Every server up (a parameter server: every shard's newest view holds its R
        copies and each server's newest incarnation is alive; a data server: every one not
        given up is alive)."""
        pids = self.server_pids(log)
        if self.kind == "data":
            live = set(range(self.servers)) - self.lost_data_servers(log)
            return all(s in pids and alive(int(pids[s])) for s in live)
        if len(pids) < self.servers or not all(alive(int(p)) for p in pids.values()):
            return False
        newest: dict[int, tuple[int, ...]] = {}
        for _, shard, _, members in sorted(log.views):
            newest[shard] = members
        return all(len(members) >= self.replicas for members in newest.values())

    def steady(self, log: csr.ServerLog, since: float) -> bool:
        """Whole, and every worker has made 3 steps since ``since`` and since the job last
        changed (a view, a data server given up)."""
        if not self.whole(log):
            return False
        counts = self._steps_since_change(log, since)
        return len(counts) == self.workers and min(counts.values()) >= 3

    def settled(self, log: csr.ServerLog, since: float) -> bool:
        """Every worker has made a step since ``since`` and since the job last changed (a
        view, a data server given up): what the report needs to measure a fault's recovery
        (``chaos_server_report.outcome``: each worker's first step after the fault was known),
        whether or not the lost server's copy is back yet. A data server given up by one
        worker must be given up by every worker first."""
        if self.kind == "data":
            workers = {st.worker for st in log.base.steps}
            given_up = {(worker, d) for _, worker, d in log.lost}
            if any((w, d) not in given_up for w in workers for d in self.lost_data_servers(log)):
                return False
        return len(self._steps_since_change(log, since)) == self.workers

    def _steps_since_change(self, log: csr.ServerLog, since: float) -> Counter:
        """Each worker's steps (of the latest ones) since ``since`` and since the job last
        changed (a view, a data server given up)."""
        changed = max([since] + [v[0] for v in log.views] + [x[0] for x in log.lost])
        return Counter(st.worker for st in log.base.steps[-50 * self.workers:]
                       if st.wall > changed)

    def target(self, log: csr.ServerLog, hits: dict[int, int], rng) -> int | None:
        """The server the next fault hits: one hit least so far; None when none may be hit
        (a data-server job with one data server left; parameter servers all started again
        ``restarts`` times already)."""
        candidates = sorted(self.server_pids(log))
        if self.kind == "data":
            candidates = [s for s in candidates if s not in self.lost_data_servers(log)]
            if len(candidates) < 2:
                return None
        else:  # one the launcher would not start again would leave its shard short for good
            starts = Counter(rank - self.workers for rank in log.ranks.values())
            candidates = [s for s in candidates if starts[s] <= self.restarts]
        if not candidates:
            return None
        fewest = min(hits.get(s, 0) for s in candidates)
        return rng.choice([s for s in candidates if hits.get(s, 0) == fewest])

    def stop_text(self, log: csr.ServerLog) -> str:
        """What the stop file says: a data job ends after the next epoch (every worker ends
        with the same whole epoch); a parameter-server job reads only that it exists."""
        if self.kind != "data":
            return ""
        return str(max((st.e for st in log.base.steps), default=0) + 1)


def restarts_for(seconds: float, every: float, servers: int, count: int = 0) -> int:
    """``--server-restarts`` for a soak of ``seconds`` with a fault every ``every`` seconds
    (or of ``count`` faults, ``--count``) on ``servers`` parameter servers: each fault may cost
    its server one start (a killed one, and a stopped or cut-off one that wakes excluded and
    exits), the faults go to the server hit least, so each is hit at most
    ``ceil(faults / servers)`` times; one more for slack, and never below the launcher's
    default."""
    faults = count if count > 0 else int(seconds // every) + 1 if every > 0 else 1
    return max(SERVER_RESTARTS, -(-faults // max(1, servers)) + 1)


def data_samples() -> int:
    """Rows of the data-server job's data set (its samples-exactly-once check counts them)."""
    return _DATA_SAMPLES


def plan(options, hosts: int) -> ServerJob | None:
    """The server job that ``options`` ask for, on ``hosts`` emulated hosts; None for the
    elastic worker job.

    Raises:
        ValueError: both kinds of server asked for, too few hosts, replicas that do not
            divide the servers.
    """
    servers, data = options.servers or 0, options.data_servers or 0
    if not servers and not data:
        return None
    if servers and data:
        raise ValueError("--servers and --data-servers: one kind of server job at a time")
    count = servers or data
    if hosts - count < 1:
        raise ValueError(f"--hosts {hosts} leaves no host for the workers: each of the "
                         f"{count} servers gets a host of its own")
    replicas = options.ps_replicas if servers else 1
    if servers and (replicas < 1 or servers % replicas):
        raise ValueError(f"--ps-replicas {replicas} must divide --servers {servers}")
    if data and data < 2:
        raise ValueError("--data-servers needs 2 or more: a lost data server's share is "
                         "served by the others")
    names = [f"h{i}" for i in range(hosts)]
    return ServerJob("data" if data else f"ps-{options.ps_mode}",
                     (hosts - count) * options.ranks_per_host, count, replicas,
                     names[:hosts - count], names[hosts - count:],
                     restarts_for(60 * options.minutes, options.every, count, options.count))

