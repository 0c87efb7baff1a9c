"""``gradsync run``: starts the ranks of one job, forwards their output, ends the job as one.

A job goes through five steps:

1. **Place.** Ranks fill the hosts in the order given, host 1's slots first: with
   ``-H a:2,b:2 -np 3`` ranks 0 and 1 run on ``a`` (local ranks 0, 1) and rank 2 on ``b``
   (local rank 0). A rank's *cross rank* is the index of its host among the hosts that have a
   rank with the same local rank (Horovod's definition): rank 2 has cross rank 1 of 2, rank 1
   cross rank 0 of 1.
2. **Store.** The launcher hosts torch's TCPStore for the rendezvous. It outlives every rank,
   so the death of rank 0 does not take the store (and the job's abort record) with it.
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
under ``mpirun -x``; local ranks inherit the launcher's
whole environment.

This job and an elastic one (``elastic.py``) are two policies of one job loop (``loop.py``:
signals, the poll, the end that stops every rank, the job file, /dev/shm); this module's
``_Job`` is the static policy. The pieces they share are public: ``Starter`` starts a rank with
its identity and the command of its role, here or over ssh (its ``ssh`` also checks hosts);
``store_address`` and ``start_store`` give the store; ``Rank`` is a started rank. The process
mechanics under them (new sessions, stopping, output, signals, ssh) are ``processes.py``.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Callable, Mapping, Sequence

from ..cluster.rendezvous import host_store
from ..config import ENV_PREFIX, HOROVOD_IDENTITY, IDENTITY_VARIABLES, horovod_settings
from ..errors import ConfigError
from . import binding, jobfile
from .hosts import Host
from .loop import End, JobLoop
from .processes import (DEFAULT_START_TIMEOUT, STOP_GRACE, Output, Process, StartError, Ssh,
                        describe, exit_status, start)

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    # Imported where it runs: it loads the parameter servers' package.
    from .server_watch import ServerWatch

__all__ = ["Host", "Slot", "LaunchSpec", "place", "launch", "is_local", "STOP_GRACE",
           "SERVER_LINGER", "DEFAULT_START_TIMEOUT", "Rank", "Starter", "store_address",
           "start_store", "forwarded_settings", "informs", "rank_line", "server_entry",
           "SERVER_MODULE"]

SERVER_LINGER = 10.0
"""Seconds servers may run on after every worker of a parameter-server job has ended."""

SERVER_MODULE = "gradsync.ps"
"""The module a parameter server runs (``python -m gradsync.ps``: ``ps/__main__.py``)."""

SERVER_RESTARTS = 3
"""The default of ``LaunchSpec.server_restarts`` (``--server-restarts``)."""

_POLL = 0.05  # how often the start looks at the hosts' ssh checks
_REAP = 5.0  # seconds to wait for a killed local server to be gone before its replacement
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class Slot:
    """Where one rank runs and its place among the job's ranks."""

    rank: int
    host: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def place(hosts: Sequence[Host], num_proc: int) -> list[Slot]:
    """Puts ``num_proc`` ranks on ``hosts`` in order, filling each host's slots before the next.

    Raises:
        ValueError: fewer slots than ranks, or a host named twice.
    """
    if num_proc < 1:
        raise ValueError(f"the number of ranks must be at least 1, got {num_proc}")
    names = [h.name for h in hosts]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"host(s) named more than once: {', '.join(repeated)}; give each host "
                         "once with its total number of slots")
    total = sum(h.slots for h in hosts)
    if total < num_proc:
        raise ValueError(f"{num_proc} ranks need {num_proc} slots but the hosts have {total} ("
                         + ", ".join(f"{h.name}:{h.slots}" for h in hosts) + ")")
    counts: dict[str, int] = {}
    for host in hosts:
        counts[host.name] = min(host.slots, num_proc - sum(counts.values()))
    used = [name for name, count in counts.items() if count > 0]
    slots: list[Slot] = []
    for name in used:
        for local_rank in range(counts[name]):
            same_local = [h for h in used if counts[h] > local_rank]
            slots.append(Slot(rank=len(slots), host=name, local_rank=local_rank,
                              local_size=counts[name], cross_rank=same_local.index(name),
                              cross_size=len(same_local)))
    return slots


