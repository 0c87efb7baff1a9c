"""A job's ranks: where each runs, what it runs, and how it is started, for both policies.

Both jobs of the launcher's one loop (``loop.py``), the static one (``launcher.py``) and the
elastic one (``elastic.py``, and its data servers, ``data_servers.py``), start ranks with these
pieces; neither policy imports the other's module:

- **Where.** ``place`` fills the hosts in the order given, each host's slots before the next
  (a ``Slot``: the rank, its host, its local and cross rank). With ``-H a:2,b:2`` and 3 ranks:
  ranks 0 and 1 on ``a`` (local ranks 0 and 1 of 2), rank 2 on ``b`` (local rank 0 of 1).
  A rank's *cross rank* is its host's index among the hosts that have a rank with the same
  local rank (Horovod's definition): rank 2 has cross rank 1 of 2, rank 1 cross rank 0 of 1.
  ``is_local`` says which hosts are this one: their ranks start as children, the others over
  ssh.
- **What.** ``LaunchSpec`` is the job as ``gradsync run``'s options give it; its
  ``command_of`` is each rank's command by role: a parameter server the server entry point
  (``server_entry``: ``python -m gradsync.ps``), every other rank the job's command.
- **The store.** ``store_address`` chooses the one address every rank is given (loopback for a
  one-host job, else the address of this host on the route to a remote one) and
  ``start_store`` starts the launcher's TCPStore there, on a port the kernel picks
  (``Starter.host_store``: or a store keeper, ``keeper.py``, does, forked by the job's
  template or exec'd on a socket bound here).
- **How.** ``Starter.start`` starts one rank and returns its ``Rank``. Its environment is
  layered, later layers winning: the launcher's own (a local rank's whole environment; a remote
  one only the ``GRADSYNC_*``/``HOROVOD_*`` settings, ``forwarded_settings``), torchrun's
  variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...), the settings (unbuffered Python,
  one OpenMP thread per rank where ranks share a host, glibc's malloc keeping freed memory,
  the connect timeout), the ``-x`` variables, then the identity (``GRADSYNC_RANK`` ...,
  horovodrun's ``HOROVOD_RANK`` ..., and what the policy adds, such as an elastic worker's
  id), which no ``-x`` can change. A local rank leads a new session (``processes.start``) and
  may be bound to cores (``binding.py``); a remote one runs under ssh with the secret on its
  stdin and the lifeline (``processes.Ssh``).
- **Who is who.** When the ranks log at INFO (``informs``), the policies say which process
  each rank is (``rank_line``), so that a profiler or a signal can reach a slow one.

``restart_allowed`` is the one rule for starting a failed server again
(``--server-restarts``), for a static job's replicated parameter servers and an elastic job's
data servers alike.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from ..cluster.rendezvous import host_store
from ..config import ENV_PREFIX, HOROVOD_IDENTITY, IDENTITY_VARIABLES, horovod_settings
from ..errors import ConfigError
from . import binding
from .forkserver import Forkserver, plan, take_handed
from .hosts import Host
from .keeper import StoreKeeper, spawn as spawn_keeper
from .processes import (DEFAULT_START_TIMEOUT, STOP_GRACE, Child, Output, Process, StartError, Ssh,
                        start)

if TYPE_CHECKING:
    from torch.distributed import TCPStore

__all__ = ["Slot", "place", "LaunchSpec", "server_entry", "SERVER_LINGER", "SERVER_MODULE",
           "SERVER_RESTARTS", "START_METHODS", "KEEP_FREED_MEMORY", "is_local", "store_address",
           "start_store", "Rank", "Starter", "forwarded_settings", "informs", "rank_line", "restart_allowed"]

SERVER_LINGER = 10.0
"""Seconds servers (parameter or data servers) may run on after every worker has ended."""

SERVER_MODULE = "gradsync.ps"
"""The module a parameter server runs (``python -m gradsync.ps``: ``ps/__main__.py``)."""

SERVER_RESTARTS = 3
"""The default of ``LaunchSpec.server_restarts`` (``--server-restarts``)."""

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


START_METHODS = ("exec", "forkserver")
"""How ranks on the launcher's host start (``LaunchSpec.start_method``)."""

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
    start_method: str = "exec"
    """How a rank on this host starts: ``exec``, a new interpreter (as mpirun and torchrun
    start theirs), or ``forkserver``, forked from a template that imported torch once
    (``forkserver.py``; a command it cannot run is exec'd)."""
    preload: Sequence[str] = ()
    """Modules a ``forkserver`` template imports besides gradsync, torch and NumPy."""
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
        if self.start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, "
                             f"got {self.start_method!r}")
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
    (``python``, ``python3.12``, a virtual environment's), so that a server imports the
    gradsync the workers import, else with the launcher's own (``sys.executable``), which a
    remote host must then have at the same path, as a horovodrun job's hosts have its
    Python."""
    first = command[0]
    named = re.fullmatch(r"python[0-9.]*", os.path.basename(first))
    python = first if named else sys.executable
    return [python, "-m", SERVER_MODULE]


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
    def proc(self) -> Child:
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
        self.forks = None
        self.keeper: StoreKeeper | None = None  # the job's store, where a keeper holds it
        # A template handed down by whoever started this launcher (forkserver.py, "A template
        # handed down"): taken whatever the start method, so that no rank inherits it.
        handed = take_handed()
        if handed is not None and spec.start_method != "forkserver":
            handed[0].close()  # it ends with its socket
        if spec.start_method == "forkserver":
            self.forks = Forkserver(spec.preload, handed=handed)
            roles = [spec.command] + ([spec.command_of(spec.num_proc)] if spec.servers else [])
            here = [h.slots for h in spec.hosts if is_local(h.name)] if spec.hosts \
                else [spec.size]
            if here and any(plan(command) for command in roles):
                # Now, so that its store keeper can hold the job's store (host_store); with
                # the ranks' settings, which its forks keep: glibc reads its malloc variables
                # once, at the template's start.
                self.forks.begin({**os.environ, **self._settings(here[0]), **spec.env})

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
                env = {**os.environ, **self.torch_identity(slot, port, size),
                       **self.settings(slot), **self.spec.env, **variables,
                       ENV_PREFIX + "SECRET": self.secret.hex()}
                forked = None if self.forks is None else \
                    self.forks.start(command, env, cores=cores)
                process = forked or start(command, env)
                if cores is not None and forked is None:
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

    def host_store(self, client: bool) -> "TCPStore | StoreKeeper":
        """Starts the job's store (something with its ``port``), which outlives every rank
        until ``close``. Where the launcher needs no client of its own (``client``), a keeper
        holds it (``keeper.py``): forked by this job's template where one runs, else exec'd
        unless this process has imported torch already, so the launcher never imports torch;
        call the keeper's ``ready`` once the ranks started. Else, and where no keeper can
        start, it is hosted in this process (``start_store``).

        Raises:
            StartError: the store cannot be started here.
        """
        if not client:
            try:
                if self.forks is not None and self.forks.begun:
                    self.keeper = self.forks.keep_store(self.store_addr)
                    return self.keeper
                if "torch" not in sys.modules:  # (where it is, hosting the store costs nothing:
                    # a launcher called from a program that imported torch)
                    self.keeper = spawn_keeper(self.store_addr)
                    return self.keeper
            except OSError:
                pass  # hosted here instead (a template that failed says why at the first
                # rank's start)
        return start_store(self.store_addr)

    def close(self) -> None:
        """Ends what starting ranks needed (a ``forkserver`` template, the store keeper);
        the ranks go on. Call it once they are gone: the store ends here."""
        if self.forks is not None:
            self.forks.close()
        if self.keeper is not None:
            self.keeper.close()
            self.keeper = None

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
        return self._settings(slot.local_size)

    def _settings(self, local_size: int) -> dict[str, str]:
        """``settings`` of a rank on a host of ``local_size`` ranks."""
        settings = {"PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")}
        if local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
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
