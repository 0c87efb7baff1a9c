"""The job's network as a hierarchy of tiers: ranks on hosts, hosts in optional groups.

Three tiers, from fast to slow:

    local   between two ranks of one host (shared memory)
    host    between two hosts of one group (a NIC, a top-of-rack switch)
    group   between two groups of hosts (switch uplinks between racks)

Each tier has a ``bandwidth`` (bytes/s of one link, each direction) and a ``latency``
(seconds per message). Which rank is on which host comes from the launch (host names after
the rendezvous); the tiers' constants and the groups come from a file named by
``GRADSYNC_TOPOLOGY`` (written by ``gradsync probe``, or by hand), else from defaults.

The file is JSON, or YAML when PyYAML is installed and the name ends in .yaml/.yml::

    {
      "tiers": {
        "local": {"bandwidth": "8GB/s",     "latency": "2us"},
        "host":  {"bandwidth": "1Gbit/s",   "latency": "60us"},
        "group": {"bandwidth": "200Mbit/s", "latency": "200us"}
      },
      "reduce_bandwidth": "6GB/s",
      "groups": {"rack0": ["node1", "node2"], "rack1": ["node3"]}
    }

Every key is optional; an unknown key, a bad unit or a host of the job that is in no group
(when groups are given) is an error naming the field. Bandwidths take B/s or bit/s with
K/M/G (decimal, as network rates are quoted; ``1gbit`` as tc writes it works too), latencies
s/ms/us/ns; plain numbers are bytes/s and seconds.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import ConfigError

__all__ = ["Tier", "Topology", "TIERS", "DEFAULT_TIERS", "load", "parse", "parse_bandwidth",
           "parse_latency", "to_dict"]

TIERS = ("local", "host", "group")


@dataclass(frozen=True)
class Tier:
    bandwidth: float
    """Bytes per second of one link, in each direction."""
    latency: float
    """Seconds per message."""


# Defaults when nothing was declared or measured: a shared-memory copy, a 10 Gbit/s NIC, a
# 4:1 oversubscribed uplink. ``gradsync probe`` replaces them with measured figures.
DEFAULT_TIERS = {"local": Tier(8e9, 2e-6), "host": Tier(1.25e9, 50e-6),
                 "group": Tier(0.3125e9, 100e-6)}
DEFAULT_REDUCE_BANDWIDTH = 6e9


@dataclass(frozen=True)
class Topology:
    """Where every rank is, and what the links between them cost.

    Attributes:
        hosts: host names, in order of their first rank.
        host_of: the host index of each rank.
        groups: group names (one group, ``""``, when none were declared).
        group_of: the group index of each host.
        tiers: a Tier for each name in TIERS.
        reduce_bandwidth: bytes/s at which one rank folds one array into another.
        declared: the tiers whose constants a file gave (``gradsync probe``'s, or one written
            by hand); the others hold ``DEFAULT_TIERS``' guesses, which the run-time planner
            checks by measuring where its choice is close (``planner.TRIAL_MARGIN``). Not
            compared: two topologies of the same constants describe the same network.
    """

    hosts: tuple[str, ...]
    host_of: tuple[int, ...]
    groups: tuple[str, ...] = ("",)
    group_of: tuple[int, ...] = ()
    tiers: Mapping[str, Tier] = field(default_factory=lambda: dict(DEFAULT_TIERS))
    reduce_bandwidth: float = DEFAULT_REDUCE_BANDWIDTH
    declared: frozenset = field(default=frozenset(), compare=False)  # whence, not what

    def __post_init__(self):
        if not self.group_of:
            object.__setattr__(self, "group_of", (0,) * len(self.hosts))

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def from_hosts(cls, host_names: Sequence[str], spec: "Mapping | None" = None) -> "Topology":
        """The topology of ranks on ``host_names`` (one per rank), with ``spec`` (a parsed file)."""
        hosts = tuple(dict.fromkeys(host_names))
        topo = cls(hosts, tuple(hosts.index(h) for h in host_names))
        return topo if spec is None else parse(spec, topo)

    # --- queries ----------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.host_of)

    def slowest(self, ranks: "Sequence[int] | None" = None) -> "str | None":
        """The slowest tier between any two of ``ranks`` (all when None); None for one host."""
        hosts = {self.host_of[r] for r in (range(self.size) if ranks is None else ranks)}
        if len(hosts) < 2:
            return None
        return "group" if len({self.group_of[h] for h in hosts}) > 1 else "host"

    def guessed(self) -> bool:
        """Whether the slowest tier between the ranks holds ``DEFAULT_TIERS``' guess (no file
        declared it); False on one host. Where it does, the planner measures its close calls
        (``planner.Plans``)."""
        return self.slowest() not in (None, *self.declared)

    def tier(self, a: int, b: int) -> str:
        """The slowest tier between ranks ``a`` and ``b``."""
        ha, hb = self.host_of[a], self.host_of[b]
        if ha == hb:
            return "local"
        return "host" if self.group_of[ha] == self.group_of[hb] else "group"

    def ring_order(self, ranks: "Sequence[int] | None" = None) -> list[int]:
        """``ranks`` ordered so that a ring through them crosses each slow tier least often.

        Ranks of a host are adjacent and hosts of a group are adjacent, so a ring over H hosts
        in G groups crosses the group tier G times (once per group boundary, 0 when G = 1)
        and the host tier H times; no order crosses fewer (every group, and every host, must
        be entered and left once when there are several).
        """
        return sorted(range(self.size) if ranks is None else ranks, key=self._key)

    def crossings(self, order: Sequence[int]) -> dict[str, int]:
        """How many edges of the ring ``order`` cross each tier (the slowest tier per edge)."""
        counts = dict.fromkeys(TIERS, 0)
        if len(order) > 1:
            for a, b in zip(order, list(order[1:]) + [order[0]]):
                counts[self.tier(a, b)] += 1
        return counts

    def _key(self, r: int) -> tuple[int, int, int]:
        h = self.host_of[r]
        return self.group_of[h], h, r

    def describe(self) -> str:
        lines = []
        for g, name in enumerate(self.groups):
            for h, host in enumerate(self.hosts):
                if self.group_of[h] == g:
                    ranks = [r for r in range(self.size) if self.host_of[r] == h]
                    lines.append(f"{(name + '/') if name else ''}{host}: ranks {ranks}")
        for t in TIERS:
            tier = self.tiers[t]
            lines.append(f"tier {t}: {tier.bandwidth / 1e9:.3g} GB/s, "
                         f"{tier.latency * 1e6:.3g} us")
        lines.append(f"reduce: {self.reduce_bandwidth / 1e9:.3g} GB/s")
        return "\n".join(lines)


# --- the file ---------------------------------------------------------------------------------

_RATE = re.compile(r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]?)(i?)(b|B|bit|bits|byte|bytes|bps)?"
                   r"(?:/s|ps)?\s*")
_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TIME = re.compile(r"\s*([0-9.eE+-]+)\s*(s|ms|us|µs|ns)?\s*")
_SECONDS = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_bandwidth(value, where: str = "bandwidth") -> float:
    """Bytes/s from a number (bytes/s) or text such as ``1Gbit/s``, ``1gbit``, ``125MB/s``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        m = _RATE.fullmatch(str(value))
        if not m:
            raise ConfigError(f"{where}: {value!r} is not a bandwidth (e.g. '1Gbit/s', '125MB/s')")
        prefix, binary, unit = m[2].lower(), m[3], m[4] or "B"
        scale = (_BINARY if binary else _PREFIX)[prefix]
        bits = unit in ("b", "bit", "bits", "bps")
        try:
            number = float(m[1]) * scale / (8 if bits else 1)
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not a bandwidth") from None
    if not number > 0:
        raise ConfigError(f"{where}: must be positive, got {value!r}")
    return number


