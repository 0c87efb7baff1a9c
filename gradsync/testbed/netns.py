"""Emulated multi-host clusters on one Linux machine, built from network namespaces.

    python3 -m gradsync.testbed.netns --hosts h0:2,h1:2 [--alternate] [--rate 1gbit]
        [--delay 0.1ms] [--groups 'g0=h0,h1;g1=h2' --group-rate 200mbit --group-delay 1ms]
        [--timeout S] [--measure] [--topology-out FILE] -- python3 script.py args

Each emulated *host* is a network namespace with one interface, ``eth0``, on a private subnet
(10.213.0.0/16), and its loopback. A *switch* namespace holds the fabric: a Linux bridge per
group of hosts (one when there are no groups), each host's ``eth0`` joined to its group's
bridge by a veth pair, and with two or more groups a core bridge that each group's bridge
reaches through an *uplink*, another veth pair. Nothing is made in the machine's own
namespace, so deleting the namespaces removes every veth and bridge with them::

      ns <run>-h0                 ns <run>.switch                          ns <run>-h2
    eth0 10.213.0.1 ==== h0 ─┐                                   ┌─ h2 ==== eth0 10.213.0.3
    eth0 10.213.0.2 ==== h1 ─┴ bridge b0 ─ u0 ==== c0 ─ core ─ c1 ==== u1 ─ bridge b1

``tc`` shapes the egress of *both* ends of a link, so a rate holds in each direction:
``host_rate`` on a host's ``eth0`` and its switch port, ``group_rate`` on both ends of its
group's uplink. The shaper is a token bucket (``tbf``) whose burst covers a timer tick at the
rate (the bucket refills once per tick; a smaller burst makes throughput erratic and low). A
delay is a ``netem`` qdisc (under the ``tbf`` when both are given) on a host's ``eth0``
(``host_delay``) and on the group side of its uplink (``group_delay``): one way, hosts of a
group are ``host_delay`` apart, hosts of two groups ``host_delay + group_delay``. A kernel
without ``sch_netem`` cannot delay; asking for a delay there is a ``NetnsError``.

Namespaces are named ``<prefix>-<pid>-<n>-<host>`` and ``<prefix>-<pid>-<n>.switch``, so
concurrent runs never collide; a run first deletes the namespaces of runs whose process is
gone (a crash or SIGKILL skips their own clean-up), and always deletes its own on the way out.

Faults, for ``gradsync bench chaos``: ``Cluster.cut(host)`` takes a host's switch port down
(a pulled cable: its packets are dropped, its sockets stay) until ``cut(host,
connected=True)``; ``Cluster.reshape(host, rate, delay)`` replaces the shaping of its link
(a straggler), and the cluster's own rate and delay restore it.

A launcher that starts ranks over ssh (``gradsync run -H h0:2,h1:2``, elastic or not) reaches
the hosts through ``ssh_stand_in(cluster, folder)``: an "ssh" that runs the command in the
named host's namespace, so the job is started, watched and stopped as on real hosts.

Ranks start as an external launcher (torchrun) would start them: ``ip netns exec <host ns>``
with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (rank 0's host address),
MASTER_PORT (random; every namespace has its own ports) and GRADSYNC_HOSTNAME (the emulated
host's name, so gradsync pairs ranks of a host over shared memory and others over TCP).
Everything here needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for ``ip netns``). The commands,
the measured rates and the tests are in docs/testing.md.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..config import ENV_PREFIX, IDENTITY_VARIABLES
from ..run.hosts import parse_hosts as host_list
from ..run.hosts import rank_hosts
from ..run.processes import STOP_GRACE, Process, exit_status, pump, start, stop

__all__ = ["Cluster", "Host", "Slot", "RankResult", "NetnsError", "parse_hosts",
           "parse_groups", "parse_rate", "parse_delay", "place", "unavailable_reason",
           "cleanup_stale", "alive", "run", "rank_env", "ssh_stand_in", "measure_goodput",
           "parser", "main", "PREFIX"]

PREFIX = "gsnet"
"""Default first part of every namespace name."""

_TICK_HZ = 100  # the slowest kernel timer: a burst of rate/100 is enough at any HZ
_MIN_BURST = 64 << 10  # bytes: at least one 64 KB GSO packet, which tbf would otherwise split
_QUEUE = "25ms"  # tbf's queue, as the time it takes to drain at the rate
_NETEM_LIMIT = 100_000  # packets netem may hold: rate x delay never gets near it
_RUNS = itertools.count()
_ETC = "/etc/netns"  # ip netns exec bind-mounts /etc/netns/<ns>/<file> over /etc/<file>
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,30}")
# Variables that identify a rank to some launcher: an inherited one would contradict ours.
_LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                       "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                       "MASTER_PORT"} | {ENV_PREFIX + n for n in IDENTITY_VARIABLES}
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_", "OMPI_", "PMIX_")


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be set up; the message has the command and why."""


