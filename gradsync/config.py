"""The one configuration object, built once at ``init()``.

Precedence: keyword arguments to ``init()``, then ``GRADSYNC_<FIELD>`` environment variables,
then the defaults below. Unknown ``GRADSYNC_*`` names and bad values fail loudly, naming the
variable. The README's configuration table lists the same fields.

Launcher-provided identity (rank, world size, store address, secret) is read by
``gradsync.cluster.launch_env``; this module owns the tunables.

Horovod's settings: a ``HOROVOD_*`` variable that has a gradsync equivalent (``HOROVOD_SETTINGS``)
fills that field when neither a keyword nor its ``GRADSYNC_*`` variable does, converted to
gradsync's units, so a Horovod job keeps its tuning unchanged. The fallback lives here, where
the environment is read, rather than in ``gradsync run``: it then works whatever started the
ranks (``mpirun -x HOROVOD_FUSION_THRESHOLD``, srun, torchrun, a shell). Horovod's runtime
settings that have no equivalent (``HOROVOD_IGNORED``) are reported once, by rank 0, in one line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from . import logs
from .errors import ConfigError

__all__ = ["Config", "load_config", "ENV_PREFIX", "IDENTITY_VARIABLES", "HOROVOD_SETTINGS",
           "HOROVOD_IGNORED", "HOROVOD_IDENTITY", "horovod_settings"]

ENV_PREFIX = "GRADSYNC_"

# Variables the launcher sets for its ranks. They are read by launch_env, not here, but they
# are legitimate GRADSYNC_* names, so the unknown-name check must not reject them.
IDENTITY_VARIABLES = frozenset(
    {
        "RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
        "STORE_ADDR", "STORE_PORT", "SECRET", "JOB_ID", "LAUNCHER_PID", "HOSTNAME", "SERVERS",
        "DATA_SERVERS", "ELASTIC_ID",
        # Not identities: gradsync run's --bind-to and --start-method defaults, read by the
        # launcher, and the template handed to a launcher (run/forkserver.py), which it removes.
        "BIND", "START_METHOD", "TEMPLATE",
    }
)

# horovodrun's identity variables, set by gradsync run beside GRADSYNC_*: the same values.
HOROVOD_IDENTITY = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                    "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME")

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

TRANSPORTS = ("auto", "tcp", "shm")
ALGORITHMS = ("auto", "ring", "topo_ring", "doubling", "halving_doubling", "hierarchical", "shm")
STREAM_MODES = ("auto", "never", "always")  # transport/segment_stores.py's MODES (a test: equal)


@dataclass(frozen=True, kw_only=True)
class Config:
    """Tunables of a gradsync process. Every field maps to ``GRADSYNC_<FIELD upper-cased>``."""

    timeout: float = 300.0
    """Seconds a collective may wait on live peers before raising GradsyncTimeoutError.
    A peer that dies is detected much sooner (closed socket, vanished process). A Horovod-API
    operation that some ranks never issue fails after as long, with CollectiveMismatchError."""

    connect_timeout: float = 60.0
    """Seconds ``init()`` waits for every rank to join and connect."""

    transport: str = "auto"
    """``auto`` (shm within a host, tcp between hosts), ``tcp`` or ``shm`` (forces one)."""

    algorithm: str = "auto"
    """Allreduce algorithm: ``auto`` (the planner's choice) or one of ``ring``, ``topo_ring``,
    ``doubling``, ``halving_doubling``, ``hierarchical``, ``shm``."""

    chunk_bytes: int = 1 << 20
    """Pipelining unit (largest segment) of the ring and tree algorithms between pairs of ranks."""

    tune_segments: bool = True
    """Ring allreduces of 1 MiB or more with a TCP connection in the ring measure their segment
    size, each power of 4 of sizes on its own: the first ones cut segments of a sixteenth, a
    quarter and the whole of ``chunk_bytes`` in turns, and the ranks keep the fastest together,
    a smaller one only when faster by more than 2% (``transport/trials.py``,
    ``Tuning.segments``); false always cuts ``chunk_bytes``."""

    tcp_splice: bool = True
    """The ring's segments of vectors above 32 MiB may go to a TCP socket by reference
    (vmsplice + splice, Linux), saving the sender's copy: once the segment size is chosen
    (``tune_segments``), the next such allreduces copy and lend in turn and the faster way is
    kept (``transport/comm.py``, ``Lending``); false always copies them, as any other send."""

    shm_slot_bytes: int = 1 << 20
    """Bytes each local rank owns in the host's shared-memory allreduce segment (per buffer)."""

    shm_fast: bool = True
    """Small shared-memory allreduces take the compiled road (``collectives/_shmfast.c``,
    built on first use with the system C compiler); false keeps them in Python."""

    shm_stream: str = "auto"
    """How the shared-memory allreduce's pieces road writes a rank's slot: ``auto`` measures
    ordinary stores against streaming ones (non-temporal, past the cache) as it runs and keeps
    the faster (``transport/segment_stores.py``), ``never`` or ``always``. Needs ``shm_fast``'s
    compiled module; the bytes are the same either way."""

    quant_fast: bool = True
    """int8, int4 and bf16 compression run their per-block arithmetic compiled
    (``compress/_quantfast.c``, built as ``shm_fast``'s; the same bits as torch's operations);
    false keeps torch's operations. Read from the environment by the compressors themselves
    (``setting``): they also run on torch's own groups, with no World."""

    torch_share_buckets: bool = True
    """The torch backend moves a tensor that it reduces in place again and again inside
    backward passes (DDP's buckets), of at least ``shm_slot_bytes``, into a shared-memory file
    once, so that the host's ranks fold it where it lies (``torch/backend/sharing.py``); false
    moves nothing."""

    small_bytes: int = 64 << 10
    """Below this size ``auto`` allreduce uses recursive doubling (latency-optimal)."""

    medium_bytes: int = 1 << 20
    """Below this size (and above ``small_bytes``) ``auto`` uses halving-doubling; above, ring."""

    check_collectives: bool = True
    """Verify that all ranks issue the same collective (a 64-bit signature per frame)."""

    fusion_threshold: int = 64 << 20
    """Bytes of small tensors packed into one fusion buffer (Horovod's HOROVOD_FUSION_THRESHOLD)."""

    stall_warning: float = 60.0
    """Seconds a collective (or a Horovod-API operation that not every rank has issued yet)
    may wait before a warning names it (are all ranks issuing it?)."""

    stall_report: float = 30.0
    """Seconds a collective may wait before each waiting rank logs, once, a stall report: the
    ranks that have not arrived, each one's Python stacks and the last operation it completed
    (docs/troubleshooting.md, "A stuck job"). 0 turns it off."""

    flight_recorder: int = 2000
    """Operations each rank's flight recorder keeps (the newest ones: a ring); 0 turns it off
    (docs/troubleshooting.md, "The flight recorder")."""

    flight_recorder_dir: str = ""
    """Directory the flight recorder dumps to on a failure or SIGUSR1, one file per rank
    (``gradsync_trace_rank_<rank>``, torch's format); empty: ``<tmp>/gradsync-flight/<job id>``;
    ``off``: no dump but on request (``gradsync.flight_recorder.dump``)."""

    straggler_interval: float = 1.0
    """Seconds between a rank's posts of its pace (its steps' time and time blocked in
    collectives since its last post) to the job's store, which name stragglers and feed ``gradsync top``
    (docs/troubleshooting.md, "Stragglers"); 0 turns the pace meter, the posts and the
    straggler warnings off."""

    straggler_threshold: float = 0.1
    """A rank is late in a step when it arrives at the step's collectives later than most
    ranks by more than this fraction of the step's time (and by 1 ms)."""

    straggler_window: int = 10
    """A rank late in most of the last this many steps is named a straggler (until it is
    late in at most a quarter of them)."""

    straggler_ops: int = 64
    """In a job that never marks a step (``gradsync.mark_step``, the Horovod API's
    ``DistributedOptimizer.step``), every this many operations count as one step; 0: only
    marked steps count."""

    abort_poll_interval: float = 0.1
    """Seconds between checks of the job's abort flag while a rank waits."""

    heartbeat_interval: float = 0.25
    """Seconds between a rank's heartbeats (and its looks at the peers it watches)."""

    heartbeat_timeout: float = 2.0
    """Seconds without a heartbeat after which a peer that is alive but silent (stopped, stuck,
    cut off) is lost: every rank then raises PeerLostError naming it, at most
    ``heartbeat_timeout + 2 * heartbeat_interval + abort_poll_interval`` (2.6 s) after it fell
    silent (docs/elastic.md, "Silent peers"). 0 turns heartbeats off (a silent peer is then
    only caught by ``timeout``)."""

    elastic_timeout: float = 600.0
    """Elastic jobs: seconds a worker waits for the next generation of the job to be formed
    (``gradsync run --elastic-timeout`` sets it for its workers)."""

    topology: str = ""
    """Path of a topology file (tiers' bandwidth and latency, groups of hosts; JSON or YAML),
    as written by ``gradsync probe``; empty: built-in defaults for the tiers, no groups."""

    addr: str = ""
    """Address this rank listens on, or the name of a network interface (``eth1``: its IPv4
    address on each host); empty means the one that routes to the store."""

    log_level: str = "WARNING"
    """Level of the ``gradsync`` logger: ``DEBUG``, ``INFO``, ``WARNING``, ``ERROR`` or
    ``CRITICAL`` (any case); other than ``WARNING``, its records go to stderr with the rank
    (``gradsync.logs``) unless the program configured logging itself."""

    timeline: str = ""
    """Path of a Chrome-trace timeline of the Horovod API's operations, recorded from ``init()``
    (rank 0 writes this path, rank r writes ``<path>.r``); empty: no timeline. Horovod's
    ``HOROVOD_TIMELINE``; ``hvd.start_timeline`` starts one later."""

    timeline_mark_cycles: bool = False
    """Mark each cycle of the background loop in the timeline (Horovod's
    ``HOROVOD_TIMELINE_MARK_CYCLES``)."""

    ps_replicas: int = 1
    """Parameter servers: servers holding each shard (``gradsync run --ps-replicas R``). The
    job's ``servers`` must be a multiple of R; the model is cut into ``servers / R`` shards and
    shard k lives on servers k, k + servers/R, ... (docs/ps.md, "Failures"). 1: no copies."""

    data_prefetch: int = 4
    """Data servers (``gradsync.data``): batches a worker's ``Loader`` keeps in flight, per
    data server and in its own queue (the credits that bound how far servers run ahead);
    the ``Loader``'s ``prefetch`` argument overrides it."""

    data_window: int = 4
    """Data servers on another host: batches a worker's ``Loader`` keeps in flight per data
    server over the connection (at most ``data_prefetch``), asked for by up to
    ``data_takes`` pipelined ``take`` requests, each of which brings the batch it asks for
    and those after it that the server has prepared already, up to its share of the
    window; 1: one batch, one take, in flight."""

    data_takes: int = 1
    """Data servers on another host: ``take`` requests a worker's ``Loader`` keeps in flight
    per data server on its one connection (at most ``data_window``). 1: one take, sent for
    the next batches as soon as the reply before it is in; above 1, pipelined, so that the
    next take already waits on the server when a batch becomes ready (measured between
    emulated hosts, no faster than 1: docs/data.md, "Between hosts, pipelined")."""

    data_cache_bytes: int = 1 << 30
    """Data servers: bytes of decoded samples (before the transform) each data server keeps in
    memory for later epochs; 0 caches nothing. Accepts 512M, 4G."""

    data_workers: int = 1
    """Data servers: producers per data server, items it prepares at once (``gradsync run
    --data-workers K``; a ``DataLoader``'s ``num_workers``). Each is a forked helper process
    (or a thread: ``data_producer``) with the server's one cache; 1: the server's own thread."""

    data_producer: str = "process"
    """Data servers: what each of ``data_workers`` > 1 producers is, ``process`` (a transform
    in Python runs on K cores) or ``thread`` (for a dataset and transform that release the
    GIL)."""

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError(f"timeouts must be positive, got timeout={self.timeout}, "
                              f"connect_timeout={self.connect_timeout}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.shm_stream not in STREAM_MODES:
            raise ConfigError(f"shm_stream must be one of {STREAM_MODES}, got "
                              f"{self.shm_stream!r}")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        for name in ("chunk_bytes", "shm_slot_bytes"):
            value = getattr(self, name)
            if value < 64 or value % 64:
                raise ConfigError(f"{name} must be a positive multiple of 64, got {value}")
        if self.small_bytes < 0 or self.medium_bytes < self.small_bytes:
            raise ConfigError(f"need 0 <= small_bytes <= medium_bytes, got {self.small_bytes}, "
                              f"{self.medium_bytes}")
        if self.fusion_threshold < 0:
            raise ConfigError(f"fusion_threshold must be >= 0, got {self.fusion_threshold}")
        if self.heartbeat_interval <= 0 or self.heartbeat_timeout < 0 or (
                self.heartbeat_timeout and self.heartbeat_timeout < 2 * self.heartbeat_interval):
            raise ConfigError("need heartbeat_interval > 0 and heartbeat_timeout 0 (off) or at "
                              f"least 2 intervals, got heartbeat_interval="
                              f"{self.heartbeat_interval}, heartbeat_timeout="
                              f"{self.heartbeat_timeout}")
        if self.ps_replicas < 1:
            raise ConfigError(f"ps_replicas must be >= 1, got {self.ps_replicas}")
        if self.data_workers < 1 or self.data_producer not in ("process", "thread"):
            raise ConfigError(f"need data_workers >= 1 and data_producer 'process' or "
                              f"'thread', got {self.data_workers}, {self.data_producer!r}")
        if self.data_window < 1 or self.data_takes < 1:
            raise ConfigError(f"need data_window >= 1 and data_takes >= 1, got "
                              f"{self.data_window}, {self.data_takes}")
        if self.data_prefetch < 1 or self.data_cache_bytes < 0:
            raise ConfigError(f"need data_prefetch >= 1 and data_cache_bytes >= 0, got "
                              f"{self.data_prefetch}, {self.data_cache_bytes}")
        if self.elastic_timeout <= 0:
            raise ConfigError(f"elastic_timeout must be positive, got {self.elastic_timeout}")
        if self.stall_report < 0 or self.flight_recorder < 0:
            raise ConfigError(f"need stall_report >= 0 and flight_recorder >= 0, got "
                              f"{self.stall_report}, {self.flight_recorder}")
        if self.straggler_interval < 0 or self.straggler_ops < 0 or \
                self.straggler_window < 1 or not 0 < self.straggler_threshold < 1:
            raise ConfigError(f"need straggler_interval >= 0, straggler_ops >= 0, "
                              f"straggler_window >= 1 and 0 < straggler_threshold < 1, got "
                              f"{self.straggler_interval}, {self.straggler_ops}, "
                              f"{self.straggler_window}, {self.straggler_threshold}")
        if self.abort_poll_interval <= 0 or self.stall_warning <= 0:
            raise ConfigError("abort_poll_interval and stall_warning must be positive")
        level = self.log_level.strip().upper()
        if level not in _LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(_LOG_LEVELS)}, "
                              f"got {self.log_level!r}")
        object.__setattr__(self, "log_level", level)  # frozen: the one normalisation

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