def parse_latency(value, where: str = "latency") -> float:
    """Seconds from a number (seconds) or text such as ``50us``, ``0.1ms``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    else:
        m = _TIME.fullmatch(str(value))
        if not m:
            raise ConfigError(f"{where}: {value!r} is not a latency (e.g. '50us', '0.1ms')")
        try:
            number = float(m[1]) * _SECONDS[m[2]]
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not a latency") from None
    if number < 0:
        raise ConfigError(f"{where}: must not be negative, got {value!r}")
    return number


def parse(spec: Mapping, topo: Topology, source: str = "topology") -> Topology:
    """Applies a parsed topology file to ``topo`` (the placement); errors name the field."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(spec).__name__}")
    unknown = set(spec) - {"tiers", "reduce_bandwidth", "groups", "measured"}
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {sorted(unknown)}; known: groups, "
                          "measured (informative, written by gradsync probe), "
                          "reduce_bandwidth, tiers")
    tiers = dict(topo.tiers)
    declared = spec.get("tiers", {})
    if not isinstance(declared, Mapping):
        raise ConfigError(f"{source}: tiers must be a mapping of tier name to "
                          "{bandwidth, latency}")
    for name, entry in declared.items():
        where = f"{source}: tiers.{name}"
        if name not in TIERS:
            raise ConfigError(f"{where}: unknown tier; tiers are {', '.join(TIERS)}")
        if not isinstance(entry, Mapping) or set(entry) - {"bandwidth", "latency"}:
            raise ConfigError(f"{where}: must be a mapping with bandwidth and/or latency")
        tier = tiers[name]
        if "bandwidth" in entry:
            tier = replace(tier, bandwidth=parse_bandwidth(entry["bandwidth"], where + ".bandwidth"))
        if "latency" in entry:
            tier = replace(tier, latency=parse_latency(entry["latency"], where + ".latency"))
        tiers[name] = tier
    reduce_bw = topo.reduce_bandwidth
    if "reduce_bandwidth" in spec:
        reduce_bw = parse_bandwidth(spec["reduce_bandwidth"], f"{source}: reduce_bandwidth")
    groups, group_of = topo.groups, topo.group_of
    if "groups" in spec:
        declared_groups = spec["groups"]
        if not isinstance(declared_groups, Mapping) or not all(
                isinstance(v, list) and all(isinstance(h, str) for h in v)
                for v in declared_groups.values()):
            raise ConfigError(f"{source}: groups must map each group name to a list of host "
                              "names")
        where_is: dict[str, str] = {}
        for g, members in declared_groups.items():
            for h in members:
                if h in where_is:
                    raise ConfigError(f"{source}: groups: host {h!r} is in both {where_is[h]!r} "
                                      f"and {g!r}")
                where_is[h] = g
        missing = [h for h in topo.hosts if h not in where_is]
        if missing:
            raise ConfigError(f"{source}: groups: host(s) {missing} of this job are in no group")
        names = list(dict.fromkeys(where_is[h] for h in topo.hosts))
        groups, group_of = tuple(names), tuple(names.index(where_is[h]) for h in topo.hosts)
    return Topology(topo.hosts, topo.host_of, groups, group_of, tiers, reduce_bw,
                    topo.declared | frozenset(declared))


def load(path: "str | Path") -> dict:
    """Reads a topology file (JSON, or YAML by extension when PyYAML is installed)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"GRADSYNC_TOPOLOGY={path}: cannot read it: {exc}") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml); or "
                              "write the file as JSON") from None
        try:
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None


def to_dict(topo: Topology) -> dict:
    """The file form of ``topo``'s tiers, reduce bandwidth and groups (for ``gradsync probe``)."""
    out: dict = {"tiers": {t: {"bandwidth": topo.tiers[t].bandwidth,
                               "latency": topo.tiers[t].latency} for t in TIERS},
                 "reduce_bandwidth": topo.reduce_bandwidth}
    if topo.groups != ("",):
        out["groups"] = {g: [h for i, h in enumerate(topo.hosts) if topo.group_of[i] == gi]
                         for gi, g in enumerate(topo.groups)}
    return out