# What every rank gets unless the environment sets glibc's malloc itself. By default glibc
# gives the top of the heap back to the kernel once more than a moving threshold is free, and
# serves blocks above another moving threshold with mmap; a training step that frees and
# allocates megabytes of gradients can then take every page back in again at each step. For
# the MLP of ``gradsync bench train``, in some runs and not others: up to about 2000 minor page
# faults and 3-4 ms a step (docs/benchmarks-history.md, "Freed memory kept for reuse"). So
# freed memory stays in the process for reuse, as the jemalloc and tcmalloc settings
# recommended for PyTorch on CPU keep it.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20),
                     "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
_MALLOC_SETTINGS = ("MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES")


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """What to launch and how; ``gradsync run``'s options fill these fields."""

    command: Sequence[str]
    """The program and its arguments, run by every rank."""
    num_proc: int
    """Number of worker ranks: all the ranks when ``servers`` is 0."""
    servers: int = 0
    """Parameter-server ranks started after the workers: the last ``servers`` ranks."""
    ps_replicas: int = 1
    """Servers holding each parameter-server shard (``GRADSYNC_PS_REPLICAS``); above 1 a failed
    server is reported and the job goes on on the other copies."""
    server_restarts: int = SERVER_RESTARTS
    """Times each failed server rank of a replicated parameter-server job (``ps_replicas`` > 1)
    is started again while workers run (``--server-restarts``); the new process joins its
    shard with a copy (``ps/join.py``). A long soak that kills servers often needs more than
    the default 3; 0 never starts one again."""
    data_servers: int = 0
    """Data-server ranks (``gradsync.data``) started after the workers and the parameter
    servers: the job's last ``data_servers`` ranks."""
    hosts: Sequence[Host] = ()
    """Hosts in placement order; empty means ``localhost`` with ``size`` slots."""
    ssh_command: str = "ssh"
    """Command (split like a shell would) that runs a command on a remote host."""
    ssh_port: int | None = None
    """Port passed to ssh as ``-p``."""
    start_timeout: float | None = None
    """Seconds for ssh to connect; when given, also the ranks' GRADSYNC_CONNECT_TIMEOUT."""
    output_prefix: bool = True
    """Prefix each forwarded line with ``[rank]<stdout>:`` or ``[rank]<stderr>:``."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables set for every rank (``-x``), local and remote."""
    stop_grace: float = STOP_GRACE
    """Seconds between SIGTERM and SIGKILL when the job is stopped."""
    bind_to: str = "none"
    """``core``, ``none`` or ``auto``: bind each rank started on this host to cores of its
    own (``binding.py``; auto: only when they fit and the affinity is not restricted)."""
    ssh_identity_file: str | None = None
    """Private key passed to ssh as ``-i``."""
    output_filename: str | None = None
    """Folder that also gets each rank's output, ``rank.<rank>/stdout`` and ``.../stderr``."""
    server_command: Sequence[str] | None = None
    """The command each parameter server runs; None: the server entry point
    (``server_entry(command)``, ``python -m gradsync.ps``)."""

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("no command to run")
        if self.num_proc < 1:
            raise ValueError(f"the number of ranks must be at least 1, got {self.num_proc}")
        if self.servers < 0:
            raise ValueError(f"the number of servers must be >= 0, got {self.servers}")
        if self.ps_replicas < 1 or (self.servers and self.servers % self.ps_replicas):
            raise ValueError(f"--ps-replicas must be >= 1 and divide --servers, got "
                             f"{self.ps_replicas} replicas of {self.servers} servers")
        if self.server_restarts < 0:
            raise ValueError(f"--server-restarts must be >= 0, got {self.server_restarts}")
        if self.data_servers < 0:
            raise ValueError(f"the number of data servers must be >= 0, got "
                             f"{self.data_servers}")
        if self.start_timeout is not None and self.start_timeout <= 0:
            raise ValueError(f"start_timeout must be positive, got {self.start_timeout}")
        if self.ssh_port is not None and not 1 <= self.ssh_port <= 65535:
            raise ValueError(f"ssh_port must be a TCP port (1-65535), got {self.ssh_port}")
        if self.stop_grace < 0:
            raise ValueError(f"stop_grace must be >= 0, got {self.stop_grace}")
        if self.bind_to not in binding.MODES:
            raise ValueError(f"bind_to must be one of {', '.join(binding.MODES)}, "
                             f"got {self.bind_to!r}")

    @property
    def size(self) -> int:
        """Number of ranks in the job: workers, servers and data servers."""
        return self.num_proc + self.servers + self.data_servers

    def command_of(self, rank: int) -> Sequence[str]:
        """What rank ``rank`` runs: a parameter server the server entry point, every other
        rank (workers, data servers) the job's command."""
        if self.num_proc <= rank < self.num_proc + self.servers:
            return self.server_command or server_entry(self.command)
        return self.command