@dataclass(frozen=True)
class Host:
    """One emulated host: its name, rank slots, group, namespace and address."""

    name: str
    slots: int
    group: str | None = None
    ns: str = ""
    ip: str = ""


@dataclass(frozen=True)
class Slot:
    """Where one rank runs."""

    rank: int
    host: Host
    local_rank: int
    local_size: int


@dataclass
class RankResult:
    """How one rank ended: its exit status (negative: killed by that signal) and output."""

    rank: int
    host: str
    returncode: int
    output: str
    timed_out: bool = False
    """Still running at the timeout."""
    stopped: bool = False
    """Still running when the run ended it (at the timeout, or after another rank failed)."""
    ended: float = float("inf")
    """``time.monotonic()`` when its exit was seen; inf when stopped."""

    def __str__(self) -> str:
        state = "timed out" if self.timed_out else "stopped" if self.stopped else \
            f"exit {self.returncode}"
        return f"rank {self.rank} on {self.host}: {state}\n{self.output[-6000:]}"


# ---------------------------------------------------------------------- specs
def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``"h0:2,h1:1"`` -> ``[("h0", 2), ("h1", 1)]``; a host without ``:n`` has one slot (the
    rules of every host list: ``gradsync/run/hosts.py``).

    Raises:
        ValueError: a bad entry (the message quotes it), a host named twice, or no host.
    """
    return [(h.name, h.slots) for h in host_list(text, source="--hosts")]


def parse_groups(text: str) -> dict[str, list[str]]:
    """``"g0=h0,h1;g1=h2"`` -> ``{"g0": ["h0", "h1"], "g1": ["h2"]}``."""
    groups: dict[str, list[str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, eq, members = part.partition("=")
        if not eq:
            raise ValueError(f"group {part!r} is not NAME=HOST,HOST")
        groups[name.strip()] = [m.strip() for m in members.split(",") if m.strip()]
    return groups


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_DELAY_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_rate(text: str) -> int:
    """A rate as ``tc`` writes it (``1gbit``, ``200mbit``; ``bps`` is bytes/s) -> bits/s."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text.lower())
    if match is None or match.group(2) not in _RATE_UNITS:
        raise ValueError(f"rate {text!r} is not a number with a unit of "
                         f"{', '.join(_RATE_UNITS)} (e.g. 1gbit)")
    bits = int(float(match.group(1)) * _RATE_UNITS[match.group(2)])
    if bits < 8000:
        raise ValueError(f"rate {text!r} is below 8kbit")
    return bits


