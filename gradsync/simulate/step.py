"""One training step at scale: compute, gradient buckets, and their allreduces overlapping it.

The step of data-parallel training with bucketed gradients (Horovod's tensor fusion, DDP's
buckets), per rank and identical on every rank:

    forward  [0, F)                       F = compute x (1 - backward_fraction)
    backward [F, F + B)                   B = compute x backward_fraction
    bucket i (in the order backward fills them) is ready at
        ready_i = F + B x (gradient bytes up to the end of bucket i) / (all gradient bytes)
    its allreduce starts when it is ready and the previous one is done, one at a time:
        start_i = max(ready_i, done_{i-1}),   done_i = start_i + allreduce(bucket_i)
    step = max(F + B, done_last) + update

Backward produces gradient bytes at an even rate (the assumption ``ready=uniform``; real
networks are uneven: VGG's fully connected layers, most of its bytes, come out first). The
allreduce time is the cost model's (``gradsync.collectives.costs``) on the cluster's
``TierFabric``, for the algorithm asked for or, with ``auto``, per bucket the one the
planner picks at run time (``costs.choose``: the cheapest, or a ring within 5% of it).

Compression (``compression.py``): each bucket's exchange is the collectives the library's
compressor issues (int8's alltoall and allgather, PowerSGD's two allreduces, random-k's one,
a cast's allreduce of half the bytes), tiered as gradsync tiers it, plus the compressor's
compute on the bucket's critical path; it overlaps backward like an uncompressed allreduce.
Local SGD and DiLoCo (``localsgd:H``, ``diloco:H``) exchange nothing per step and one
allreduce of the parameters every H steps, not overlapped, amortised over the H steps.

Stragglers (``straggle.py``): with a per-step coefficient of variation c of a rank's compute
(``jitter_cv``, the cluster file's, or the model's when it sets one), the step runs on the
slowest of the N ranks, whose compute is in expectation ``compute x (1 + c e_N)``, e_N the
expected maximum of N standard normals (e_1 = 0: one rank waits for nobody); with GPUs that
differ in speed for the whole job (``persistent_cv`` p), c becomes ``sqrt(c^2 + p^2)``. F and
B above are that stretched compute's; ``straggle`` reports the stretch, ``exposed`` the
communication left after it.

Worked example: compute 100 ms (backward 2/3: F = 33.3, B = 66.7 ms), two 10 MB buckets, an
allreduce of 10 MB taking 40 ms: ready 66.7 and 100 ms; bucket 0 runs 66.7-106.7, bucket 1
106.7-146.7; the step is 146.7 ms, 46.7 ms of communication exposed, efficiency 100/146.7 =
68%.

Efficiency is weak scaling: the same batch per rank, ``step(1 rank) / step(N ranks)``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field, replace

from ..cluster.topology import parse_latency
from . import compression as _compression
from .cluster import Cluster
from .fabric import TierFabric
from .straggle import straggler_factor

__all__ = ["Model", "StepResult", "parse_model", "simulate", "ALGORITHMS", "CANDIDATES"]

CANDIDATES = ("doubling", "halving_doubling", "ring", "hierarchical")
"""The planner's candidates; its ``topo_ring`` is ``ring`` here (ranks are in block order)."""
ALGORITHMS = ("auto",) + CANDIDATES
_MATRIX = re.compile(r"\s*([0-9]+)\s*[xX]\s*([0-9]+)\s*")
_SIZE = re.compile(r"\s*([0-9.eE+-]+)\s*([kKmMgG]?)(i?)([bB]?)\s*")


@dataclass(frozen=True)
class Model:
    """What the simulator needs to know of a model and its training step."""

    params: float
    """Parameters (gradient elements)."""
    compute: float
    """Seconds of forward + backward on one rank."""
    bucket_bytes: float = 25e6
    """Gradient bytes per bucket (the last may be smaller)."""
    bytes_per_param: float = 4.0
    backward_fraction: float = 2 / 3
    """Share of ``compute`` spent in backward (backward is about twice forward)."""
    update: float = 0.0
    """Seconds of the optimizer step after the last allreduce."""
    compression: str = "none"
    """``compression.parse``'s text: none, bf16, int8, powersgd:4, randomk:0.01, diloco:500,
    ... with @slowest (default), @hosts or @all."""
    matrix: tuple = (1024, 1024)
    """PowerSGD: the shape of a typical gradient matrix (rows, the product of the others);
    a bucket is cut into whole matrices of it and a flat rest. Assumed unless given."""
    jitter_cv: "float | None" = None
    """Per-step coefficient of variation of a rank's compute; None: the cluster file's."""
    persistent_cv: "float | None" = None
    """Coefficient of variation of the GPUs' own speeds (fixed per job); None: the file's."""

    @property
    def gradient_bytes(self) -> float:
        return self.params * self.bytes_per_param

    def buckets(self) -> list[float]:
        """Gradient bytes of each bucket, in the order backward fills them."""
        total, size = self.gradient_bytes, self.bucket_bytes
        full = int(total // size)
        rest = total - full * size
        return [size] * full + ([rest] if rest > 0 else [])


def _size(text: str, key: str) -> float:
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"--model {key}={text!r}: not a number such as 60M or 25MB")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2].lower()]
    if m[3]:
        scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m[2].lower()]
    return float(m[1]) * scale


