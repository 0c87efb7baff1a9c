"""A cluster file: the network of a (real or planned) cluster as tiers of identical units.

Tiers go from the inside out. The first is inside a node (GPU to GPU: NVLink, PCIe, shared
memory) and joins its ``ranks_per_node`` ranks; every further tier joins ``fanout`` units of
the tier below (nodes into a rack, racks into a pod, ...); the last joins the whole cluster,
and its ``fanout``, when given, bounds how many units it holds::

    {
      "name": "example",
      "ranks_per_node": 4,
      "reduce_bandwidth": "50GB/s",
      "tiers": [
        {"name": "nvlink", "bandwidth": "40GB/s", "latency": "5us"},
        {"name": "rack",  "fanout": 16, "bandwidth": "100Gbit/s", "latency": "3us"},
        {"name": "spine", "fanout": 32, "bandwidth": "100Gbit/s", "latency": "5us",
         "oversubscription": 2}
      ],
      "jitter_cv": 0.02,
      "jitter_source": "where the 2% comes from",
      "persistent_cv": 0.01,
      "persistent_source": "where the 1% comes from",
      "source": "where the numbers come from",
      "assumed": ["which numbers were assumed, and why"]
    }

``bandwidth`` is per endpoint, each direction: per rank on the first tier, per *node* on the
others (the rate of a node's NICs into that tier). A unit of tier t (a node for t = 1, a rack
for t = 2, ...) reaches the tiers above through an uplink of ``nodes in the unit x bandwidth /
oversubscription`` that the messages leaving it at the same time share; a message inside a
node gets the first tier's bandwidth to itself. ``latency`` is seconds per message between
two units of the tier. Units: those of ``gradsync/cluster/topology.py`` (``25Gbit/s``, ``12.5GB/s``,
``2us``). Each tier and the file may say ``source`` (text) and ``assumed`` (list of text):
they are printed by ``gradsync simulate --validate`` and never read as numbers.

``jitter_cv`` (default 0: every rank computes in exactly the model's time) is the coefficient
of variation of one rank's compute time per step on this cluster; a synchronous step waits for
the slowest rank (``straggle.py``). ``jitter_source`` says where the number comes from.
``persistent_cv`` (default 0) is the coefficient of variation of the GPUs' own speeds: one GPU
slower than another on every step (manufacturing and power management), the same for the whole
job; ``persistent_source`` says where it comes from. Both are shares of the mean compute time.

``compress_seconds_per_element`` (optional) maps a compression kind (``bf16``, ``int8``,
``int4``, ``fp8``, ``powersgd``, ``randomk``) to the seconds one rank's compressor spends per gradient
element (compress, reduce its share, decompress), as ``python3 -m gradsync.simulate.calibrate``
measures it on a machine of the cluster; ``compress_source`` says where the numbers come from.
A kind it does not name is charged its passes over memory at ``reduce_bandwidth``
(``compression.py``).

Files ship in ``gradsync/simulate/clusters/``; ``load("summit")`` finds them by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

from ..cluster.topology import load as _load_file, parse_bandwidth, parse_latency
from ..errors import ConfigError

__all__ = ["ClusterTier", "Cluster", "parse", "load", "shipped", "CLUSTERS_DIR"]

CLUSTERS_DIR = Path(__file__).parent / "clusters"
_TOP = {"name", "ranks_per_node", "tiers", "reduce_bandwidth", "jitter_cv", "jitter_source",
        "persistent_cv", "persistent_source", "source", "assumed",
        "compress_seconds_per_element", "compress_source"}
_COMPRESS_KINDS = ("fp16", "bf16", "int8", "int4", "fp8", "powersgd", "randomk")
_TIER = {"name", "fanout", "bandwidth", "latency", "oversubscription", "source", "assumed"}


@dataclass(frozen=True)
class ClusterTier:
    name: str
    bandwidth: float
    """Bytes/s per endpoint, each direction: per rank (first tier) or per node (others)."""
    latency: float
    """Seconds per message between two units of this tier."""
    fanout: int = 0
    """Units of the tier below in one unit of this tier (first tier: ranks_per_node; the last
    tier: 0 for no bound)."""
    oversubscription: float = 1.0
    """Downlink over uplink rate of this tier's switches."""


@dataclass(frozen=True)
class Cluster:
    """Tiers of identical units, inside out; ranks are placed in blocks (node by node)."""

    name: str
    ranks_per_node: int
    tiers: tuple[ClusterTier, ...]
    reduce_bandwidth: float
    source: str = ""
    assumed: tuple[str, ...] = ()
    jitter_cv: float = 0.0
    """Coefficient of variation of one rank's compute time per step (0: no stragglers)."""
    jitter_source: str = ""
    persistent_cv: float = 0.0
    """Coefficient of variation of the GPUs' own speeds, fixed for a job (0: all alike)."""
    persistent_source: str = ""
    compress_seconds_per_element: dict = field(default_factory=dict)
    """Measured compression compute per element, by kind (``compression.rate``)."""
    compress_source: str = ""

    def unit_ranks(self) -> list[float]:
        """Ranks in one unit of each level: ``[1 (a rank), a node, a rack, ..., inf]``."""
        sizes = [1, self.ranks_per_node]
        for tier in self.tiers[1:-1]:
            sizes.append(sizes[-1] * tier.fanout)
        return sizes + [math.inf]

    def uplinks(self) -> list[float]:
        """Bytes/s out of one unit of each level into the tiers above (index 0, a rank: its
        first-tier bandwidth; 1, a node: its NICs; 2, a rack: its uplink; ...)."""
        out, nodes = [self.tiers[0].bandwidth], 1
        for level, tier in enumerate(self.tiers[1:], 1):
            out.append(nodes * tier.bandwidth / tier.oversubscription)
            nodes *= tier.fanout if level < len(self.tiers) - 1 else 1
        return out

    @property
    def capacity(self) -> float:
        """The most ranks the cluster holds (inf when the last tier has no fanout)."""
        top = self.tiers[-1].fanout if len(self.tiers) > 1 else 1
        return self.unit_ranks()[-2] * top if top else math.inf

    def with_free_tier(self, index: int) -> "Cluster":
        """The same cluster with tier ``index`` infinitely fast (to see what it costs)."""
        tiers = list(self.tiers)
        tiers[index] = replace(tiers[index], bandwidth=math.inf, latency=0.0)
        return replace(self, tiers=tuple(tiers))