def parse_delay(text: str) -> float:
    """A delay such as ``0.1ms``, ``100us`` or ``1s`` -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", text.lower())
    if match is None or match.group(2) not in _DELAY_UNITS:
        raise ValueError(f"delay {text!r} is not a number with a unit of s, ms or us")
    return float(match.group(1)) * _DELAY_UNITS[match.group(2)]


def place(hosts: Sequence[Host], placement: str | Sequence[str] = "host") -> list[Slot]:
    """Numbers the ranks of ``hosts``.

    Args:
        placement: ``"host"``: in host order (all of the first host's ranks, then the
            next's), as torchrun and ``gradsync run`` number them; ``"alternate"``: round
            robin over the hosts that have slots left (with 2, 1 and 2 slots: h0 h1 h2 h0 h2);
            or one host name per rank.

    Raises:
        ValueError: an unknown placement, or host names that do not fill the slots exactly.
    """
    by_name = {h.name: h for h in hosts}
    if placement in ("host", "alternate"):
        order = rank_hosts(hosts, alternate=placement == "alternate")
    elif isinstance(placement, str):
        raise ValueError(f"placement {placement!r} is not 'host', 'alternate' or a list of "
                         "host names")
    else:
        order = list(placement)
        wanted = {h.name: h.slots for h in hosts}
        got = {name: order.count(name) for name in set(order)}
        if got != {n: c for n, c in wanted.items() if c}:
            raise ValueError(f"placement {order} does not fill the hosts' slots {wanted}")
    slots = []
    for rank, name in enumerate(order):
        mine = [r for r, n in enumerate(order) if n == name]
        slots.append(Slot(rank, by_name[name], mine.index(rank), len(mine)))
    return slots


# ---------------------------------------------------------------------- commands
def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        err = proc.stderr.strip()
        hint = ""
        if "netem" in argv and "unknown" in err.lower():
            hint = ("; this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so delays "
                    "cannot be emulated: leave the delay out or load sch_netem")
        raise NetnsError(f"{' '.join(argv)} failed ({proc.returncode}): {err}{hint}")
    return proc


def _namespaces() -> list[str]:
    out = _sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _delete_ns(ns: str) -> None:
    _sh("ip", "netns", "delete", ns, check=False)
    shutil.rmtree(os.path.join(_ETC, ns), ignore_errors=True)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here (not root, no ``ip``/``tc``), or None if they can."""
    if os.geteuid() != 0:
        return f"running as uid {os.geteuid()}, not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no '{tool}' command (install iproute2)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    try:
        _sh("ip", "netns", "add", probe)
    except (NetnsError, OSError) as exc:
        return f"'ip netns add' does not work here: {exc}"
    _sh("ip", "netns", "delete", probe, check=False)
    return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (another user's counts: the signal is refused)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Deletes the namespaces of ``prefix`` runs whose process is gone; returns their names."""
    stale = []
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)-\d+[.-]")
    etc = os.listdir(_ETC) if os.path.isdir(_ETC) else []
    for ns in sorted(set(_namespaces()) | set(etc)):
        match = pattern.match(ns)
        if match and not alive(int(match.group(1))):
            _delete_ns(ns)
            stale.append(ns)
    return stale


def _shape(ns: str, dev: str, rate: int | None, delay: float | None) -> None:
    """Rate (tbf) and delay (netem) on the egress of ``dev`` in namespace ``ns``."""
    tc = ("tc", "-n", ns, "qdisc", "add", "dev", dev)
    netem = ("netem", "delay", f"{(delay or 0) * 1e6:.0f}us", "limit", str(_NETEM_LIMIT))
    if rate is not None:
        burst = max(rate // 8 // _TICK_HZ, _MIN_BURST)
        _sh(*tc, "root", "handle", "1:", "tbf", "rate", f"{rate}bit", "burst", str(burst),
            "latency", _QUEUE)
        if delay:
            _sh(*tc, "parent", "1:1", "handle", "10:", *netem)
    elif delay:
        _sh(*tc, "root", *netem)


# ---------------------------------------------------------------------- the cluster
class Cluster:
    """An emulated cluster: ``up()`` (or ``with``) builds it, ``down()`` removes every trace.

    Args:
        hosts: ``(name, ranks)`` per host, in host order.
        groups: group name -> its hosts; every host in exactly one. None: one flat switch.
        host_rate, group_rate: rate of each host's link / each group's uplink, each
            direction, as ``tc`` writes it (``1gbit``); None: unshaped.
        host_delay, group_delay: one-way delay added when leaving a host / a group
            (``0.1ms``); needs the kernel's netem qdisc.
        prefix: first part of the namespace names.
        subnet: first two octets of the hosts' addresses (a /16).
    """

    def __init__(self, hosts: Sequence[tuple[str, int]], groups: Mapping[str, Sequence[str]]
                 | None = None, *, host_rate: str | None = None, host_delay: str | None = None,
                 group_rate: str | None = None, group_delay: str | None = None,
                 prefix: str = PREFIX, subnet: str = "10.213"):
        names = [name for name, _ in hosts]
        for name, slots in hosts:
            if not _NAME.fullmatch(name):
                raise ValueError(f"host name {name!r} must be letters, digits, '_' or '-' "
                                 "(at most 31, not starting with '-' or '_')")
            if slots < 0:
                raise ValueError(f"host {name!r} has {slots} ranks")
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be given once each, got {names}")
        group_of: dict[str, str] = {}
        for group, members in (groups or {}).items():
            if not _NAME.fullmatch(group):
                raise ValueError(f"group name {group!r} must be letters, digits, '_' or '-'")
            for member in members:
                if member not in names:
                    raise ValueError(f"group {group!r} names host {member!r}, which is not one "
                                     f"of the hosts {names}")
                if member in group_of:
                    raise ValueError(f"host {member!r} is in groups {group_of[member]!r} and "
                                     f"{group!r}")
                group_of[member] = group
        if groups and len(group_of) != len(names):
            raise ValueError(f"hosts {[n for n in names if n not in group_of]} are in no group")
        if (group_rate or group_delay) and len(groups or {}) < 2:
            raise ValueError("group_rate/group_delay need two or more groups")
        self.groups = {g: list(m) for g, m in (groups or {}).items()}
        self.host_rate = parse_rate(host_rate) if host_rate else None
        self.group_rate = parse_rate(group_rate) if group_rate else None
        self.host_delay = parse_delay(host_delay) if host_delay else None
        self.group_delay = parse_delay(group_delay) if group_delay else None
        self._spec = dict(host_rate=host_rate, host_delay=host_delay, group_rate=group_rate,
                          group_delay=group_delay)
        self.prefix = prefix
        self.run_id = f"{prefix}-{os.getpid()}-{next(_RUNS)}"
        self.switch = f"{self.run_id}.switch"
        self.hosts = [Host(name, slots, group_of.get(name), f"{self.run_id}-{name}",
                           f"{subnet}.{i // 250}.{i % 250 + 1}")
                      for i, (name, slots) in enumerate(hosts)]
        self._created: list[str] = []

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    @property
    def namespaces(self) -> list[str]:
        return [h.ns for h in self.hosts] + [self.switch]

    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Builds the namespaces, bridges, links and shaping; on any failure removes them."""
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsError(f"network namespaces are unavailable: {reason}")
        cleanup_stale(self.prefix)
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _add_ns(self, ns: str) -> None:
        self._created.append(ns)  # before: a half-made namespace must be deleted too
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        sw = ("ip", "-n", self.switch, "link")
        self._add_ns(self.switch)
        bridges = list(self.groups) or ["g0"]  # with no groups, one bridge for all
        bridge_of = {g: f"b{j}" for j, g in enumerate(bridges)}
        for bridge in bridge_of.values():
            _sh(*sw, "add", bridge, "type", "bridge")
            _sh(*sw, "set", bridge, "up")
        if len(bridges) > 1:
            _sh(*sw, "add", "core", "type", "bridge")
            _sh(*sw, "set", "core", "up")
            for j, group in enumerate(bridges):
                up, core_end = f"u{j}", f"c{j}"
                _sh(*sw, "add", up, "type", "veth", "peer", "name", core_end)
                _sh(*sw, "set", up, "master", bridge_of[group], "up")
                _sh(*sw, "set", core_end, "master", "core", "up")
                _shape(self.switch, up, self.group_rate, self.group_delay)
                _shape(self.switch, core_end, self.group_rate, None)
        for i, host in enumerate(self.hosts):
            self._add_ns(host.ns)
            port = f"h{i}"
            _sh(*sw, "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
            _sh(*sw, "set", port, "master", bridge_of[host.group or "g0"], "up")
            _sh("ip", "-n", host.ns, "addr", "add", f"{host.ip}/16", "dev", "eth0")
            _sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
            _shape(host.ns, "eth0", self.host_rate, self.host_delay)
            _shape(self.switch, port, self.host_rate, None)
            # The host names resolve inside the emulation; without them, every reverse
            # look-up of a peer's address fails (torch's store warns about each one; it
            # looks up the IPv4-mapped IPv6 form, hence the second line per host, and
            # ::ffff:127.0.0.1 for a client on the host's own loopback). A look-up that
            # the file does not answer goes to DNS, and torch's store server waits for it
            # on the thread that serves every client: with the machine's resolv.conf, a
            # server that drops queries costs 5 s a look-up (docs/troubleshooting.md,
            # "The rendezvous store stalls for 5 s"). No DNS server is reachable from the
            # emulated subnet anyway, so each host's resolv.conf names its own loopback,
            # where nothing listens: the query is refused at once.
            os.makedirs(os.path.join(_ETC, host.ns), exist_ok=True)
            with open(os.path.join(_ETC, host.ns, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n::1 localhost\n::ffff:127.0.0.1 localhost\n"
                        + "".join(f"{h.ip} {h.name}\n::ffff:{h.ip} {h.name}\n"
                                  for h in self.hosts))
            with open(os.path.join(_ETC, host.ns, "resolv.conf"), "w") as f:
                f.write("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")

    def down(self) -> None:
        """Deletes this cluster's namespaces (and with them every veth and bridge)."""
        for ns in reversed(self._created):
            _delete_ns(ns)
        self._created.clear()

    def cut(self, host: str, connected: bool = False) -> None:
        """Partitions ``host`` from every other (``connected``: joins it again).

        Its switch port goes down, as when a cable is pulled: the host's ``eth0`` loses its
        carrier, its address and sockets stay, and every packet either way is dropped until
        the port is up again (TCP retransmits; connections survive a short cut).
        """
        port = f"h{self.hosts.index(self.host(host))}"
        _sh("ip", "-n", self.switch, "link", "set", port, "up" if connected else "down")

    def reshape(self, host: str, rate: str | None, delay: str | None) -> None:
        """Replaces the shaping of ``host``'s link, both ends (None, None: unshaped), as
        ``up()`` set it: a straggler's link is ``reshape(host, slower, longer)``, and
        ``reshape(host, <the cluster's rate and delay>)`` restores it."""
        port = f"h{self.hosts.index(self.host(host))}"
        for ns, dev, host_side in ((self.host(host).ns, "eth0", True), (self.switch, port, False)):
            _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            _shape(ns, dev, parse_rate(rate) if rate else None,
                   parse_delay(delay) if delay and host_side else None)

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.host(host).ns, *argv]

    def topology_spec(self) -> dict:
        """The emulated network as a ``GRADSYNC_TOPOLOGY`` file's contents (docs/topology.md).

        Tiers that are not shaped are left out (the planner's defaults apply to them).
        """
        def tier(rate: str | None, delay: float) -> dict:
            return {**({"bandwidth": rate} if rate else {}),
                    **({"latency": f"{delay * 1e6:g}us"} if delay else {})}

        host_delay = self.host_delay or 0.0
        tiers = {"host": tier(self._spec["host_rate"], host_delay)}
        if self.groups:
            tiers["group"] = tier(self._spec["group_rate"] or self._spec["host_rate"],
                                  host_delay + (self.group_delay or 0.0))
        spec: dict = {"tiers": {name: t for name, t in tiers.items() if t}}
        if self.groups:
            spec["groups"] = self.groups
        return spec


# ---------------------------------------------------------------------- running ranks
def _base_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in environ.items()
            if k not in _LAUNCHER_VARIABLES and not k.startswith(_LAUNCHER_PREFIXES)}