_SIZE = re.compile(r"(\d+)\s*([KkMmGg])(?:i?[Bb])?")
_SHIFT = {"K": 10, "M": 20, "G": 30}


def setting(name: str, environ: Mapping[str, str] | None = None):
    """One setting as ``load_config`` would give it from the environment alone (its
    ``GRADSYNC_*`` variable, else the default): for code that runs without a World."""
    field = next(f for f in fields(Config) if f.name == name)
    variable = ENV_PREFIX + name.upper()
    text = (os.environ if environ is None else environ).get(variable)
    return field.default if text is None else _parse(field, variable, text)


def _parse(field: dataclasses.Field, variable: str, text: str):
    kind = field.type
    try:
        if kind == "bool":
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind == "int":
            size = _SIZE.fullmatch(text.strip())
            if size:  # 64K, 1M, 4MiB, 2GB: binary units
                return int(size[1]) << _SHIFT[size[2].upper()]
            return int(text, 0)
        if kind == "float":
            return float(text)
        return text
    except ValueError:
        raise ConfigError(f"{variable}={text!r} is not a valid {kind}") from None


def _horovod_log_level(text: str) -> str | None:
    # Horovod's levels (lower case, as horovodrun --log-level writes them) in logging's names.
    levels = {"trace": "DEBUG", "debug": "DEBUG", "info": "INFO", "warning": "WARNING",
              "error": "ERROR", "fatal": "CRITICAL"}
    return levels.get(text.strip().lower(), text)


