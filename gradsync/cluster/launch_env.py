"""Who started this process, and what it says about the job: rank, size, store, secret.

gradsync adopts ranks from whichever launcher started them, so a training script runs unchanged
under ``gradsync run``, ``torchrun``, ``srun`` and ``mpirun``. ``detect()`` reads the launcher's
variables (this module and ``config.py`` are the only readers of the environment) and returns a
``LaunchEnv``. The sources, first match wins:

==========  =========================================================  =====================
source      recognised by                                              who hosts the store
==========  =========================================================  =====================
gradsync    ``GRADSYNC_RANK``/``GRADSYNC_SIZE`` (set by gradsync run)  the launcher (else 0)
torchrun    ``RANK`` and ``WORLD_SIZE`` (torchrun or env:// by hand)   rank 0, or the agent
slurm       ``SLURM_PROCID`` and ``SLURM_NTASKS`` (srun)               rank 0
mpirun      ``OMPI_COMM_WORLD_RANK``/``_SIZE`` (Open MPI)              rank 0
single      nothing of the above                                       this process
==========  =========================================================  =====================

Under every source ``GRADSYNC_HOSTNAME``, ``GRADSYNC_SECRET`` (hex) and ``GRADSYNC_JOB_ID``
override what the launcher implies, and ``GRADSYNC_STORE_ADDR``/``_PORT`` override
``MASTER_ADDR``/``MASTER_PORT``. The local and cross ranks are ``None`` where the launcher does
not say; gradsync then derives them from the host names after the rendezvous.

Roles: a job may have parameter servers. ``GRADSYNC_SERVERS=S`` (set by ``gradsync run
--servers S``; export it on every rank under the other launchers) makes the last S ranks the
servers and the first ``size - S`` the workers, under every source; at least one rank must be a
worker. ``LaunchEnv.workers``, ``is_server`` and ``server_rank`` follow from it.

A job may also have data servers (``gradsync.data``). ``GRADSYNC_DATA_SERVERS=D`` (set by
``gradsync run --data-servers D``; export it on every rank under the other launchers) makes the
last D launched ranks data servers, after the workers and the parameter servers. They are not
members of the training job: on every other rank ``detect()`` reports ``size`` without them (so
``gradsync.size()`` on a worker counts workers only, as with parameter servers) and their number
in ``data_servers``. On a data-server rank ``detect()`` raises a ConfigError that says to build
the ``gradsync.data.Loader`` first (that call serves and ends the process); the Loader itself
reads the rank's identity with ``detect(data_server=True)``, which returns it with
``is_data_server`` true and ``data_server_rank`` its index.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import zlib
from dataclasses import dataclass, field
from typing import Literal, Mapping, overload

from ..errors import ConfigError

__all__ = ["LaunchEnv", "detect", "host_name", "slurm_first_host", "slurm_tasks_per_node", "SOURCES"]

SOURCES = ("gradsync", "torchrun", "slurm", "mpirun", "single")

# SLURM gives no store port, so every rank derives the same one from the job id. The range
# stays below Linux's default ephemeral ports (32768-60999) so that an outgoing connection on
# the node cannot already hold it.
_SLURM_PORT_BASE = 15000
_SLURM_PORT_SPAN = 15000


@dataclass(frozen=True)
class LaunchEnv:
    """This process's identity in the job, as its launcher described it."""

    rank: int
    """Global rank, ``0 <= rank < size``."""
    size: int
    """Number of ranks in the job."""
    local_rank: int | None
    """Rank among the processes on this host; None when the launcher does not say."""
    local_size: int | None
    """Number of ranks on this host; None when the launcher does not say."""
    cross_rank: int | None
    """Index of this host among the hosts that have a rank with this ``local_rank``."""
    cross_size: int | None
    """Number of hosts that have a rank with this ``local_rank``."""
    hostname: str
    """Name that identifies this host; ranks with equal names share a host (and memory)."""
    store_addr: str
    """Address of the rendezvous TCPStore."""
    store_port: int
    """Port of the rendezvous TCPStore."""
    store_is_server: bool
    """Whether this process must host the TCPStore (nobody else does)."""
    secret: bytes | None = field(repr=False)  # kept out of logs that print the LaunchEnv
    """The job's secret; None when the launcher gave none (rank 0 then makes one)."""
    job_id: str
    """Identical on every rank of the job and different between jobs: prefixes store keys."""
    source: str
    """Which launcher: one of ``SOURCES``."""
    launcher_pid: int | None = None
    """Pid of the ``gradsync run`` process on the launcher's host (gradsync source only)."""
    servers: int = 0
    """Number of parameter-server ranks in the job: the last ``servers`` ranks (0: no parameter
    servers)."""
    data_servers: int = 0
    """Number of data-server ranks (``gradsync.data``): launched after every rank counted in
    ``size``, so that data server ``d`` has launch rank ``size + d``."""
    elastic_id: str | None = None
    """This worker's name in an elastic job (``GRADSYNC_ELASTIC_ID``, set by ``gradsync run
    --min-np/--max-np``): ``init()`` then takes rank and size from the job's current
    generation (``gradsync.elastic.membership``) instead of ``rank`` and ``size``."""

    @property
    def workers(self) -> int:
        """Number of worker ranks: ranks ``0 .. workers - 1``."""
        return self.size - self.servers

    @property
    def is_server(self) -> bool:
        """Whether this rank is a parameter server (one of the last ``servers`` ranks)."""
        return self.workers <= self.rank < self.size

    @property
    def server_rank(self) -> int | None:
        """Index of this rank among the servers (``rank - workers``); None on a worker."""
        return self.rank - self.workers if self.is_server else None

    @property
    def is_data_server(self) -> bool:
        """Whether this rank is a data server: its launch rank is ``size`` or above (only
        ``detect(data_server=True)`` returns such a LaunchEnv)."""
        return self.rank >= self.size

    @property
    def data_server_rank(self) -> int | None:
        """Index of this rank among the data servers (``rank - size``); None elsewhere."""
        return self.rank - self.size if self.is_data_server else None