def rank_env(cluster: Cluster, slot: Slot, slots: Sequence[Slot], port: int,
             job_id: str) -> dict[str, str]:
    """The torchrun-style variables of one rank, and ``GLOO_SOCKET_IFNAME=eth0``: gloo finds
    its interface by the machine's host name, which no emulated host resolves, and would
    fall back to loopback, where no peer is (torch.distributed's gloo beside gradsync)."""
    return {"RANK": str(slot.rank), "WORLD_SIZE": str(len(slots)),
            "LOCAL_RANK": str(slot.local_rank), "LOCAL_WORLD_SIZE": str(slot.local_size),
            "MASTER_ADDR": slots[0].host.ip, "MASTER_PORT": str(port),
            "GRADSYNC_HOSTNAME": slot.host.name, "GRADSYNC_JOB_ID": job_id,
            "GLOO_SOCKET_IFNAME": "eth0"}


def ssh_stand_in(cluster: Cluster, folder: str) -> str:
    """Writes an "ssh" for a launcher that reaches the emulated hosts by name; returns its path.

    ``ssh [OPTIONS] HOST COMMAND`` runs ``sh -c COMMAND`` in HOST's namespace, in a session of
    its own (as an sshd would), its stdin (the job's secret and the lifeline) passed through;
    the options ``gradsync run`` gives ssh are skipped (only the last two arguments count).
    A host the cluster does not have fails with status 255, as ssh does for an unknown host.
    """
    cases = "".join(f"  {h.name}) ns={shlex.quote(h.ns)} ;;\n" for h in cluster.hosts)
    path = os.path.join(folder, "ssh")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n# gradsync.testbed.netns: ssh to an emulated host\n"
                'while [ $# -gt 2 ]; do shift; done\ncase "$1" in\n' + cases +
                '  *) echo "no emulated host $1" >&2; exit 255 ;;\nesac\n'
                'exec ip netns exec "$ns" setsid -w sh -c "$2"\n')
    os.chmod(path, 0o755)
    return path