def _horovod_on(text: str) -> bool:
    return text.strip().lower() not in ("", "0", "false", "no", "off")


# HOROVOD_<NAME> -> (gradsync field, the GRADSYNC_* text for Horovod's text, or None to leave
# the field alone). Units: HOROVOD_FUSION_THRESHOLD is bytes, as fusion_threshold; the *_SECONDS
# and GLOO timeouts are seconds, as gradsync's timeouts.
HOROVOD_SETTINGS = {
    "HOROVOD_FUSION_THRESHOLD": ("fusion_threshold", lambda t: t),
    "HOROVOD_TIMELINE": ("timeline",
                         # DYNAMIC: no file at init, hvd.start_timeline later (as gradsync)
                         lambda t: None if t.strip().upper() == "DYNAMIC" else t),
    "HOROVOD_TIMELINE_MARK_CYCLES": ("timeline_mark_cycles", lambda t: t),
    "HOROVOD_LOG_LEVEL": ("log_level", _horovod_log_level),
    "HOROVOD_STALL_CHECK_TIME_SECONDS": ("stall_warning", lambda t: t),
    # Horovod's 0 means "never shut down"; gradsync's timeout has no "never": keep its own.
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": ("timeout",
                                            lambda t: None if float(t or 0) <= 0 else t),
    "HOROVOD_GLOO_TIMEOUT_SECONDS": ("connect_timeout", lambda t: t),
    "HOROVOD_GLOO_IFACE": ("addr", lambda t: t),  # an interface name: see world.py
    "HOROVOD_HIERARCHICAL_ALLREDUCE": ("algorithm",
                                       lambda t: "hierarchical" if _horovod_on(t) else None),
}
"""Horovod's settings that gradsync honours, each with its field and conversion."""

