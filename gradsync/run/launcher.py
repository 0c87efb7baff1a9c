"""``gradsync run``: starts the ranks of one job, forwards their output, ends the job as one.

A job goes through five steps:

1. **Place.** Ranks fill the hosts in the order given, host 1's slots first: with
   ``-H a:2,b:2 -np 3`` ranks 0 and 1 run on ``a`` (local ranks 0, 1) and rank 2 on ``b``
   (local rank 0). A rank's *cross rank* is the index of its host among the hosts that have a
   rank with the same local rank (Horovod's definition): rank 2 has cross rank 1 of 2, rank 1
   cross rank 0 of 1.
2. **Store.** The launcher hosts torch's TCPStore for the rendezvous, in itself or, in a
   ``forkserver`` job, in the template's store keeper, its child (``forkserver.py``: the
   launcher then never imports torch). It outlives every rank, so the death of rank 0 does
   not take the store (and the job's abort record) with it.
3. **Start.** Each rank gets its identity as ``GRADSYNC_*`` variables (``launch_env`` reads
   them), and as horovodrun's ``HOROVOD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``,
   ``_CROSS_RANK``, ``_CROSS_SIZE`` and ``HOROVOD_HOSTNAME`` (the host's name as listed), so
   a script written for horovodrun runs unchanged. A local rank is a child in a new session,
   so ``killpg`` reaches everything it started. A remote rank runs under ``ssh`` (see
   *Remote ranks*).
4. **Watch.** The first rank to exit non-zero or die by a signal ends the job: every rank's
   process group gets SIGTERM, then SIGKILL after ``stop_grace`` seconds. So does SIGINT,
   SIGTERM or SIGHUP sent to the launcher (a second one skips the grace).
5. **Exit** with the failed rank's status (128 + signal number for a signal, as a shell does),
   128 + the signal the launcher received, or 0 when every rank exited 0.

Parameter-server jobs (``servers`` > 0): the ``num_proc`` workers are ranks ``0 .. num_proc - 1``
and the servers the last ``servers`` ranks, placed after them like any rank. The workers run
the job's command; each server runs the server entry point, ``python -m gradsync.ps``
(``server_entry``: the job's interpreter when the command starts with one, else the
launcher's), not the user's script, which a server does not need: the first worker's hello
tells it the model. Every rank learns the split from ``GRADSYNC_SERVERS``. The servers hold
the model, so a failing server ends the job as above; a failing worker does not (the others
can go on without it): the launcher reports it at once, waits for every rank to end, and then
exits with the status of the first worker that failed. Servers end by themselves once every worker has said
goodbye or died; servers still running ``SERVER_LINGER`` seconds after the last worker ended
(workers that died before reaching their servers, or a script that never used them) are
stopped, so that such a job cannot hang. With replicas (``ps_replicas`` > 1) a failing server
does not end the job either: it is reported and started again (``server_restarts`` times at
most), and the new process joins its shard with a copy (``ps/join.py``). A server that its
shard fenced out while it is silent (stopped, hung or cut off), which would end only once it
wakes, is killed and replaced at once: the launcher reads the views and beat counters from its
store (``server_watch.py``).

Data-server jobs (``data_servers`` > 0, ``gradsync.data``): the data servers are the last
``data_servers`` ranks, after the workers and any parameter servers, and learn their role from
``GRADSYNC_DATA_SERVERS``. They run the job's command, since what they serve is the user's
code (the data set, its transform and collate, built by the script's ``gradsync.data.Loader``
call, which serves and ends the process there). A failing data server does not end the job
(the workers hand its share to the others): it is reported at once, and the job's status at
the end is that of the first rank that failed, as for a parameter-server job's workers. A failing worker ends the job
as in step 4, unless the job has parameter servers. Data servers end once every worker has
disconnected; those still running ``SERVER_LINGER`` seconds after the last worker ended are
stopped, as servers are.

Output: every line a rank writes goes to the launcher's stdout or stderr as
``[<rank>]<stdout>:<line>`` or ``[<rank>]<stderr>:<line>`` (horovodrun's format), or as it
is with ``output_prefix=False``. Whole lines are written under one lock, so lines of different
ranks never interleave; a final line without a newline gets one. Python ranks run with
``PYTHONUNBUFFERED=1`` (unless set otherwise) so their lines arrive as they are printed and are
not lost in a buffer when the job is stopped.

When the ranks log at INFO or DEBUG (``--log-level``, or ``GRADSYNC_LOG_LEVEL`` /
``HOROVOD_LOG_LEVEL`` for them or here), the launcher also says, once the ranks have started,
which process each rank is: ``gradsync run: rank 1 (worker) on host a: pid 4242``, so that a
profiler (``py-spy dump --pid``) or a signal can reach the rank that is slow; a parameter
server's line ends with its entry point (``..., pid 4243, python -m gradsync.ps``). The pid is
that of the process started (the command's); a remote rank's is ssh's here, and the rank's own
INFO line (``world.py``) names its pid on its host.

Remote ranks run under ``ssh`` with a *lifeline* (``processes.py``): the job secret travels on
ssh's stdin, never on a command line, and when that stdin closes (the launcher stops the job,
dies, or loses the connection) the remote rank's process group is stopped, so a remote rank
never outlives its job. Remote ranks see only their identity, the ``-x`` variables and the
launcher's ``GRADSYNC_*`` and ``HOROVOD_*`` settings (``config.py`` maps the latter), as
under ``mpirun -x``; local ranks inherit the launcher's whole environment.

This job and an elastic one (``elastic.py``) are two policies of one job loop (``loop.py``:
signals, the poll, the end that stops every rank, the job file, /dev/shm); this module's
``_Job`` is the static policy and ``launch`` runs it. The pieces both policies share live in
``ranks.py`` and keep their public names here: ``place`` and ``Slot``, ``LaunchSpec``,
``Starter`` (starts a rank with its identity and the command of its role, here or over ssh;
its ``ssh`` also checks hosts), ``store_address`` and ``start_store``, ``Rank`` (a started
rank), ``informs`` and ``rank_line``. The process mechanics under them (new sessions,
stopping, output, signals, ssh) are ``processes.py``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, BinaryIO

from . import binding
from .hosts import Host
from .keeper import StoreKeeper
from .loop import End, JobLoop
from .processes import (DEFAULT_START_TIMEOUT, STOP_GRACE, HostChecks, Output, StartError,
                        describe, exit_status)
from .ranks import (SERVER_LINGER, SERVER_MODULE, LaunchSpec, Rank, Slot, Starter,
                    forwarded_settings, informs, is_local, place, rank_line, restart_allowed,
                    server_entry, start_store, store_address)

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    # Imported where it runs: it loads the parameter servers' package.
    from .server_watch import ServerWatch

__all__ = ["Host", "Slot", "LaunchSpec", "place", "launch", "is_local", "STOP_GRACE",
           "SERVER_LINGER", "DEFAULT_START_TIMEOUT", "Rank", "Starter", "store_address",
           "start_store", "forwarded_settings", "informs", "rank_line", "server_entry",
           "SERVER_MODULE"]

_POLL = 0.05  # how often the start looks at the hosts' ssh checks
_REAP = 5.0  # seconds to wait for a killed local server to be gone before its replacement


def launch(spec: LaunchSpec, stdout: BinaryIO | None = None,
           stderr: BinaryIO | None = None) -> int:
    """Runs the job described by ``spec`` to its end and returns the launcher's exit status.

    Signal handling (SIGINT, SIGTERM, SIGHUP stop the job) is only installed when this is
    called from the main thread.

    Args:
        spec: the job.
        stdout, stderr: binary streams for the ranks' output and the launcher's messages;
            the process's own by default.

    Raises:
        ValueError: the hosts cannot hold ``spec.size`` ranks.
    """
    slots = place(spec.hosts or [Host("localhost", spec.size)], spec.size)
    output = Output(spec.output_prefix, stdout or sys.stdout.buffer,
                    stderr or sys.stderr.buffer, directory=spec.output_filename,
                    width=len(str(spec.size - 1)))
    return _Job(spec, slots, output).run()


class _Job(JobLoop):
    """The static job's policy in the launcher's job loop (``loop.py``): every rank placed and
    started at once; see the module docstring for what a failure does."""

    starter: Starter  # made in __init__

    def __init__(self, spec: LaunchSpec, slots: list[Slot], output: Output):
        super().__init__(spec, output)
        self.slots = slots
        self.remote_hosts = list(dict.fromkeys(s.host for s in slots if not is_local(s.host)))
        self.starter = Starter(spec, output, store_address(self.remote_hosts))
        self.ranks: list[Rank] = []
        self.cores: "list[list[int]] | None" = None  # CPUs of each local rank, when bound
        # The job's store, held for the whole run: a TCPStore hosted here where the server
        # watch reads it, else a store keeper, forked or exec'd (Starter.host_store).
        self.store: TCPStore | StoreKeeper | None = None
        self.store_port = 0
        self.restarts: dict[int, int] = {}  # replicated servers started again, by rank
        self.failed: list[tuple[int, str, str]] = []  # ranks that failed and let the job go on
        self.seen: set[int] = set()  # their indices (a restarted server's failure is new)
        self.workers_ended: float | None = None  # when the last worker of a server job ended
        # A replicated job's watch on its views (server_watch.py), and the server processes it
        # replaced before they ended: no longer the ranks' own, still stopped at the end.
        self.watch: ServerWatch | None = None
        self.replaced: list[Rank] = []
        self._next_look = 0.0
        self._watch_warned = ""

    def begin(self) -> None:
        self._check_hosts()
        self._plan_binding()
        watched = bool(self.spec.servers and self.spec.ps_replicas > 1 and
                       self.spec.server_restarts)
        self.store = self.host_store(len(self.slots), client=watched)
        self.store_port = self.store.port
        if watched:
            # Imported here: the parameter servers' package loads numpy and their client, which
            # no other job needs.
            from ..cluster.rendezvous import Store
            from .server_watch import ServerWatch

            self.watch = ServerWatch(Store.over(self.store, self.starter.job_id, 30.0),
                                     self.spec.servers, self.spec.ps_replicas)
        for slot in self.slots:
            if self.interrupts.received is not None:
                break
            cores = None if self.cores is None else self.cores[slot.local_rank]
            self.ranks.append(self.starter.start(slot, self.store_port, len(self.slots), cores))
        if isinstance(self.store, StoreKeeper):  # serving by now? (no need to wait for it
            # once every rank ended without it)
            self.store.ready(cancelled=lambda: self.interrupts.received is not None or
                             all(rank.proc.poll() is not None for rank in self.ranks))
        if informs(self.spec):
            for rank in self.ranks:
                self.output.message(rank_line(rank, self._role(rank.slot.rank)))
            if isinstance(self.store, StoreKeeper):  # one more process of the job's
                self.output.message(f"the job's store: port {self.store_port}, kept by pid "
                                    f"{self.store.process.pid} (the store keeper)")

    def started(self) -> list[Rank]:
        return self.ranks + self.replaced

    # ------------------------------------------------------------------ start
    def _plan_binding(self) -> None:
        """Which cores the ranks started here get (``binding.py``)."""
        here = [slot for slot in self.slots if is_local(slot.host)]
        if here:
            try:
                self.cores = binding.plan(self.spec.bind_to, here[0].local_size)
            except ValueError as exc:
                raise StartError(str(exc), 2) from None

    def _check_hosts(self) -> None:
        """Runs ``true`` on each remote host first, so that an unreachable host is reported
        by name before any rank starts, instead of as one rank's ssh failure."""
        checks = HostChecks(self.starter.ssh)
        try:
            for host in self.remote_hosts:
                checks.start(host)
            while checks and self.interrupts.received is None:
                for _, error, code in checks.collect():
                    if error is not None:  # the first host found wrong is reported
                        raise StartError(error, code)
                if checks:
                    time.sleep(_POLL)
        finally:
            checks.end()

    # ------------------------------------------------------------------ watch
    def turn(self) -> End | None:
        """One look at the ranks: the end once every rank ended or one stopping the job
        failed. A failed worker of a parameter-server job, a failed data server or a failed
        replicated server (started again) is reported, not stopping.

        Returns:
            None while the job runs; else the exit status, the summary line (None for
            success) and what the ranks that the stop finds running are called in it:
            "other " when the summary is about one rank, None when every rank ended by
            itself (nothing to count).
        """
        running = False
        for rank in self.ranks:
            code = rank.proc.poll()
            if code is None:
                running = True
            elif code != 0 and rank.slot.rank not in self.seen:
                who, what = self._failure(rank, code)
                index = rank.slot.rank
                data_server = index >= self.spec.size - self.spec.data_servers
                # With replicas, a lost parameter server's shards live on elsewhere.
                copied = self.spec.ps_replicas > 1 and not data_server and \
                    index >= self.spec.num_proc
                if not data_server and not copied and (
                        not self.spec.servers or index >= self.spec.num_proc):
                    return exit_status(code), f"{who} {what}", "other "
                self.seen.add(index)
                self.failed.append((exit_status(code), who, what))
                self.output.message(f"{who} {what}; the other ranks go on " + (
                    "(the other data servers serve its share)" if data_server else
                    "(its shards live on the other replicas)" if copied else
                    "(parameter-server job)"))
                if copied and self.workers_ended is None:
                    self._restart_server(rank, self.seen)
        if self.watch is not None and self.workers_ended is None:
            self._replace_stranded()
        if (self.spec.servers or self.spec.data_servers) and self.workers_ended is None and \
                all(r.proc.poll() is not None for r in self.ranks[:self.spec.num_proc]):
            self.workers_ended = time.monotonic()
        lingered = self.workers_ended is not None and \
            time.monotonic() - self.workers_ended > SERVER_LINGER
        if not running or lingered:
            linger = (f"; the servers were still running {SERVER_LINGER:g}s after the last "
                      f"worker ended and were stopped") if running else ""
            if not self.failed:
                return 0, (f"every worker ended{linger}" if linger else None), \
                    ("" if linger else None)
            status, who, what = self.failed[0]
            first = f", the first of {len(self.failed)} failed ranks" \
                if len(self.failed) > 1 else ""
            summary = f"{who} failed earlier ({what}){first}; the job ran to its end{linger}"
            return status, summary, ("" if linger else None)
        return None

    def _replace_stranded(self) -> None:
        """Every ``WATCH_EVERY`` seconds: kills each replicated server that its shard fenced
        out while it is silent (stopped, hung or cut off), and starts its replacement without
        waiting for the process to end, which it would only once woken (``server_watch.py``).
        """
        from .server_watch import WATCH_EVERY

        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + WATCH_EVERY
        watch = self.watch
        assert watch is not None  # the turn looks only with a watch
        try:
            stranded = watch.look()
        except Exception as exc:  # noqa: BLE001 (said once; the next look tries again)
            if str(exc) != self._watch_warned:
                self._watch_warned = str(exc)
                self.output.message(f"cannot read the parameter servers' views from the "
                                    f"launcher's store ({exc}); a silent server is replaced "
                                    f"only once its process ends")
            return
        for lost in stranded:
            index = self.spec.num_proc + lost.server
            rank = next(r for r in self.ranks if r.slot.rank == index)
            if rank.proc.poll() is not None or \
                    self.restarts.get(index, 0) >= self.spec.server_restarts:
                # It ended meanwhile (the next turn reports that and starts it again), or it
                # may not be started again: then it ends once it wakes, as any fenced server.
                watch.forget(lost.server)
                continue
            who = self._failure(rank, -signal.SIGKILL)[0]
            what = (f"was fenced out of shard {lost.view.shard} (view {lost.view.epoch}: "
                    f"{lost.view.why}) and has been silent for {lost.quiet:.1f}s: killed by the "
                    f"launcher")
            rank.signal(signal.SIGKILL)
            if not rank.remote:
                # Its replacement clears the shared-memory names this process left, which it
                # may do only once the process is gone (SIGKILL ends a stopped one too).
                try:
                    rank.proc.wait(_REAP)
                except subprocess.TimeoutExpired:
                    pass
            self.replaced.append(rank)
            self.seen.add(index)
            self.failed.append((128 + signal.SIGKILL, who, what))
            self.output.message(f"{who} {what}; the other ranks go on (its shards live on the "
                                f"other replicas)")
            self._restart_server(rank, self.seen, moved=True)

    def _restart_server(self, rank: Rank, seen: set[int], moved: bool = False) -> None:
        """Starts a failed replicated server's rank again (``spec.server_restarts`` times at
        most): the new process copies its shard from the shard's primary (``ps/join.py``).
        ``moved``: the old one was silent, its host maybe cut off: the new one starts on a
        host with room if there is one (``_replacement_slot``)."""
        index = rank.slot.rank
        if not restart_allowed(self.restarts, index, self.spec.server_restarts,
                               self.output.message, f"rank {index}"):
            return
        slot = self._replacement_slot(rank) if moved else rank.slot
        # A rank moved to another host was not in the binding's plan: it runs unbound.
        cores = None if self.cores is None or not is_local(slot.host) or slot is not \
            rank.slot else self.cores[slot.local_rank]
        if self.watch is not None:
            try:
                self.watch.restarted(index - self.spec.num_proc)
            except Exception as exc:  # noqa: BLE001 (said; the watch forgot the old process)
                self.output.message(f"cannot read the parameter servers' views from the "
                                    f"launcher's store ({exc})")
        try:
            position = self.ranks.index(rank)
            self.ranks[position] = self.starter.start(slot, self.store_port,
                                                      len(self.slots), cores)
        except StartError as exc:
            self.output.message(f"could not start a replacement for rank {index}: {exc}")
            return
        seen.discard(index)  # the replacement's own failure is reported again
        where = f" on host {slot.host}" if slot.host != rank.slot.host else ""
        self.output.message(f"rank {index} started again ({self.restarts[index]} of "
                            f"{self.spec.server_restarts}){where}: "
                            f"it joins its shard with a copy")
        if informs(self.spec):
            self.output.message(rank_line(self.ranks[position], self._role(index)))

    def _replacement_slot(self, rank: Rank) -> Slot:
        """Where a silent server's replacement starts: a host of the job with a free slot that
        holds no other copy of its shard and is not its own (which may be cut off), else its
        own slot (``server_watch.spare_host``)."""
        from ..ps.replication import members_of, shard_of
        from .server_watch import spare_host

        server, workers = rank.slot.rank - self.spec.num_proc, self.spec.num_proc
        shard = shard_of(server, self.spec.servers, self.spec.ps_replicas)
        others = {r.slot.host for r in self.ranks if r.slot.rank - workers in
                  members_of(shard, self.spec.servers, self.spec.ps_replicas)}
        # Hosts the job runs on only: they passed the check at the start, and the store's
        # address was chosen for them.
        mine = {s.host for s in self.slots}
        hosts = [h for h in (self.spec.hosts or [Host("localhost", self.spec.size)])
                 if h.name in mine]
        host = spare_host(hosts, [r.slot.host for r in self.ranks if r is not rank],
                          others | {rank.slot.host})
        if host is None:
            return rank.slot
        here = sum(1 for r in self.ranks if r is not rank and r.slot.host == host)
        # Its local rank is the next on that host; the cross rank only names a position
        # among the job's first placement, which a server does not use.
        return Slot(rank=rank.slot.rank, host=host, local_rank=here, local_size=here + 1,
                    cross_rank=0, cross_size=1)

    def _role(self, index: int) -> str:
        """``worker``, ``parameter server 1`` or ``data server 0``: what rank ``index`` is."""
        first_data = self.spec.size - self.spec.data_servers
        if index >= first_data:
            return f"data server {index - first_data}"
        if index >= self.spec.num_proc:
            return f"parameter server {index - self.spec.num_proc}"
        return "worker"

    def _failure(self, rank: Rank, code: int) -> tuple[str, str]:
        """Who failed and how, e.g. ("rank 5 (server 1) on host a", "exited with status 1")."""
        index, workers = rank.slot.rank, self.spec.num_proc
        first_data = self.spec.size - self.spec.data_servers
        if index >= first_data:
            name = f"rank {index} (data server {index - first_data})"
        elif not self.spec.servers:
            name = f"rank {index}"
        elif index < workers:
            name = f"worker rank {index}"
        else:
            name = f"rank {index} (server {index - workers})"
        what = describe(code)
        if rank.remote and code == 255:
            what += " (ssh returns 255 when the connection fails)"
        return f"{name} on host {rank.slot.host}", what


