"""The one configuration object, built once at ``init()``.

Precedence: keyword arguments to ``init()``, then ``GRADSYNC_<FIELD>`` environment variables,
then the defaults below. Unknown ``GRADSYNC_*`` names and bad values fail loudly, naming the
variable. The README's configuration table lists the same fields.

Launcher-provided identity (rank, world size, store address, secret) is read by
``gradsync.launch_env``; this module owns the tunables.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, fields
from typing import Mapping

from .errors import ConfigError

__all__ = ["Config", "load_config", "ENV_PREFIX", "IDENTITY_VARIABLES"]

ENV_PREFIX = "GRADSYNC_"

# Variables the launcher sets for its ranks. They are read by launch_env, not here, but they
# are legitimate GRADSYNC_* names, so the unknown-name check must not reject them.
IDENTITY_VARIABLES = frozenset(
    {
        "RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
        "STORE_ADDR", "STORE_PORT", "SECRET", "JOB_ID", "LAUNCHER_PID", "HOSTNAME", "SERVERS",
        "ELASTIC_ID",
        "BIND",  # not an identity: gradsync run's --bind-to default, read by the launcher
    }
)

TRANSPORTS = ("auto", "tcp", "shm")
ALGORITHMS = ("auto", "ring", "topo_ring", "doubling", "halving_doubling", "hierarchical", "shm")


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
    """Ring allreduces of 4 MiB or more with a TCP connection in the ring measure their segment
    size, each power of 4 of sizes on its own: the first ones cut segments of ``chunk_bytes``
    and of a quarter of it in turns, and the ranks keep the faster together
    (``transport/comm.py``, ``Comm.segments``); false always cuts ``chunk_bytes``."""

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

    abort_poll_interval: float = 0.1
    """Seconds between checks of the job's abort flag while a rank waits."""

    heartbeat_interval: float = 1.0
    """Seconds between a rank's heartbeats (and its looks at the peers it watches)."""

    heartbeat_timeout: float = 15.0
    """Seconds without a heartbeat after which a peer that is alive but silent (stopped, stuck,
    cut off) is lost: every rank then raises PeerLostError naming it. 0 turns heartbeats off
    (a silent peer is then only caught by ``timeout``)."""

    elastic_timeout: float = 600.0
    """Elastic jobs: seconds a worker waits for the next generation of the job to be formed
    (``gradsync run --elastic-timeout`` sets it for its workers)."""

    topology: str = ""
    """Path of a topology file (tiers' bandwidth and latency, groups of hosts; JSON or YAML),
    as written by ``gradsync probe``; empty: built-in defaults for the tiers, no groups."""

    addr: str = ""
    """Address this rank listens on; empty means the one that routes to the store."""

    log_level: str = "WARNING"
    """Level of the ``gradsync`` logger (only set when this is not the default)."""

    timeline: str = ""
    """Path of a Chrome-trace timeline of the Horovod API's operations, recorded from ``init()``
    (rank 0 writes this path, rank r writes ``<path>.r``); empty: no timeline. Horovod's
    ``HOROVOD_TIMELINE``; ``hvd.start_timeline`` starts one later."""

    timeline_mark_cycles: bool = False
    """Mark each cycle of the background loop in the timeline (Horovod's
    ``HOROVOD_TIMELINE_MARK_CYCLES``)."""

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError(f"timeouts must be positive, got timeout={self.timeout}, "
                              f"connect_timeout={self.connect_timeout}")
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
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
        if self.elastic_timeout <= 0:
            raise ConfigError(f"elastic_timeout must be positive, got {self.elastic_timeout}")
        if self.abort_poll_interval <= 0 or self.stall_warning <= 0:
            raise ConfigError("abort_poll_interval and stall_warning must be positive")

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)


_SIZE = re.compile(r"(\d+)\s*([KkMmGg])(?:i?[Bb])?")
_SHIFT = {"K": 10, "M": 20, "G": 30}


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


def load_config(overrides: Mapping[str, object] | None = None,
                environ: Mapping[str, str] | None = None) -> Config:
    """Builds the Config from keyword overrides, then ``GRADSYNC_*`` variables, then defaults."""
    environ = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    by_name = {f.name: f for f in fields(Config)}
    unknown_kwargs = set(overrides) - set(by_name)
    if unknown_kwargs:
        raise ConfigError(f"unknown gradsync setting(s): {sorted(unknown_kwargs)}; "
                          f"known: {sorted(by_name)}")
    values: dict[str, object] = {}
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
    return Config(**values)