def server_entry(command: Sequence[str]) -> list[str]:
    """The command that starts a parameter server of a job whose ranks run ``command``:
    ``<python> -m gradsync.ps``, with ``command``'s interpreter when it starts with one
    (``python``, ``python3.12``, a virtual environment's), so that a server imports the gradsync the workers
    import, else with the launcher's own (``sys.executable``), which a remote host must then
    have at the same path, as a horovodrun job's hosts have its Python."""
    first = command[0]
    named = re.fullmatch(r"python[0-9.]*", os.path.basename(first))
    python = first if named else sys.executable
    return [python, "-m", SERVER_MODULE]


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


def is_local(name: str) -> bool:
    """Whether ``name`` is this host, so its ranks start as children rather than over ssh."""
    here = socket.gethostname()
    return name in _LOCAL_NAMES or name.startswith("127.") or name in (here, here.split(".")[0])


def store_address(remote_hosts: Sequence[str], reachable: bool = False) -> str:
    """The store address every rank gets: loopback for a one-host job, else one remote hosts
    can reach. All ranks must get the same one, because a rank listens for its peers on the
    interface that routes to the store: a loopback store would hide local ranks from the
    remote ones.

    Args:
        remote_hosts: the job's remote hosts known now.
        reachable: the job may add remote hosts later (an elastic job's discovery script):
            an address other hosts can reach even when ``remote_hosts`` is empty.
    """
    if not remote_hosts and not reachable:
        return "127.0.0.1"
    # The source address of a route to a remote host is an address of this host on a network
    # that host shares. A UDP "connect" sends nothing; it only asks for the route. With no
    # remote host yet, the route asked for is the default one (198.51.100.1 is a
    # documentation address: no packet goes there).
    target = remote_hosts[0] if remote_hosts else "198.51.100.1"
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(target, 22, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostname()


def start_store(store_addr: str) -> "TCPStore":
    """Starts the job's TCPStore server on a free port (``.port``), where the ranks reach it
    at ``store_addr`` (``store_address``); the launcher's own client connects on loopback.

    It listens on an IPv4 socket when ``store_addr`` is an IPv4 address (``host_store``: no
    rank waits on the DNS look-up of its connection): of loopback only for a one-host job,
    whose every client reaches it there, else of every interface. For a host name or an IPv6
    address it listens on every interface, IPv4 and IPv6 (torch's own socket).

    Raises:
        StartError: it cannot be started (status 1).
    """
    # Port 0 lets the kernel choose a free port without a race.
    try:
        return host_store(store_addr, 0, 30.0, client_addr="127.0.0.1")
    except (RuntimeError, OSError) as exc:
        raise StartError(f"cannot start the rendezvous store: {exc}", 1) from None


@dataclass
class Rank:
    """A started rank: its slot and its process (a child here, or ssh for a remote one)."""

    slot: Slot
    process: Process
    command: Sequence[str] = ()
    """What it runs (``LaunchSpec.command_of``)."""

    @property
    def proc(self) -> subprocess.Popen:
        return self.process.proc

    @property
    def remote(self) -> bool:
        return self.process.lifeline

    def signal(self, signum: int) -> None:
        """Signals the rank's whole process group (and drops a remote rank's lifeline)."""
        self.process.signal(signum)


class Starter:
    """Starts the ranks of one job, each with its identity (``GRADSYNC_*`` and torchrun's
    variables) and settings: a child here, or over ``ssh`` (the lifeline: ``processes.py``).

    Args:
        spec: the job.
        output: where the ranks' output goes.
        store_addr: the store's address, the same for every rank (``store_address``).
        identity, settings: more variables for every rank: ``identity`` after ``spec.env``
            (a ``-x`` cannot change them), ``settings`` before it.
    """

    def __init__(self, spec: LaunchSpec, output: Output, store_addr: str, *,
                 identity: Mapping[str, str] | None = None,
                 settings: Mapping[str, str] | None = None):
        self.spec, self.output, self.store_addr = spec, output, store_addr
        self.extra_identity, self.extra_settings = dict(identity or {}), dict(settings or {})
        self.secret = secrets.token_bytes(32)
        self.job_id = secrets.token_hex(8)
        self.ssh = Ssh(spec.ssh_command, spec.ssh_port,
                       spec.start_timeout or DEFAULT_START_TIMEOUT, spec.ssh_identity_file)

    def start(self, slot: Slot, port: int, size: int, cores: Sequence[int] | None = None,
              identity: Mapping[str, str] | None = None) -> Rank:
        """Starts one rank of a job of ``size`` ranks whose store listens on ``port``, with
        the command of its role (``LaunchSpec.command_of``).

        Args:
            cores: CPUs to bind a rank started here to (None: not bound).
            identity: more identity variables for this rank alone.

        Raises:
            StartError: it cannot be started (status 127 or 126, as a shell's).
        """
        variables = {**self.identity(slot, port, size), **(identity or {})}
        command = self.spec.command_of(slot.rank)
        remote = not is_local(slot.host)
        try:
            if remote:
                forwarded = forwarded_settings(os.environ)
                process = self.ssh.start(
                    slot.host, command,
                    {**forwarded, **self.torch_identity(slot, port, size),
                     **self.settings(slot), **self.spec.env, **variables},
                    self.secret, self.spec.stop_grace)
            else:
                process = start(command, {
                    **os.environ, **self.torch_identity(slot, port, size),
                    **self.settings(slot), **self.spec.env, **variables,
                    ENV_PREFIX + "SECRET": self.secret.hex()})
                if cores is not None:
                    # The child has just exec'd: no thread of its own yet, and every thread
                    # it starts inherits the binding.
                    try:
                        binding.bind(process.proc.pid, cores)
                    except OSError:
                        pass  # it exited already: the watcher reports that
        except OSError as exc:
            # 127 and 126 are what a shell returns for a missing or unrunnable command.
            status = 127 if isinstance(exc, FileNotFoundError) else 126
            raise StartError(f"cannot start rank {slot.rank} on host {slot.host}: {exc}",
                             status) from None
        self.output.follow(slot.rank, process.proc)
        return Rank(slot, process, command)

    def identity(self, slot: Slot, port: int, size: int) -> dict[str, str]:
        """A rank's ``GRADSYNC_*`` identity."""
        variables = {
            "RANK": slot.rank, "SIZE": size, "LOCAL_RANK": slot.local_rank,
            "LOCAL_SIZE": slot.local_size, "CROSS_RANK": slot.cross_rank,
            "CROSS_SIZE": slot.cross_size, "HOSTNAME": slot.host,
            "STORE_ADDR": self.store_addr, "STORE_PORT": port, "JOB_ID": self.job_id,
            "LAUNCHER_PID": os.getpid(), "SERVERS": self.spec.servers,
        }
        if self.spec.data_servers:
            variables["DATA_SERVERS"] = self.spec.data_servers
        if self.spec.ps_replicas > 1:
            variables["PS_REPLICAS"] = self.spec.ps_replicas
        horovod = {"HOROVOD_" + name: str(variables[name]) for name in
                   ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
                    "HOSTNAME")}
        return {**{ENV_PREFIX + name: str(value) for name, value in variables.items()},
                **horovod, **self.extra_identity}

    def torch_identity(self, slot: Slot, port: int, size: int) -> dict[str, str]:
        """torchrun's variables, so ``init_process_group()`` (env://) works under ``gradsync
        run`` too: every rank a client of the launcher's store, as under torchrun's agent.
        Data servers (the last ranks) are not members of the training job: WORLD_SIZE counts
        only the ranks before them (the workers and any parameter servers)."""
        return {"RANK": str(slot.rank), "WORLD_SIZE": str(size - self.spec.data_servers),
                "LOCAL_RANK": str(slot.local_rank), "LOCAL_WORLD_SIZE": str(slot.local_size),
                "MASTER_ADDR": self.store_addr,
                "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}

    def settings(self, slot: Slot) -> dict[str, str]:
        """What a rank gets besides its identity, before the -x variables."""
        settings = {"PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")}
        if slot.local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # As torchrun does: ranks sharing a host would otherwise each start a BLAS/OpenMP
            # thread per core and fight over the cores (a server's small matrix product
            # running 3x slower beside its workers on 2 cores was measured).
            settings["OMP_NUM_THREADS"] = "1"
        if not any(name in os.environ for name in (*KEEP_FREED_MEMORY, *_MALLOC_SETTINGS)):
            settings.update(KEEP_FREED_MEMORY)
        if self.spec.start_timeout is not None:
            settings[ENV_PREFIX + "CONNECT_TIMEOUT"] = str(self.spec.start_timeout)
        return {**settings, **self.extra_settings}