def parse(spec: Mapping, source: str = "cluster") -> Cluster:
    """A Cluster from a parsed file; errors name the field."""
    if not isinstance(spec, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping")
    _fields(spec, source, _TOP, ("ranks_per_node", "tiers"))
    rpn = spec["ranks_per_node"]
    if not isinstance(rpn, int) or isinstance(rpn, bool) or rpn < 1:
        raise ConfigError(f"{source}: ranks_per_node must be a positive integer, got {rpn!r}")
    raw = spec["tiers"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{source}: tiers must be a non-empty list, inside out")
    tiers = []
    for i, entry in enumerate(raw):
        where = f"{source}: tiers[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: must be a mapping")
        _fields(entry, where, _TIER, ("bandwidth", "latency"))
        fanout = entry.get("fanout", rpn if i == 0 else 0)
        last = i == len(raw) - 1
        if i == 0 and fanout != rpn:
            raise ConfigError(f"{where}.fanout: the first tier joins the ranks of a node "
                              f"(ranks_per_node={rpn}), got {fanout!r}")
        if not isinstance(fanout, int) or isinstance(fanout, bool) or fanout < 0 or \
                (fanout == 0 and not last) or (i > 0 and not last and fanout < 2):
            raise ConfigError(f"{where}.fanout: must be an integer >= 2 (0 = unbounded, last "
                              f"tier only), got {fanout!r}")
        over = entry.get("oversubscription", 1)
        if not isinstance(over, (int, float)) or isinstance(over, bool) or over < 1:
            raise ConfigError(f"{where}.oversubscription: must be a number >= 1, got {over!r}")
        _text(entry, where)
        tiers.append(ClusterTier(str(entry.get("name", f"tier{i}")),
                                 parse_bandwidth(entry["bandwidth"], where + ".bandwidth"),
                                 parse_latency(entry["latency"], where + ".latency"),
                                 fanout, float(over)))
    _text(spec, source)
    spread = {}
    for key in ("jitter", "persistent"):
        value = spec.get(f"{key}_cv", 0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < 1:
            raise ConfigError(f"{source}: {key}_cv must be a number in [0, 1), got {value!r}")
        if not isinstance(spec.get(f"{key}_source", ""), str):
            raise ConfigError(f"{source}: {key}_source must be text")
        spread[key] = float(value)
    reduce_bw = parse_bandwidth(spec.get("reduce_bandwidth", "6GB/s"),
                                f"{source}: reduce_bandwidth")
    rates = spec.get("compress_seconds_per_element", {})
    if not isinstance(rates, Mapping) or not all(
            k in _COMPRESS_KINDS and isinstance(v, (int, float)) and not isinstance(v, bool)
            and v >= 0 for k, v in rates.items()):
        raise ConfigError(f"{source}: compress_seconds_per_element must map kinds of "
                          f"{', '.join(_COMPRESS_KINDS)} to seconds >= 0, got {rates!r}")
    if not isinstance(spec.get("compress_source", ""), str):
        raise ConfigError(f"{source}: compress_source must be text")
    return Cluster(str(spec.get("name", source)), rpn, tuple(tiers), reduce_bw,
                   spec.get("source", ""), tuple(spec.get("assumed", ())), spread["jitter"],
                   spec.get("jitter_source", ""), spread["persistent"],
                   spec.get("persistent_source", ""),
                   {k: float(v) for k, v in rates.items()}, spec.get("compress_source", ""))


def _fields(entry: Mapping, where: str, known, required) -> None:
    """Refuses fields outside ``known`` and a missing ``required`` one, naming them."""
    unknown = set(entry) - known
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}; known: {sorted(known)}")
    for key in required:
        if key not in entry:
            raise ConfigError(f"{where}: {key} is required")


def _text(entry: Mapping, where: str) -> None:
    if not isinstance(entry.get("source", ""), str):
        raise ConfigError(f"{where}.source: must be text")
    assumed = entry.get("assumed", [])
    if not isinstance(assumed, list) or not all(isinstance(a, str) for a in assumed):
        raise ConfigError(f"{where}.assumed: must be a list of text")


def shipped() -> list[str]:
    """Names of the cluster files shipped with gradsync."""
    return sorted(p.stem for p in CLUSTERS_DIR.glob("*.json"))


def load(name_or_path: "str | Path") -> Cluster:
    """A cluster file by path (JSON, or YAML with PyYAML), or a shipped one by name."""
    path = Path(name_or_path)
    if not path.exists():
        candidate = CLUSTERS_DIR / f"{name_or_path}.json"
        if not candidate.exists():
            raise ConfigError(f"cluster {str(name_or_path)!r}: no such file, and not a shipped "
                              f"cluster ({', '.join(shipped())})")
        path = candidate
    try:
        spec = _load_file(path)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("GRADSYNC_TOPOLOGY=", "")) from None
    return parse(spec, path.name)