HOROVOD_IGNORED = frozenset({
    "HOROVOD_CYCLE_TIME",  # no fixed cycle: gradsync's background loop runs as work comes
    "HOROVOD_CACHE_CAPACITY", "HOROVOD_HIERARCHICAL_ALLGATHER", "HOROVOD_TORUS_ALLREDUCE",
    "HOROVOD_AUTOTUNE", "HOROVOD_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES",
    "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "HOROVOD_STALL_CHECK_DISABLE",
    "HOROVOD_MPI_THREADS_DISABLE", "HOROVOD_NUM_NCCL_STREAMS", "HOROVOD_THREAD_AFFINITY",
    "HOROVOD_LOG_HIDE_TIME", "HOROVOD_DISABLE_GROUP_FUSION", "HOROVOD_ENABLE_ASYNC_COMPLETION",
    "HOROVOD_BATCH_D2D_MEMCOPIES", "HOROVOD_ADASUM_MPI_CHUNK_SIZE", "HOROVOD_CCL_CACHE",
    "HOROVOD_ENABLE_XLA_OPS", "HOROVOD_DISABLE_NVTX_RANGES",
    # Not listed: HOROVOD_DYNAMIC_PROCESS_SETS, which asks for what gradsync always does
    # (hvd.add_process_set works at any time), so it is not ignored.
})
"""Horovod's runtime settings with no gradsync equivalent: reported once when set."""