def run(cluster: Cluster, argv: Sequence[str], *, timeout: float | None = None,
        placement: str | Sequence[str] = "host", env: Mapping[str, str] | None = None,
        environ: Mapping[str, str] | None = None,
        on_line: Callable[[Slot, str], None] | None = None,
        stop_on_failure: bool = False) -> list[RankResult]:
    """Runs ``argv`` as every rank of ``cluster``, each in its host's namespace.

    Args:
        timeout: seconds until every rank still running is stopped (SIGTERM, then SIGKILL
            after ``STOP_GRACE`` seconds: ``gradsync/run/processes.py``) and marked
            ``timed_out``; None: no limit.
        placement: rank numbering, see ``place``.
        env: added to every rank's environment (after the launcher variables: it may
            override them).
        environ: the base environment, ``os.environ`` by default; launcher identity
            variables in it (RANK, SLURM_*, GRADSYNC_RANK, ...) are dropped.
        on_line: called with each line a rank writes (stdout and stderr merged), as it comes.
        stop_on_failure: stop the others once a rank exits non-zero, as a launcher does.

    Returns:
        One result per rank, in rank order.
    """
    slots = place(cluster.hosts, placement)
    if not slots:
        raise ValueError("the cluster has no rank slots")
    port = random.randrange(20000, 32000)  # below the ephemeral range; each ns has its own
    job_id = f"{cluster.run_id}-{port}"  # shm segment names must differ between runs
    base = _base_env(os.environ if environ is None else environ)
    base.setdefault("PYTHONUNBUFFERED", "1")
    base.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: many ranks share the cores
    ranks: list[Process] = []
    outputs: list[list[str]] = [[] for _ in slots]
    ended: dict[int, float] = {}  # rank -> when its exit was seen, first failure first
    readers = []
    timed_out = False
    try:
        for slot in slots:
            e = {**base, **rank_env(cluster, slot, slots, port, job_id), **(env or {})}
            # Each rank leads a session of its own, so the stop reaches what it started.
            ranks.append(start(cluster.exec_argv(slot.host.name, argv), e, merge_stderr=True,
                               text=True))
            readers.append(pump(ranks[-1].proc.stdout, _collector(slot, outputs[slot.rank],
                                                                  on_line),
                                f"netns-output-{slot.rank}"))
        end = None if timeout is None else time.monotonic() + timeout
        while len(ended) < len(ranks):
            now = time.monotonic()
            for rank, p in enumerate(ranks):
                if rank not in ended and p.poll() is not None:
                    ended[rank] = now
            if stop_on_failure and any(ranks[r].poll() for r in ended):
                break
            if end is not None and now >= end:
                timed_out = len(ended) < len(ranks)
                break
            time.sleep(0.05)
    finally:
        stop(ranks, STOP_GRACE)
        for reader in readers:
            reader.join(2.0)
    return [RankResult(s.rank, s.host.name, p.proc.returncode, "".join(out),
                       timed_out=timed_out and s.rank not in ended,
                       stopped=s.rank not in ended, ended=ended.get(s.rank, float("inf")))
            for s, p, out in zip(slots, ranks, outputs)]