def parse_model(text: str) -> Model:
    """``params=60M,compute_ms=180,buckets=25MB[,backward=0.67,update_ms=5,bytes_per_param=2,
    compression=int8,matrix=512x4608,jitter_cv=0.02,persistent_cv=0.01]`` -> Model."""
    fields = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--model: {item!r} is not KEY=VALUE")
        fields[key.strip()] = value.strip()
    known = {"params", "compute_ms", "buckets", "backward", "update_ms", "bytes_per_param",
             "compression", "matrix", "jitter_cv", "persistent_cv"}
    if set(fields) - known:
        raise ValueError(f"--model: unknown key(s) {sorted(set(fields) - known)}; known: "
                         f"{', '.join(sorted(known))}")
    for key in ("params", "compute_ms"):
        if key not in fields:
            raise ValueError(f"--model: {key}= is required (e.g. params=60M,compute_ms=180)")
    model = Model(params=_size(fields["params"], "params"),
                  compute=parse_latency(fields["compute_ms"] + "ms", "--model compute_ms"))
    if "buckets" in fields:
        model = replace(model, bucket_bytes=_size(fields["buckets"], "buckets"))
    if "backward" in fields:
        model = replace(model, backward_fraction=float(fields["backward"]))
    if "update_ms" in fields:
        model = replace(model, update=float(fields["update_ms"]) / 1e3)
    if "bytes_per_param" in fields:
        model = replace(model, bytes_per_param=float(fields["bytes_per_param"]))
    if "compression" in fields:
        model = replace(model, compression=fields["compression"])
    if "matrix" in fields:
        m = _MATRIX.fullmatch(fields["matrix"])
        if not m or not int(m[1]) or not int(m[2]):
            raise ValueError(f"--model matrix={fields['matrix']!r}: expected ROWSxCOLS such as "
                             f"512x4608")
        model = replace(model, matrix=(int(m[1]), int(m[2])))
    for key in ("jitter_cv", "persistent_cv"):
        if key in fields:
            try:
                model = replace(model, **{key: float(fields[key])})
            except ValueError:
                raise ValueError(f"--model {key}={fields[key]!r}: not a number") from None
    check(model)
    return model


def check(model: Model) -> None:
    if not model.params > 0 or not model.compute > 0 or not model.bucket_bytes > 0:
        raise ValueError(f"--model: params, compute_ms and buckets must be positive ({model})")
    if not 0 < model.backward_fraction <= 1:
        raise ValueError(f"--model: backward must be in (0, 1], got {model.backward_fraction}")
    for key in ("jitter_cv", "persistent_cv"):
        value = getattr(model, key)
        if value is not None and not 0 <= value < 1:
            raise ValueError(f"--model: {key} must be in [0, 1), got {value}")
    try:
        _compression.parse(model.compression)
    except ValueError as exc:
        raise ValueError(f"--model: {exc}") from None


@dataclass
class StepResult:
    gpus: int
    step: float
    compute: float
    exposed: float
    efficiency: float
    algorithms: dict = field(default_factory=dict)
    """How many buckets each algorithm ran."""
    tier_seconds: dict = field(default_factory=dict)
    """Per tier: how much the step's allreduces would shorten if that tier were free."""
    busiest_tier: str = ""
    straggle: float = 0.0
    """Seconds the step waits for the slowest rank's compute beyond the mean rank's (per-step
    jitter and persistently slow GPUs together)."""
    compression: str = "none"
    compress: float = 0.0
    """Seconds of compression compute per step on the buckets' critical paths (amortised over
    H steps for local SGD and DiLoCo)."""
    fp32_bytes: float = 0.0
    """Bytes one rank sends uncompressed per step (inside units under tiered compression)."""
    wire_bytes: float = 0.0
    """Bytes one rank sends compressed per step."""
    sync_every: int = 1

    def as_dict(self) -> dict:
        return {"gpus": self.gpus, "step_ms": self.step * 1e3, "compute_ms": self.compute * 1e3,
                "exposed_ms": self.exposed * 1e3, "straggle_ms": self.straggle * 1e3,
                "efficiency": self.efficiency,
                "algorithms": self.algorithms, "busiest_tier": self.busiest_tier,
                "tier_ms": {k: v * 1e3 for k, v in self.tier_seconds.items()},
                "compression": self.compression, "compress_ms": self.compress * 1e3,
                "fp32_mb": self.fp32_bytes / 1e6, "wire_mb": self.wire_bytes / 1e6,
                "sync_every": self.sync_every}