_warned_ignored = False  # the report of ignored HOROVOD_* settings is made once per process
_RANK_VARIABLES = ("GRADSYNC_RANK", "HOROVOD_RANK", "RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                   "PMI_RANK")


def horovod_settings(environ: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """Horovod's settings in ``environ`` as gradsync field values, and those gradsync ignores.

    Returns:
        ``({field: text}, [ignored variable names])``; a field appears only when its
        ``GRADSYNC_*`` variable is not set (that one wins), its text in GRADSYNC_* syntax.
    """
    values: dict[str, str] = {}
    for variable, (name, convert) in HOROVOD_SETTINGS.items():
        text = environ.get(variable)
        if text is None or ENV_PREFIX + name.upper() in environ:
            continue
        try:
            converted = convert(text)
        except ValueError:
            raise ConfigError(f"{variable}={text!r} is not a valid number") from None
        if converted is not None:
            values[name] = converted
    ignored = sorted(v for v in HOROVOD_IGNORED if v in environ)
    return values, ignored


def _report_ignored(ignored: list[str], environ: Mapping[str, str]) -> None:
    global _warned_ignored
    rank = next((environ[v] for v in _RANK_VARIABLES if v in environ), "0")
    if not ignored or _warned_ignored or rank.strip() != "0":
        return
    _warned_ignored = True
    logging.getLogger("gradsync").warning(
        "gradsync ignores %s (Horovod setting%s with no gradsync equivalent; "
        "docs/configuration.md lists those it maps)", ", ".join(ignored),
        "" if len(ignored) == 1 else "s")


def load_config(overrides: Mapping[str, object] | None = None,
                environ: Mapping[str, str] | None = None) -> Config:
    """Builds the Config from keyword overrides, then ``GRADSYNC_*`` variables, then Horovod's
    (``HOROVOD_SETTINGS``), then defaults; reports the ignored ``HOROVOD_*`` ones (rank 0, once).
    """
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    by_name = {f.name: f for f in fields(Config)}
    unknown_kwargs = set(overrides) - set(by_name)
    if unknown_kwargs:
        raise ConfigError(f"unknown gradsync setting(s): {sorted(unknown_kwargs)}; "
                          f"known: {sorted(by_name)}")
    values: dict[str, Any] = {}  # each field's parsed value, checked by Config itself
    horovod, ignored = horovod_settings(environ)
    for name, text in horovod.items():
        variable = next(v for v, (n, _) in HOROVOD_SETTINGS.items()
                        if n == name and v in environ)
        values[name] = _parse(by_name[name], variable, text)
    for variable, text in environ.items():
        if not variable.startswith(ENV_PREFIX):
            continue
        name = variable[len(ENV_PREFIX):]
        if name in IDENTITY_VARIABLES:
            continue
        field = by_name.get(name.lower())
        if field is None or name != name.upper():
            raise ConfigError(f"unknown environment variable {variable}; gradsync knows "
                              + ", ".join(ENV_PREFIX + n.upper() for n in sorted(by_name)))
        values[field.name] = _parse(field, variable, text)
    values.update(overrides)
    config = Config(**values)
    logs.configure(config.log_level)  # GRADSYNC_LOG_LEVEL shows what it names, from here on
    _report_ignored(ignored, environ)
    return config