def forwarded_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The launcher's settings a remote rank gets: ``GRADSYNC_*`` and ``HOROVOD_*`` variables,
    less the identity (each rank gets its own)."""
    return {name: value for name, value in environ.items()
            if (name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):] not in IDENTITY_VARIABLES)
            or (name.startswith("HOROVOD_") and name not in HOROVOD_IDENTITY)}


def informs(spec: LaunchSpec) -> bool:
    """Whether the ranks log at INFO or below, so that the launcher says who each rank is:
    their ``GRADSYNC_LOG_LEVEL`` (a ``-x`` or ``--log-level``, else the launcher's own), else
    ``HOROVOD_LOG_LEVEL`` (as ``config.load_config`` reads them)."""
    environ = {**os.environ, **spec.env}
    level = environ.get(ENV_PREFIX + "LOG_LEVEL")
    if level is None:
        try:
            level = horovod_settings(environ)[0].get("log_level", "WARNING")
        except ConfigError:
            return False  # a bad HOROVOD_* value: the ranks say which, at init()
    return level.strip().upper() in ("DEBUG", "INFO")


def rank_line(rank: Rank, role: str, index: int | None = None) -> str:
    """Which process ``rank`` is, for a user who wants to attach a profiler to it; ``index``:
    its rank now, when that is not the one it started with (an elastic job's workers). A
    parameter server's line ends with what it runs (``python -m gradsync.ps``)."""
    index = rank.slot.rank if index is None else index
    where = f"rank {index} ({role}) on host {rank.slot.host}"
    entry = list(rank.command[1:]) == ["-m", SERVER_MODULE]
    runs = f", {os.path.basename(rank.command[0])} -m {SERVER_MODULE}" if entry else ""
    if rank.remote:
        return f"{where}: started over ssh (pid {rank.proc.pid} here{runs}); its pid there is " \
               "in its own INFO line"
    return f"{where}: pid {rank.proc.pid}{runs}"


def restart_allowed(restarts: dict, key, most: int, say: Callable[[str], None],
                    who: str) -> bool:
    """Counts one more start of a failed server ``key`` (a parameter server's rank, a data
    server's index) in ``restarts`` if ``--server-restarts`` (``most``) allows it; says once,
    at the first failure past the limit, that ``who`` is not started again."""
    count = restarts.get(key, 0)
    if count >= most:
        if count == most and most:
            restarts[key] = count + 1
            say(f"{who} is not started again: it was started again {most} times already "
                "(--server-restarts)")
        return False
    restarts[key] = count + 1
    return True


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
        self.store: TCPStore | None = None  # the job's TCPStore server, held for the whole run
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
        self.store = start_store(self.starter.store_addr)
        self.store_port = self.store.port
        self.jobfile = jobfile.publish(self.starter.job_id, self.starter.store_addr,
                                       self.store_port, len(self.slots))
        if self.spec.servers and self.spec.ps_replicas > 1 and self.spec.server_restarts:
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
        if informs(self.spec):
            for rank in self.ranks:
                self.output.message(rank_line(rank, self._role(rank.slot.rank)))

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
        ssh = self.starter.ssh
        checks: dict[str, subprocess.Popen] = {}
        end = time.monotonic() + ssh.probe_limit
        try:
            for host in self.remote_hosts:
                checks[host] = ssh.probe(host)
            # Polled rather than waited on, so that a Ctrl-C is honoured at once.
            while self.interrupts.received is None and \
                    any(p.poll() is None for p in checks.values()):
                if time.monotonic() > end:
                    late = [h for h, p in checks.items() if p.poll() is None]
                    raise StartError(f"ssh to {', '.join(late)} did not finish within "
                                     f"{ssh.timeout:.0f}s", 255)
                time.sleep(_POLL)
            for host, proc in checks.items():
                error = ssh.probe_error(host, proc)
                if error is not None:
                    raise StartError(error, proc.returncode)
        finally:
            for proc in checks.values():
                ssh.end_probe(proc)

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
            first = f", the first of {len(self.failed)} failed workers" \
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


