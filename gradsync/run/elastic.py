"""``gradsync run --min-np/--max-np``: an elastic job, re-formed instead of stopped.

The launcher hosts the store and owns the job's *generations* (``gradsync.elastic.membership``):
who the workers are and in which rank order. This is a policy of the launcher's one job loop
(``loop.py``, which also runs the static job: signals, the end that stops every rank, the job
file, /dev/shm). It stands on two parts of its own, each one concern: ``generations.py``, the
launcher's side of the control plane (every store key the launcher writes or reads about
membership: publish, abort, exclude, ready, give up), and ``host_pool.py``, where workers may
run (listed, blacklisted, reachable, free slots). What stays here is the policy: when to
re-form and whom to list, and the workers' processes (start, watch, fail, retire). Each of its
turns, every ``loop.POLL`` seconds:

1. **Watch.** A worker of the newest generation that exits non-zero, or is reported silent by
   a heartbeat (the abort record of its World says ``silent``; the launcher SIGKILLs it), is
   *failed*: its host is blacklisted (``--blacklist-cooldown`` seconds, or for good) and, as
   in Horovod, every worker on that host leaves the job (the others are stopped: SIGTERM,
   SIGKILL after the stop grace). Any other abort record of the newest generation (a worker
   that could not connect, a timeout) also calls for a new generation, with the same workers.
2. **Discover.** ``--host-discovery-script`` is run every ``discovery_interval`` seconds; it
   prints ``host:slots`` (or ``host``) lines, as Horovod's does. A host is *usable* when it is
   listed, not blacklisted and, if it is not this machine, has passed its ssh check
   (``ssh host true``, run once when the host first appears; a host that fails it is
   blacklisted). Its free slots are its slots minus its live workers. Workers of a host that
   is no longer listed, or beyond the slots now listed for it, are stopped.
3. **Re-form.** New workers are started *first*, on free usable slots up to ``--max-np``
   (in the first generation: ``-np``): here as children, on other hosts over ssh exactly as
   ``gradsync run`` starts remote ranks (``ranks.Starter``: the secret on ssh's stdin, the
   lifeline that ends the remote worker when the launcher stops it or goes away). A new
   worker is listed only once it is *ready* (``elastic/ready/<id>``, written by ``init()``
   after the interpreter and torch have started): starting costs seconds, and the job trains
   on meanwhile. A new generation keeps the survivors in their old order, then the ready new
   workers. It is formed at once after a loss (without the new workers still starting: they
   join a later one), its loss posted into the abort record of the generations it replaces
   (survivors stop waiting at once); or, with no loss, once the new workers are ready (all
   of them, or those ready ``_READY_GRACE`` seconds before the others): then nothing is
   aborted, and the survivors reach it at their next ``commit()``
   (``HostsUpdatedInterrupt``), so a joiner costs the job only the re-formation. A new
   worker that exits, or is not ready within ``--start-timeout`` (default 120 s: it holds
   nobody up), is failed as any worker is. The first generation is published at once. With
   no survivor left there is no state to hand on, and the job ends (as Horovod's does).
4. **Limits.** Fewer than ``--min-np`` workers possible: the launcher waits up to
   ``--elastic-timeout`` seconds for discovery to offer hosts, then ends the job with an
   error naming the workers left and the blacklisted hosts. More than ``--reset-limit``
   re-formations: the job ends with an error. Either way the reason is written to the store
   (``failed``), which workers waiting for a generation raise as ``ElasticJobFailed``.
5. **End.** Once a worker has exited 0 the job is finishing: no more re-formations, and the
   new workers of a generation that the finished worker never joined are stopped (they would
   wait for it). The job ends when every worker has exited: status 0 when the last
   generation's workers all exited 0 (those stopped aside), else the first failure's status.

**Data servers** (``--data-servers D``, ``gradsync.data``) are not workers: they are started
once, before the first generation, on the hosts of ``--data-hosts`` (their ssh check passed
first: an unreachable data host ends the job before it starts) or else on this machine, and
serve every generation; they are in no generation, count in no ``--min-np``/``--max-np`` and
no ``WORLD_SIZE``, and are never blacklisted. A data host takes no worker, even when ``-H``
or the discovery script lists it. A failed data server is reported, started again on its
host (``--server-restarts``) and the job goes on; once every worker has ended they are told
to end (``data_servers.py``).

Hosts are the unit of failure, as in Horovod, except in a job given neither ``-H`` nor a
discovery script: that job runs on this machine alone, so there a failed worker leaves alone
(and the host takes no new workers). A discovery script may list ``localhost`` and
``127.0.0.1`` as two hosts, as Horovod's elastic tests do: both start workers locally, each is
its own host (``GRADSYNC_HOSTNAME``), and a failure on one blacklists only that one.

Every worker gets the same store address, fixed at the start: one the remote hosts known then
can reach, or, with a discovery script, the address of the default route (remote hosts may
come later).

Output lines are prefixed with the worker's first rank (``[3]<stdout>:``), which stays with the
process while its rank changes.
"""