def detect(environ: Mapping[str, str] | None = None, data_server: bool = False) -> LaunchEnv:
    """Reads the launcher's variables and returns this process's LaunchEnv.

    Args:
        environ: the environment to read; ``os.environ`` when None.
        data_server: whether the caller serves data (``gradsync.data``) on a data-server rank;
            False makes such a rank an error.

    Returns:
        The LaunchEnv of the first source (see the module docstring) whose variables are set.

    Raises:
        ConfigError: a variable is not an integer, is negative, or contradicts another (a rank
            not below the size, ``GRADSYNC_SERVERS`` leaving no worker), or the store address
            cannot be determined, or this rank is a data server and ``data_server`` is False.
            The message names the variable, its value and what to export.
    """
    env = _Reader(os.environ if environ is None else environ)
    return _data_role(_launched(env), env, data_server)


def _launched(env: "_Reader") -> LaunchEnv:
    """The LaunchEnv of every launched rank, data servers included."""
    if env.has("GRADSYNC_RANK") or env.has("GRADSYNC_SIZE"):
        return _from_gradsync(env)
    if env.has("RANK") and env.has("WORLD_SIZE"):
        return _from_torchrun(env)
    slurm = env.has("SLURM_PROCID") and env.has("SLURM_NTASKS")
    ompi = env.has("OMPI_COMM_WORLD_RANK") or env.has("OMPI_COMM_WORLD_SIZE")
    if slurm and ompi and not _same_ranks(env):
        # mpirun inside an sbatch allocation: its ranks inherit the batch step's SLURM_PROCID
        # (0 for all of them) and SLURM_NTASKS, which describe the batch script, not the rank.
        return _from_mpirun(env)
    if slurm:
        return _from_slurm(env)
    if ompi:
        return _from_mpirun(env)
    return _single(env)