def _timeline(model: Model, times: list[float]) -> float:
    """The step's length, given each bucket's allreduce seconds."""
    fwd = model.compute * (1 - model.backward_fraction)
    bwd = model.compute * model.backward_fraction
    done, filled, total = 0.0, 0.0, model.gradient_bytes
    for nbytes, took in zip(model.buckets(), times):
        filled += nbytes
        ready = fwd + bwd * filled / total
        done = max(ready, done) + took
    return max(model.compute, done) + model.update


def _exchanges(cluster: Cluster, gpus: int, model: Model, algorithm: str
               ) -> list[_compression.Cost]:
    """Each bucket's exchange under the model's compression (``compression.exchange``)."""
    fabric = TierFabric(cluster, gpus)
    comp = _compression.parse(model.compression)
    algs = CANDIDATES if algorithm == "auto" else (algorithm,)
    seen = {nbytes: _compression.exchange(cluster, fabric, comp, nbytes, model.bytes_per_param,
                                          algs, model.matrix)
            for nbytes in set(model.buckets())}
    return [seen[b] for b in model.buckets()]


def _allreduces(cluster: Cluster, gpus: int, model: Model, algorithm: str
                ) -> tuple[list[float], list[str]]:
    """Each bucket's exchange seconds and algorithm."""
    done = _exchanges(cluster, gpus, model, algorithm)
    return [c.seconds for c in done], [c.algorithm for c in done]


def _sync(cluster: Cluster, gpus: int, model: Model, algorithm: str,
          comp: _compression.Compression) -> _compression.Cost:
    """Local SGD's or DiLoCo's synchronisation: every parameter's outer gradient (float32)
    in one reduction, through the outer compressor if any, then the outer step's passes."""
    outer = comp.outer or _compression.Compression("none")
    algs = CANDIDATES if algorithm == "auto" else (algorithm,)
    cost = _compression.exchange(cluster, TierFabric(cluster, gpus), outer, 4 * model.params,
                                 4, algs, model.matrix)
    if gpus > 1:
        step = _compression.OUTER_PASSES * model.params / cluster.reduce_bandwidth
        cost = replace(cost, seconds=cost.seconds + step, compute=cost.compute + step)
    return cost


def simulate(cluster: Cluster, model: Model, gpus: int, algorithm: str = "auto") -> StepResult:
    """The step of ``model`` on ``gpus`` ranks of ``cluster``."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    comp = _compression.parse(model.compression)
    cv = cluster.jitter_cv if model.jitter_cv is None else model.jitter_cv
    fixed = cluster.persistent_cv if model.persistent_cv is None else model.persistent_cv
    base = model.compute + model.update
    if comp.periodic:
        # H steps without an exchange, then one sync: the ranks wait for each other once per
        # window, so per-step jitter averages over H steps (compression.py).
        every = comp.every
        slowest = model.compute * straggler_factor(gpus, cv / math.sqrt(every), fixed)

        def comm_of(c: Cluster) -> float:
            return _sync(c, gpus, model, algorithm, comp).seconds / every

        sync = _sync(cluster, gpus, model, algorithm, comp)
        comm = sync.seconds / every
        step = slowest + model.update + comm
        done = [sync]
        algorithms = {sync.algorithm: 1} if gpus > 1 else {}
        scale = 1 / every
    else:
        def comm_of(c: Cluster) -> float:
            return sum(x.seconds for x in _exchanges(c, gpus, model, algorithm))

        done = _exchanges(cluster, gpus, model, algorithm)
        slowest = model.compute * straggler_factor(gpus, cv, fixed)
        step = _timeline(replace(model, compute=slowest), [c.seconds for c in done])
        comm = sum(c.seconds for c in done)
        algorithms = dict(Counter(c.algorithm for c in done)) if gpus > 1 else {}
        scale = 1.0
    per_tier = {}
    for i, tier in enumerate(cluster.tiers):
        per_tier[tier.name] = comm - comm_of(cluster.with_free_tier(i))
    busiest = max(per_tier, key=per_tier.get) if comm > 0 else ""
    return StepResult(gpus, step, base, step - slowest - model.update, base / step, algorithms,
                      per_tier, busiest, slowest - model.compute, comp.describe(),
                      scale * sum(c.compute for c in done),
                      scale * sum(c.fp32_bytes for c in done),
                      scale * sum(c.wire_bytes for c in done), comp.every)