from __future__ import annotations

import random
import signal
import sys
import time
from dataclasses import dataclass

from ..config import ENV_PREFIX
from .data_servers import DataServers
from .discovery import Discovery, parse_discovered
from .generations import Generations
from .host_pool import HostPool
from .hosts import Host
from .ranks import LaunchSpec, Rank, Slot, Starter, informs, is_local, rank_line, store_address
from .loop import End, JobLoop
from .processes import Output, StartError, describe, exit_status

__all__ = ["ElasticSpec", "launch_elastic", "parse_discovered"]

_LOST_GRACE = 5.0  # seconds a worker reported lost may take to exit before it is killed
# A new worker that is not ready holds nobody up (the job trains on without it), so this limit
# only frees its slot: generous, for a loaded machine where importing torch takes tens of
# seconds. --start-timeout, when given, replaces it.
_READY_TIMEOUT = 120.0
# New workers started together are ready within a second or two of each other (their imports
# compete for the same cores); waiting that long for the slower ones costs the job one
# re-formation instead of several, and a much slower one does not hold the others back.
_READY_GRACE = 2.0


@dataclass(frozen=True, kw_only=True)
class ElasticSpec:
    """The elastic options of ``gradsync run``."""

    min_np: int
    """Fewest workers the job may run with."""
    max_np: int
    """Most workers the job may run with."""
    discovery_script: str | None = None
    """Command printing ``host:slots`` lines; None: the hosts of ``-H`` (or localhost)."""
    discovery_interval: float = 1.0
    """Seconds between runs of the discovery script."""
    reset_limit: int | None = None
    """Most re-formations (generations after the first); None: no limit."""
    elastic_timeout: float = 600.0
    """Seconds to wait for hosts while below ``min_np`` (also the workers' wait)."""
    blacklist_cooldown: float | None = None
    """Seconds a failed host stays blacklisted; None: for good."""
    blacklist_cooldown_range: tuple[float, float] | None = None
    """(low, high): a failed host stays out ``low * 2**n`` seconds plus up to ``low`` more
    at its n-th failure, kept within [low, high] (horovodrun's ``--blacklist-cooldown-range``,
    the same rule); None: ``blacklist_cooldown``."""
    data_hosts: tuple[Host, ...] = ()
    """Hosts that run the data servers (``--data-hosts``), filled in order, and never a
    worker, even when ``-H`` or the discovery script lists them; empty: the data servers run
    on this machine."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_np <= self.max_np:
            raise ValueError(f"need 1 <= --min-np <= --max-np, got {self.min_np} and "
                             f"{self.max_np}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError(f"--reset-limit must be >= 0, got {self.reset_limit}")
        if self.elastic_timeout <= 0 or self.discovery_interval <= 0:
            raise ValueError("--elastic-timeout and the discovery interval must be positive")
        if self.blacklist_cooldown is not None and self.blacklist_cooldown < 0:
            raise ValueError(f"--blacklist-cooldown must be >= 0, got {self.blacklist_cooldown}")
        if self.blacklist_cooldown_range is not None:
            low, high = self.blacklist_cooldown_range
            if self.blacklist_cooldown is not None:
                raise ValueError("give --blacklist-cooldown or --blacklist-cooldown-range, "
                                 "not both")
            if not 0 < low <= high:
                raise ValueError(f"--blacklist-cooldown-range needs 0 < MIN <= MAX, got {low:g} "
                                 f"{high:g}")
        names = [h.name for h in self.data_hosts]
        if len(set(names)) < len(names):
            raise ValueError(f"--data-hosts names a host twice: {', '.join(names)}")

    def cooldown(self, failures: int) -> float | None:
        """Seconds a host stays blacklisted at its ``failures``-th failure; None: for good."""
        if self.blacklist_cooldown_range is None:
            return self.blacklist_cooldown
        low, high = self.blacklist_cooldown_range
        # Backing off exponentially, with jitter so that hosts that failed together do not
        # all come back in the same second.
        delay = low * (1 << min(failures, 32)) + random.uniform(0, low)
        return max(low, min(high, delay))


@dataclass
class _Worker:
    id: str
    host: str
    rank: Rank | None  # None until ``_start`` starts it
    first_rank: int
    failed: bool = False
    retired: bool = False  # stopped by the launcher: its host was blacklisted or removed
    started: float = 0.0  # time.monotonic() at its start
    ready_at: float | None = None  # when it announced readiness (new workers only)

    @property
    def started_rank(self) -> Rank:
        """``rank``, of a worker that ``_start`` started: every worker the job holds (in
        ``workers``, ``pending`` or a generation) was started before it was held there."""
        assert self.rank is not None
        return self.rank


@dataclass
class _State:
    resets: int = 0
    finishing: bool = False
    short_since: float | None = None  # when the job first lacked min_np workers
    first_failure: int | None = None  # exit status of the first failed worker


class _ElasticJob(JobLoop):
    """The elastic job's policy in the launcher's job loop (``loop.py``); see the module
    docstring."""

    count_stopped = False  # its end says nothing of the workers it stops

    starter: Starter | None  # made by begin()

    def __init__(self, spec: LaunchSpec, elastic: ElasticSpec, output: Output):
        super().__init__(spec, output)
        self.elastic = elastic
        # A job given no hosts runs on this machine alone: there a failed worker leaves alone,
        # since removing every worker of the host would end the job.
        self.per_worker = not spec.hosts and not elastic.discovery_script
        self.port = 0
        # Where workers may run (listed, blacklisted, reachable: host_pool.py) and what the
        # workers are told (the control plane: generations.py).
        self.pool = HostPool(list(spec.hosts) or [Host("localhost", spec.num_proc)],
                             elastic.data_hosts, elastic.cooldown, output)
        self.generations: Generations[_Worker] = Generations(output.message)
        self.workers: list[_Worker] = []
        self.state = _State()
        self._counter = 0
        self._suspects: dict[str, float] = {}
        self.pending: list[_Worker] = []  # new workers started, in no generation yet
        self._unsettled = False  # a lost worker is reported and may not be listed again yet
        self.ready_timeout = spec.start_timeout or _READY_TIMEOUT
        self.informs = informs(spec)  # the ranks log at INFO: say which process is which
        self.data_servers: DataServers | None = None  # made once the store is up

    # ------------------------------------------------------------------ the run
    def begin(self) -> None:
        if self.elastic.discovery_script:
            self.pool.discovery = Discovery(self.elastic.discovery_script,
                                            self.elastic.discovery_interval,
                                            self.output).start()
        # Every worker of every generation gets the same store address: one that the remote
        # hosts known now reach, or with a discovery script (remote hosts may come later) one
        # that other hosts can reach.
        remote_hosts = [h.name for h in [*self.pool.listed(), *self.elastic.data_hosts]
                        if not is_local(h.name)]
        self.starter = Starter(
            self.spec, self.output,
            store_address(remote_hosts, reachable=self.pool.discovery is not None),
            settings={ENV_PREFIX + "ELASTIC_TIMEOUT": f"{self.elastic.elastic_timeout:g}"})
        self._server = self.host_store(self.spec.num_proc)
        self.port = self._server.port
        self.generations.host(self._server, self.starter.job_id, self.port)
        # Before the first generation, so that it can place workers on the remote hosts.
        self.pool.check_first(self.starter.ssh, lambda: self.interrupts.received is not None)
        self.data_servers = DataServers(self.spec, self.starter, self.output,
                                        self._server, self.port)
        if self.elastic.data_hosts and self.spec.data_servers:
            unreachable = [h.name for h in self.elastic.data_hosts
                           if not is_local(h.name) and h.name not in self.pool.reachable]
            if unreachable:
                # Started once, the data servers have no other host to go to.
                raise StartError(f"data host(s) {', '.join(unreachable)} cannot be reached "
                                 "over ssh: the data servers cannot start", 255)
            self.data_servers.start(self.elastic.data_hosts)
        else:
            # On this machine, under its name in the hosts given, so that its workers map the
            # data servers' slots (one memcpy per batch).
            self.data_servers.start([Host(next((h.name for h in self.pool.listed()
                                                if is_local(h.name)), "localhost"),
                                          self.spec.data_servers)])
        self._form(first=True)
        self.pool.news()  # the first generation was formed on discovery's answer now

    # What begin() made, for the turns: the loop turns only once begin() returned.
    @property
    def _starter(self) -> Starter:
        assert self.starter is not None
        return self.starter

    def started(self) -> list[Rank]:
        return [w.rank for w in self.workers if w.rank is not None] + \
            (self.data_servers.ranks if self.data_servers else [])

    def ending(self, status: int, summary: str | None) -> None:
        self.pool.end()
        if summary and self.generations.control is not None and status != 0:
            try:
                self.generations.give_up(summary)
            except (RuntimeError, OSError):
                pass

    def turn(self) -> End | None:
        st = self.state
        changed = self._watch()  # the newest generation must be replaced now
        data_servers = self.data_servers
        assert data_servers is not None  # made by begin()
        data_servers.watch(restart=not st.finishing)
        self._watch_new()
        grow = False  # room for new workers: start them; they join once ready
        reachable = self.pool.probe(self._starter.ssh)
        if self.pool.news():
            if not st.finishing and self._unlisted():
                changed = True
            reachable = True
        if reachable and not st.finishing and \
                len(self._placed()) < self.elastic.max_np and self._free_slots():
            grow = True
        if self.pool.cooled_down() and len(self._placed()) < self.elastic.max_np:
            grow = True
        if st.short_since is not None:
            changed = True  # keep trying while short of workers
        if changed and st.finishing:
            self.generations.give_up("a worker failed after another had finished: the job "
                                     "is not re-formed any more")
        elif st.finishing:
            for worker in self._alive(self.pending):
                self._retire(worker, "the job is finishing")
            self._end_unformed()
        elif changed or grow or self.pending or \
                len(self._alive(self.generations.members)) < len(self.generations.members):
            done = self._form(first=False, now=changed)
            if done is not None:
                return (*done, None)
        end = self._loop_end()
        if end is not None:
            return (*data_servers.end(*end, interrupted=lambda: self.interrupts.received),
                    None)
        return None

    def _loop_end(self) -> tuple[int, str | None] | None:
        """The job's status once every worker has exited (None before): 0 when the last
        generation's workers all exited 0 (those the launcher stopped aside)."""
        if not self.workers or any(w.started_rank.proc.poll() is None for w in self.workers):
            return None
        ended = [w for w in self.generations.members if not w.retired]
        if ended and all(w.started_rank.proc.returncode == 0 for w in ended):
            return 0, None
        return self.state.first_failure or 1, "the elastic job ended with failed workers"

    def _end_unformed(self) -> None:
        """Stops the new workers of a newest generation that can never form: one of its
        members exited 0 (it finished training in an older generation, before it saw this
        one), and the new workers would wait for it until the elastic timeout. They have
        trained nothing, so nothing is lost. Only when the generation's address table is
        unpublished (a member that trained in it has read it). Its other old members finish
        in the older generation as the one that exited did: they passed the same commits,
        whose host check is one broadcast, so they saw no newer generation either."""
        gens = self.generations
        done = [w for w in gens.members if not w.retired and w.started_rank.proc.poll() == 0]
        older = set(map(id, gens.of(gens.gen - 1)))
        new = [w for w in self._alive(gens.members) if id(w) not in older]
        if not done or not new:
            return
        if gens.formed() is not False:
            return  # formed, or the store did not answer (ours: the next poll asks again)
        for worker in new:
            self._retire(worker, f"the job is finishing: worker {done[0].id} ended before "
                                 f"generation {gens.gen} formed, which cannot form without it")

    # ------------------------------------------------------------------ watching
    def _alive(self, workers: list[_Worker]) -> list[_Worker]:
        return [w for w in workers
                if not w.failed and not w.retired and w.started_rank.proc.poll() is None]

    def _placed(self) -> list[_Worker]:
        """The live workers of the newest generation, then the new ones not yet in one."""
        return self._alive(self.generations.members) + self._alive(self.pending)

    def _watch_new(self) -> None:
        """Follows the new workers not yet in a generation: notes when each is ready; one
        that exits, or is not ready within the ready timeout (it is killed), is failed like
        any worker (its host blacklisted). Neither holds up the job, which trains on."""
        now = time.monotonic()
        for worker in list(self.pending):
            code = worker.started_rank.proc.poll()
            if worker.failed or worker.retired or code is not None:
                self.pending.remove(worker)
                if code not in (None, 0) and not worker.failed and not worker.retired:
                    self._fail(worker, f"new worker {worker.id} {describe(code)} before it "
                                       "joined the job", exit_status(code))
                continue
            if worker.ready_at is not None:
                continue
            if self.generations.is_ready(worker.id):
                worker.ready_at = now
            elif now - worker.started > self.ready_timeout:
                worker.started_rank.signal(signal.SIGKILL)
                self.pending.remove(worker)
                self._fail(worker, f"new worker {worker.id} was not ready to join within "
                                   f"{self.ready_timeout:g}s; killed", 128 + 9)

    def _note_exits(self) -> bool:
        """Fails every member of the newest generation that has exited non-zero (its host
        blacklisted), and notes one that exited 0 (the job is finishing); True when one failed.

        Called by ``_watch`` and again by ``_form`` just before it counts survivors: a member
        can exit between the two (a SIGKILLed worker whose peers' abort record came first),
        and a survivor count that merely skipped it would re-form the job without failing it,
        so its host's other workers would stay in the job and its host never be
        blacklisted."""
        gens, failed = self.generations, False
        for worker in gens.members:
            code = worker.started_rank.proc.poll()
            if code is None or worker.failed or worker.retired:
                continue
            if code == 0:
                self.state.finishing = True
                continue
            self._fail(worker, f"worker {worker.id} (rank {gens.members.index(worker)} of "
                               f"generation {gens.gen}) {describe(code)}", exit_status(code))
            failed = True
        return failed

    def _watch(self) -> bool:
        """Marks failed members; True when the newest generation needs replacing."""
        gens = self.generations
        self._unsettled = False
        changed = self._note_exits()
        for gen in gens.watched():
            record = gens.read_abort(gen)
            if record is None or record.get("rank") == -1:
                continue  # (rank -1: the launcher's own record of a loss)
            members = gens.of(gen)
            peer = record.get("peer")
            if gen == gens.gen:
                settled = self._lost_peer_settled(members, peer)
                self._unsettled = not settled
                changed = settled or changed
            if record.get("silent") and peer is not None and 0 <= peer < len(members):
                victim = members[peer]
                if not victim.failed and not victim.retired:
                    victim.started_rank.signal(signal.SIGKILL)
                    self._fail(victim, f"worker {victim.id} (rank {peer} of generation {gen}) "
                                       "sent no heartbeats and was killed", 128 + 9,
                               detail=record.get("message"))
                    changed = True
        return changed

    def _lost_peer_settled(self, members: list[_Worker], peer: int | None) -> bool:
        """Whether the newest generation can be replaced after a worker reported ``peer``
        lost: at once when the peer has exited (or none is named); else only after it exits,
        or after ``_LOST_GRACE`` seconds, when it is killed (its peers have given up on it,
        so it could never rejoin them). This keeps a dying worker out of the next
        generation."""
        if peer is None or not 0 <= peer < len(members):
            return True
        suspect = members[peer]
        if suspect.failed or suspect.retired:
            return True
        code = suspect.started_rank.proc.poll()
        if code is not None:
            # It exited after this poll's look at the members: fail it now, or the generation
            # formed next would see its host unblacklisted and a free slot in its place.
            if code != 0:
                self._fail(suspect, f"worker {suspect.id} (rank {peer} of generation "
                                    f"{self.generations.gen}) {describe(code)}",
                               exit_status(code))
            return True
        since = self._suspects.setdefault(suspect.id, time.monotonic())
        if time.monotonic() - since < _LOST_GRACE:
            return False
        suspect.started_rank.signal(signal.SIGKILL)
        self._fail(suspect, f"worker {suspect.id} was reported lost by its peers and had not "
                            f"exited {_LOST_GRACE:g}s later; killed", 128 + 9)
        return True

    def _fail(self, worker: _Worker, what: str, status: int, detail: str | None = None) -> None:
        """Marks ``worker`` failed and blacklists its host; as in Horovod, the host's other
        workers leave the job too (unless the job is this machine alone: ``per_worker``).
        ``detail``: what its peers reported, for the worker to read if it comes back."""
        worker.failed = True
        if self.state.first_failure is None:
            self.state.first_failure = status
        self.generations.exclude(worker.id, what + (f" ({detail})" if detail else ""))
        self.pool.ban(worker.host, what)
        if not self.per_worker:
            for other in self._alive(self.workers):
                if other.host == worker.host:
                    self._retire(other, f"host {worker.host} is blacklisted")

    def _retire(self, worker: _Worker, why: str) -> None:
        """Stops a worker that is no longer wanted: SIGTERM now (over ssh: its lifeline),
        SIGKILL after the stop grace (the loop's ``stop_one``). Its exit is not a failure."""
        worker.retired = True
        self.generations.exclude(worker.id, f"stopped by gradsync run: {why}")
        self.stop_one(worker.started_rank)
        self.output.message(f"stopping worker {worker.id}: {why}")

    def _unlisted(self) -> list[_Worker]:
        """Live workers (of the newest generation, or new ones) whose host discovery no longer
        lists, or that are beyond the slots it now lists for their host (the last ones on the
        host: new workers first)."""
        return self.pool.beyond(self._placed())

    # ------------------------------------------------------------------ forming
    def _free_slots(self) -> list[str]:
        """One entry per free slot of a usable host (``HostPool.free``). A worker holds its
        slot until the launcher has noted its end (failed or retired it): one whose exit 0 is
        not yet noted must not make room for a new worker, which the finishing job would only
        stop again."""
        return self.pool.free([w.host for w in self.workers if not w.failed and not w.retired])

    def _form(self, first: bool, now: bool = False) -> tuple[int, str] | None:
        """Starts new workers on free slots and forms the next generation when it should:
        the first one at once; later ones at once when ``now`` (the newest generation must be
        replaced) or a member was lost, else once new workers are ready (``_ready``). Only
        ready new workers are listed: one still starting joins a later generation, so that
        neither the survivors of a loss nor a running job wait for a process to start.
        Returns (status, reason) to end the job."""
        st, el = self.state, self.elastic
        for worker in self._unlisted():
            self._retire(worker, f"host {worker.host} is no longer listed by the discovery "
                                 "script (or with fewer slots)")
        if not first:
            self._note_exits()
            if st.finishing:
                return None  # a worker has ended: nobody starts, no generation forms
        members = self.generations.members
        survivors = self._alive(members)
        pending = self._alive(self.pending)
        now = now or len(survivors) < len(members)
        if not first and not survivors:
            # As in Horovod: new workers alone cannot go on, the job's state is lost.
            return st.first_failure or 1, (f"no worker of generation {self.generations.gen} is "
                                           "left to hand the job's state to new workers: the "
                                           "job ends")
        free = self._free_slots()
        placed = len(survivors) + len(pending)
        target = min(self.spec.num_proc if first else el.max_np, placed + len(free))
        if target < el.min_np:
            return self._short(len(survivors), len(free))
        st.short_since = None
        fresh = self._new_workers(free[:max(0, target - placed)])
        if first:  # nobody trains yet: published at once, its workers wait for each other
            self._publish(fresh, 0, len(fresh), now=False)
            self._start(fresh, fresh)
            self._tell(0)
            return None
        self._start(survivors + pending + fresh, fresh)
        self.pending += fresh
        ready = self._ready(pending, everyone=now)
        if not now and (not ready or self._unsettled):
            return None  # (unsettled: a loss is being reported; the next poll forms)
        if len(survivors) + len(ready) < el.min_np:
            # Enough workers are starting, not yet enough are ready: the survivors (a worker
            # was lost) stop and wait for them; the elastic timeout is not counting.
            self.generations.abort_older(f"the job is below --min-np {el.min_np} until new "
                                         "workers are ready")
            return None
        if el.reset_limit is not None and st.resets >= el.reset_limit:
            return st.first_failure or 1, (f"the job needed a re-formation after "
                                           f"{st.resets} already: --reset-limit "
                                           f"{el.reset_limit} reached")
        st.resets += 1
        self.pending = [w for w in self.pending if w not in ready]
        self._publish(survivors + ready, len(survivors), len(ready), now)
        return None

    def _short(self, survivors: int, free: int) -> tuple[int, str] | None:
        """Fewer than ``--min-np`` workers possible: waits for hosts, up to the elastic
        timeout; returns (status, reason) once it has passed."""
        st, el = self.state, self.elastic
        now = time.monotonic()
        if st.short_since is None:
            st.short_since = now
            self.generations.abort_older(f"the job is below --min-np {el.min_np}")
            self.output.message(f"{survivors} worker(s) left and {free} free "
                                f"slot(s), below --min-np {el.min_np}; waiting up to "
                                f"{el.elastic_timeout:g}s for hosts")
        if now - st.short_since > el.elastic_timeout:
            banned = self.pool.banned()
            return 1, (f"only {survivors} worker(s) left and no host to add within "
                       f"--elastic-timeout {el.elastic_timeout:g}s: the job needs "
                       f"--min-np {el.min_np}" + (f"; blacklisted: {', '.join(banned)}"
                                                  if banned else ""))
        return None

    def _new_workers(self, hosts: list[str]) -> list[_Worker]:
        """One new worker (not started) for each of ``hosts``, with a name of its own."""
        fresh = []
        for host in hosts:
            fresh.append(_Worker(f"{host}[{self._counter}]", host, None, -1))
            self._counter += 1
        return fresh

    def _start(self, planned: list[_Worker], fresh: list[_Worker]) -> None:
        """Starts ``fresh``, ranked as in ``planned`` (the rank a new worker is started with
        names its output; the generation that lists it gives it its rank)."""
        slots = _slots(planned)
        for worker in fresh:
            slot = slots[planned.index(worker)]
            worker.first_rank = slot.rank
            worker.started = time.monotonic()
            worker.rank = self._start_worker(slot, worker.id, len(planned))
            self.workers.append(worker)

    def _ready(self, pending: list[_Worker], everyone: bool) -> list[_Worker]:
        """The new workers to list now: every ready one, once all are ready, or the first
        ready one has waited ``_READY_GRACE`` seconds for the others, or ``everyone`` (a
        generation is formed anyway); else none."""
        ready = [w for w in pending if w.ready_at is not None]
        ready_at = [w.ready_at for w in pending if w.ready_at is not None]
        if not ready:
            return []
        if everyone or len(ready) == len(pending) or \
                time.monotonic() - min(ready_at) >= _READY_GRACE:
            return ready
        return []

    def _publish(self, members: list[_Worker], kept: int, new: int, now: bool) -> None:
        """Makes ``members`` the next generation. After a loss (``now``) the generations it
        replaces are aborted, so that survivors stop waiting at once; when it only adds new
        workers, the survivors train on and reach it at their next ``commit()``
        (``HostsUpdatedInterrupt``): nothing of theirs is rolled back."""
        gen = self.generations.publish(members, now)
        if gen > 0:  # (the first generation's workers start after it is published)
            self.output.message(f"generation {gen}: {len(members)} workers ({kept} kept, "
                                f"{new} new)")
            self._tell(gen)

    def _tell(self, gen: int) -> None:
        """When the ranks log at INFO: which process each worker of generation ``gen`` is,
        and who joined and left since the one before."""
        if not self.informs:
            return
        members = self.generations.of(gen)
        for index, worker in enumerate(members):
            self.output.message(f"generation {gen}: " + rank_line(
                worker.started_rank, f"worker {worker.id}", index))
        if gen > 0:
            before = self.generations.of(gen - 1)
            self.output.message(
                f"generation {gen}: joined " + (", ".join(
                    w.id for w in members if w not in before) or "none") + "; left " +
                (", ".join(w.id for w in before if w not in members) or "none"))

    def _start_worker(self, slot: Slot, wid: str, size: int) -> Rank:
        # The launch size counts the data servers, the last ranks (launch_env takes them out
        # again): so does a static job's.
        return self._starter.start(slot, self.port, size + self.spec.data_servers,
                                  identity={ENV_PREFIX + "ELASTIC_ID": wid})


def _slots(members: list[_Worker]) -> list[Slot]:
    """Slots (rank, local and cross ranks) of a generation's workers, in rank order."""
    hosts = list(dict.fromkeys(w.host for w in members))
    counts = {h: sum(1 for w in members if w.host == h) for h in hosts}
    seen: dict[str, int] = {}
    slots = []
    for rank, worker in enumerate(members):
        local = seen.get(worker.host, 0)
        seen[worker.host] = local + 1
        same_local = [h for h in hosts if counts[h] > local]
        slots.append(Slot(rank, worker.host, local, counts[worker.host],
                          same_local.index(worker.host), len(same_local)))
    return slots


def launch_elastic(spec: LaunchSpec, elastic: ElasticSpec, stdout=None, stderr=None) -> int:
    """Runs an elastic job to its end and returns the launcher's exit status."""
    output = Output(spec.output_prefix, stdout or sys.stdout.buffer, stderr or sys.stderr.buffer,
                    directory=spec.output_filename, width=len(str(spec.num_proc - 1)))
    return _ElasticJob(spec, elastic, output).run()