class _Reader:
    """Typed, validated access to the variables; every error names the variable and value."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ

    def get(self, name: str) -> str | None:
        value = self.environ.get(name)
        if value is None or not value.strip():
            return None  # an exported but empty variable is treated as unset
        return value.strip()

    def has(self, name: str) -> bool:
        return self.get(name) is not None

    # A required variable either has a value or raises: only an optional one returns None.
    @overload
    def integer(self, name: str, required: Literal[True] = True, minimum: int = 0) -> int: ...

    @overload
    def integer(self, name: str, required: bool, minimum: int = 0) -> int | None: ...

    def integer(self, name: str, required: bool = True, minimum: int = 0) -> int | None:
        text = self.get(name)
        if text is None:
            if required:
                raise ConfigError(f"{name} is not set, but the launcher's other variables are")
            return None
        try:
            value = int(text, 10)
        except ValueError:
            raise ConfigError(f"{name}={text!r} is not an integer") from None
        if value < minimum:
            raise ConfigError(f"{name}={text!r} must be >= {minimum}")
        return value

    def first(self, *names: str) -> tuple[str, str] | None:
        """The first of ``names`` that is set, as (name, value)."""
        for name in names:
            value = self.get(name)
            if value is not None:
                return name, value
        return None

    def port(self, *names: str) -> int | None:
        found = self.first(*names)
        if found is None:
            return None
        value = self.integer(found[0])
        if not 1 <= value <= 65535:
            raise ConfigError(f"{found[0]}={found[1]!r} is not a TCP port (1-65535)")
        return value


def host_name(environ: Mapping[str, str] | None = None) -> str:
    """The name that identifies this host: ``GRADSYNC_HOSTNAME``, else the system's host name.

    For callers that know rank and size from elsewhere (the ``torch.distributed`` backend).
    """
    return _Reader(os.environ if environ is None else environ).get("GRADSYNC_HOSTNAME") \
        or socket.gethostname()


def _check_below(index_name: str, index: int | None, count_name: str | None,
                 count: int | None) -> None:
    if index is not None and count is not None and index >= count:
        raise ConfigError(f"{index_name}={index} must be below {count_name} ({count})")


def _identity(env: _Reader, names: tuple[str, str, str, str | None]) -> dict:
    """Reads and cross-checks (rank, size, local_rank, local_size) from the given names."""
    rank_n, size_n, local_rank_n, local_size_n = names
    size = env.integer(size_n, minimum=1)
    rank = env.integer(rank_n)
    local_rank = env.integer(local_rank_n, required=False)
    local_size = None
    if local_size_n is not None:
        local_size = env.integer(local_size_n, required=False, minimum=1)
    _check_below(rank_n, rank, size_n, size)
    _check_below(local_rank_n, local_rank, local_size_n, local_size)
    if local_size is not None and local_size > size:
        raise ConfigError(f"{local_size_n}={local_size} must not exceed {size_n}={size}")
    return dict(rank=rank, size=size, local_rank=local_rank, local_size=local_size)


def _common(env: _Reader, default_host: str | None, size: int) -> dict:
    """What every source honours: the host name and secret overrides, and the servers."""
    hostname = env.get("GRADSYNC_HOSTNAME") or default_host or socket.gethostname()
    text = env.get("GRADSYNC_SECRET")
    secret = None
    if text is not None:
        try:
            secret = bytes.fromhex(text)
        except ValueError:
            # The value is a secret: say what is wrong with it, not what it is.
            raise ConfigError(f"GRADSYNC_SECRET is not hexadecimal ({len(text)} characters); "
                              "export it as e.g. $(openssl rand -hex 32)") from None
    return dict(hostname=hostname, secret=secret, servers=_servers(env, size))


def _servers(env: _Reader, size: int) -> int:
    """``GRADSYNC_SERVERS``: how many of the last ranks are parameter servers (default 0)."""
    text = env.get("GRADSYNC_SERVERS")
    if text is None:
        return 0
    ranks = f"a job of {size} rank{'' if size == 1 else 's'}"
    try:
        servers = int(text, 10)
    except ValueError:
        servers = -1
    if servers < 0:
        raise ConfigError(f"GRADSYNC_SERVERS={text!r} is not a number of parameter-server ranks; "
                          f"{ranks} needs an integer from 0 to {size - 1}")
    if servers >= size:
        raise ConfigError(f"GRADSYNC_SERVERS={servers} leaves no worker in {ranks}; servers are "
                          "the last GRADSYNC_SERVERS ranks and at least one rank must be a worker")
    return servers


def _data_role(launched: LaunchEnv, env: _Reader, data_server: bool) -> LaunchEnv:
    """Takes the last ``GRADSYNC_DATA_SERVERS`` ranks out of ``size`` (see the module docstring).

    Raises:
        ConfigError: the number is not an integer from 0 to what leaves one worker, or this is
            a data-server rank and the caller does not serve data.
    """
    text = env.get("GRADSYNC_DATA_SERVERS")
    if text is None:
        return launched
    size, servers = launched.size, launched.servers
    ranks = f"a job of {size} rank{'' if size == 1 else 's'}"
    try:
        count = int(text, 10)
    except ValueError:
        count = -1
    if not 0 <= count < size - servers:
        raise ConfigError(f"GRADSYNC_DATA_SERVERS={text!r} must be an integer from 0 to "
                          f"{size - servers - 1} in {ranks} with {servers} parameter "
                          "server(s): data servers are the last ranks, and at least one rank "
                          "must be a worker")
    trained = dataclasses.replace(launched, size=size - count, data_servers=count)
    if trained.is_data_server and not data_server:
        raise ConfigError(f"rank {launched.rank} is data server {trained.data_server_rank} "
                          f"(GRADSYNC_DATA_SERVERS={count}): it serves from the "
                          "gradsync.data.Loader call and is no member of the training job; "
                          "build the Loader before gradsync.init() or anything else that "
                          "needs the job (the call serves and ends the process)")
    return trained


def _store(env: _Reader) -> tuple[str | None, int | None]:
    """Store address and port from GRADSYNC_STORE_* or MASTER_*; None where neither is set."""
    found = env.first("GRADSYNC_STORE_ADDR", "MASTER_ADDR")
    port = env.port("GRADSYNC_STORE_PORT", "MASTER_PORT")
    return (found[1] if found else None), port


def _from_gradsync(env: _Reader) -> LaunchEnv:
    ident = _identity(env, ("GRADSYNC_RANK", "GRADSYNC_SIZE", "GRADSYNC_LOCAL_RANK",
                            "GRADSYNC_LOCAL_SIZE"))
    cross_rank = env.integer("GRADSYNC_CROSS_RANK", required=False)
    cross_size = env.integer("GRADSYNC_CROSS_SIZE", required=False, minimum=1)
    _check_below("GRADSYNC_CROSS_RANK", cross_rank, "GRADSYNC_CROSS_SIZE", cross_size)
    addr = env.get("GRADSYNC_STORE_ADDR")
    port = env.port("GRADSYNC_STORE_PORT")
    if addr is None or port is None:
        raise ConfigError("GRADSYNC_RANK/GRADSYNC_SIZE are set but GRADSYNC_STORE_ADDR and "
                          "GRADSYNC_STORE_PORT are not both set; export the address and port of "
                          "the rendezvous store (gradsync run sets all of them)")
    launcher_pid = env.integer("GRADSYNC_LAUNCHER_PID", required=False, minimum=1)
    return LaunchEnv(
        **ident, cross_rank=cross_rank, cross_size=cross_size,
        **_common(env, None, ident["size"]),
        store_addr=addr, store_port=port,
        # gradsync run hosts the store itself (it outlives every rank and can watch the job);
        # ranks given GRADSYNC_* by hand, without the launcher, fall back to rank 0.
        store_is_server=launcher_pid is None and ident["rank"] == 0,
        job_id=env.get("GRADSYNC_JOB_ID") or f"gradsync-{addr}-{port}",
        source="gradsync", launcher_pid=launcher_pid, elastic_id=env.get("GRADSYNC_ELASTIC_ID"))


def _uniform_cross(ident: dict, node: int | None, nodes: int | None,
                   per_node: list[int] | None) -> tuple[int | None, int | None]:
    """(cross_rank, cross_size) from the node index, valid only when every node has as many
    ranks: then the hosts holding local rank r are exactly all nodes, in node order."""
    if node is None or nodes is None or ident["local_size"] is None:
        return None, None
    uniform = (per_node is None or len(set(per_node)) == 1) and \
        ident["local_size"] * nodes == ident["size"]
    if not uniform or node >= nodes:
        return None, None
    return node, nodes


def _from_torchrun(env: _Reader) -> LaunchEnv:
    ident = _identity(env, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    node = env.integer("GROUP_RANK", required=False)
    nodes = env.integer("GROUP_WORLD_SIZE", required=False, minimum=1)
    cross_rank, cross_size = _uniform_cross(ident, node, nodes, None)
    addr, port = _store(env)
    if addr is None or port is None:
        raise ConfigError("RANK and WORLD_SIZE are set (torchrun or env:// style) but "
                          "MASTER_ADDR/MASTER_PORT are not; export both (torchrun sets them)")
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    run_id = env.get("TORCHELASTIC_RUN_ID") or f"torch-{addr}-{port}"
    # After an elastic restart the ranks meet again; a fresh prefix keeps the previous
    # attempt's keys (its abort record above all) from leaking into the new one.
    restart = env.integer("TORCHELASTIC_RESTART_COUNT", required=False) or 0
    return LaunchEnv(
        **ident, cross_rank=cross_rank, cross_size=cross_size,
        **_common(env, None, ident["size"]),
        store_addr=addr, store_port=port,
        store_is_server=ident["rank"] == 0 and not agent_store,
        job_id=env.get("GRADSYNC_JOB_ID") or f"{run_id}.{restart}", source="torchrun")


def _same_ranks(env: _Reader) -> bool:
    return (env.get("SLURM_PROCID"), env.get("SLURM_NTASKS")) == \
        (env.get("OMPI_COMM_WORLD_RANK"), env.get("OMPI_COMM_WORLD_SIZE"))


def _from_slurm(env: _Reader) -> LaunchEnv:
    ident = _identity(env, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None))
    node = env.integer("SLURM_NODEID", required=False)
    nodes = env.integer("SLURM_STEP_NUM_NODES", required=False, minimum=1) or \
        env.integer("SLURM_NNODES", required=False, minimum=1)
    per_node = _slurm_per_node(env, ident["size"])
    if per_node is not None and node is not None and node < len(per_node):
        ident["local_size"] = per_node[node]
        source = f"SLURM tasks on node {node}"
    else:
        # The requested count, inherited from sbatch: only a bound when the step is smaller.
        requested = env.integer("SLURM_NTASKS_PER_NODE", required=False, minimum=1)
        if requested is not None and requested <= ident["size"]:
            ident["local_size"] = requested
        source = "SLURM_NTASKS_PER_NODE"
    _check_below("SLURM_LOCALID", ident["local_rank"], source, ident["local_size"])
    cross_rank, cross_size = _uniform_cross(ident, node, nodes, per_node)
    job = env.get("SLURM_JOB_ID") or "0"
    step = env.get("SLURM_STEP_ID")
    job_id = env.get("GRADSYNC_JOB_ID") or (f"slurm-{job}.{step}" if step else f"slurm-{job}")
    addr, port = _store(env)
    derived_addr = addr is None
    if addr is None:
        nodelist = env.first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nodelist is None:
            raise ConfigError("under srun, gradsync needs the store address: export MASTER_ADDR "
                              "(or GRADSYNC_STORE_ADDR), or run inside a job with "
                              "SLURM_JOB_NODELIST")
        addr = slurm_first_host(nodelist[1], nodelist[0])
    if port is None:
        # Concurrent steps of one job get different ports because the step id is in job_id.
        port = _SLURM_PORT_BASE + zlib.crc32(job_id.encode()) % _SLURM_PORT_SPAN
    if derived_addr and ident["rank"] == 0 and node not in (None, 0):
        raise ConfigError(f"rank 0 runs on SLURM node {node} but the store address was taken "
                          f"from the first host of the node list ({addr}); export MASTER_ADDR "
                          "with rank 0's host")
    return LaunchEnv(
        **ident, cross_rank=cross_rank, cross_size=cross_size,
        **_common(env, env.get("SLURMD_NODENAME"), ident["size"]), store_addr=addr,
        store_port=port, store_is_server=ident["rank"] == 0, job_id=job_id, source="slurm")


def _slurm_per_node(env: _Reader, size: int) -> list[int] | None:
    """Ranks on each node of the step, in node-id order, or None when unknown or unparsable."""
    found = env.first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if found is None:
        return None
    counts = slurm_tasks_per_node(found[1])
    # The job-wide SLURM_TASKS_PER_NODE does not describe a smaller step; trust it only when
    # it accounts for every rank.
    if counts is None or sum(counts) != size:
        return None
    return counts


def slurm_tasks_per_node(text: str) -> list[int] | None:
    """Expands SLURM's compressed task counts, e.g. ``"2(x3),1"`` -> ``[2, 2, 2, 1]``.

    Returns:
        The count of each node, or None when ``text`` is not in that form.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_first_host(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> str:
    """The first host of a SLURM node list such as ``node[01-04,07],gpu7`` (-> ``node01``).

    Only one bracket group per host name is understood (``rack1-n[3-4]`` is, ``r[1-2]n[1-4]``
    is not); that covers the lists SLURM prints for ordinary clusters.

    Raises:
        ConfigError: the list has another form; the message says to export MASTER_ADDR.
    """
    match = re.match(r"([^,\[\]]*)(?:\[(\d+)[^\]]*\]([^,\[\]]*))?(?:,|$)", nodelist.strip())
    if match is None or not (match.group(1) or match.group(2)):
        raise ConfigError(f"{variable}={nodelist!r} is not a node list gradsync can read; "
                          "export MASTER_ADDR with the host of rank 0")
    prefix, first, suffix = match.groups()
    if first is None:
        return prefix
    return f"{prefix}{first}{suffix}"  # the digits keep their zero padding


def _from_mpirun(env: _Reader) -> LaunchEnv:
    ident = _identity(env, ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"))
    addr, port = _store(env)
    if addr is None or port is None:
        # mpirun gives no store address, and guessing one would hang every rank until its
        # timeout: say what to export instead.
        raise ConfigError("under mpirun gradsync needs the rendezvous store's address: run "
                          "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> "
                          "... (or GRADSYNC_STORE_ADDR/GRADSYNC_STORE_PORT)")
    job = env.first("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid")
    return LaunchEnv(
        **ident, cross_rank=None, cross_size=None, **_common(env, None, ident["size"]),
        store_addr=addr, store_port=port, store_is_server=ident["rank"] == 0,
        job_id=env.get("GRADSYNC_JOB_ID") or
        (f"mpirun-{job[1]}" if job else f"mpirun-{addr}-{port}"), source="mpirun")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _single(env: _Reader) -> LaunchEnv:
    # The port is free now and bound by this same process moments later: no other rank needs
    # to know it, so the small race with other programs is the only risk.
    return LaunchEnv(
        rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1,
        **_common(env, None, 1), store_addr="127.0.0.1", store_port=_free_port(),
        store_is_server=True, job_id=env.get("GRADSYNC_JOB_ID") or f"single-{os.getpid()}",
        source="single")