def _collector(slot: Slot, lines: list[str], on_line) -> Callable[[str], None]:
    """Keeps each line of ``slot``'s rank in ``lines`` and hands it to ``on_line``."""
    def collect(line: str) -> None:
        lines.append(line)
        if on_line is not None:
            on_line(slot, line)
    return collect


_RECEIVER = r"""
import socket, sys, time
srv = socket.socket(); srv.bind(("0.0.0.0", int(sys.argv[1]))); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept(); buf = bytearray(1 << 20); total = 0; start = None
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    if start is None:
        start, n = time.perf_counter(), 0  # time from the first byte: no connect, no start-up
    total += n
print(total / (time.perf_counter() - start), flush=True)
"""

_SENDER = r"""
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
data, end = b"\0" * (1 << 20), time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    conn.sendall(data)
conn.close()
"""


def measure_goodput(cluster: Cluster, src: str, dst: str, seconds: float = 1.0) -> float:
    """TCP goodput (payload bytes/s) of one stream from host ``src`` to host ``dst``."""
    port = str(random.randrange(20000, 32000))
    receiver = subprocess.Popen(cluster.exec_argv(dst, [sys.executable, "-c", _RECEIVER, port]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if receiver.stdout.readline().strip() != "ready":
            raise NetnsError(f"goodput receiver on {dst} failed: {receiver.communicate()[1]}")
        subprocess.run(cluster.exec_argv(src, [sys.executable, "-c", _SENDER,
                                               cluster.host(dst).ip, port, str(seconds)]),
                       check=True, capture_output=True, timeout=seconds + 30)
        out, err = receiver.communicate(timeout=30)
        try:
            return float(out.strip())
        except ValueError:
            raise NetnsError(f"goodput receiver on {dst} printed {out!r}: {err}") from None
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


# ---------------------------------------------------------------------- command line
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m gradsync.testbed.netns", formatter_class=argparse.RawTextHelpFormatter,
        description="Run a command's ranks on an emulated multi-host network (needs root).",
        epilog="example: python3 -m gradsync.testbed.netns --hosts h0:2,h1:2 --rate 1gbit -- "
               "python3 -m gradsync.bench.allreduce --sizes 64M:64M")
    net = p.add_argument_group("network")
    net.add_argument("--hosts", required=True, help="hosts and their ranks: h0:2,h1:2")
    net.add_argument("--groups", help="groups of hosts behind a shared uplink: 'g0=h0,h1;g1=h2'")
    net.add_argument("--rate", help="each host link's rate, each direction (1gbit)")
    net.add_argument("--delay", help="one-way delay leaving a host (0.1ms; needs netem)")
    net.add_argument("--group-rate", help="each group uplink's rate, each direction")
    net.add_argument("--group-delay", help="one-way delay leaving a group (needs netem)")
    job = p.add_argument_group("ranks")
    job.add_argument("--alternate", action="store_true",
                     help="number ranks round robin over the hosts (default: host order)")
    job.add_argument("--timeout", type=float, help="stop every rank after this many seconds")
    job.add_argument("--measure", action="store_true",
                     help="first measure and print TCP goodput from the first host to the "
                          "others")
    job.add_argument("--topology-out", metavar="FILE",
                     help="write the network as a GRADSYNC_TOPOLOGY file and export "
                          "GRADSYNC_TOPOLOGY=FILE to the ranks")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        parser().error("give the command after '--': ... -- python3 script.py")
    split = argv.index("--")
    args, command = parser().parse_args(argv[:split]), argv[split + 1:]
    if not command:
        parser().error("no command after '--'")
    try:
        cluster = Cluster(parse_hosts(args.hosts),
                          parse_groups(args.groups) if args.groups else None,
                          host_rate=args.rate, host_delay=args.delay,
                          group_rate=args.group_rate, group_delay=args.group_delay)
    except ValueError as exc:
        parser().error(str(exc))
    # SIGTERM and SIGHUP end the run through the finally blocks, so the namespaces go too.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda n, _: sys.exit(128 + n))
    lock = threading.Lock()

    def echo(slot: Slot, line: str) -> None:
        with lock:
            sys.stdout.write(f"[{slot.rank}]<{slot.host.name}>:{line}"
                             + ("" if line.endswith("\n") else "\n"))
            sys.stdout.flush()

    env = {}
    try:
        with cluster:
            hosts = ", ".join(f"{h.name}={h.ip}" + (f" ({h.group})" if h.group else "")
                              for h in cluster.hosts)
            print(f"netns: {cluster.run_id}: {hosts}; host rate {args.rate or 'unshaped'}"
                  + (f", group rate {args.group_rate or 'unshaped'}" if args.groups else ""),
                  flush=True)
            if args.measure:
                first = cluster.hosts[0].name
                for other in cluster.hosts[1:]:
                    rate = measure_goodput(cluster, first, other.name)
                    print(f"netns: goodput {first} -> {other.name}: {rate / 1e6:.1f} MB/s "
                          f"({rate * 8 / 1e6:.0f} Mbit/s)", flush=True)
            if args.topology_out:
                import json

                with open(args.topology_out, "w") as f:
                    json.dump(cluster.topology_spec(), f, indent=1)
                env["GRADSYNC_TOPOLOGY"] = os.path.abspath(args.topology_out)
            results = run(cluster, command, timeout=args.timeout, env=env, on_line=echo,
                          placement="alternate" if args.alternate else "host",
                          stop_on_failure=True)
    except NetnsError as exc:
        print(f"netns: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the ranks were stopped and the namespaces deleted on the way
        return 128 + signal.SIGINT
    timed_out = [r.rank for r in results if r.timed_out]
    if timed_out:
        print(f"netns: ranks {timed_out} passed the {args.timeout:g}s timeout and were stopped",
              file=sys.stderr)
    failed = sorted((r for r in results if r.returncode != 0 and not r.stopped),
                    key=lambda r: r.ended)
    if not failed:
        return 124 if timed_out else 0  # as timeout(1) does
    first = failed[0]
    status = exit_status(first.returncode)
    print(f"netns: rank {first.rank} on {first.host} "
          + (f"exited with status {status}" if first.returncode > 0 else
             f"was killed by signal {-first.returncode}"), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
