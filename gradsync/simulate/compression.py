"""Compression in the step model: what gradsync's compressors send, compute and when.

The simulator's bytes are the library's (``gradsync/compress/``), counted from its formats,
not a textbook's; ``tests/test_simulate_compression.py`` runs each compressor on a real
tensor through a recording ``Comm`` and checks that the calls and sizes below are exactly
what it issued, so this file cannot drift from the code unnoticed.

Vocabulary. A *compression* is a kind and its settings (``parse``: ``none``, ``fp16``,
``bf16``, ``int8``, ``int4``, ``fp8``, ``powersgd:R``, ``randomk:RATIO``, ``localsgd:H``,
``diloco:H`` or ``diloco:H+int8`` (the outer gradient compressed), each optionally
``@slowest`` (the default), ``@hosts`` or ``@all`` for the tiers it compresses). A
*schedule* is the list of collectives one bucket costs on a flat group of n ranks, each a
*call* ``(collective, bytes)``:

    none            allreduce 4E                     (E elements in the bucket)
    fp16, bf16      allreduce 2E                     (a cast around the plain allreduce)
    int8, fp8       alltoall n (4b + c), allgather 4b + c
                    (``quantized.py``: c = the chunk of ceil(E/n) elements rounded up to b
                    blocks of ``block`` elements, 4 bytes of scale per block)
    int4            the same with b ceil(block / 2) bytes of codes in place of c
    powersgd:R      allreduce 4 (plain + sum rows x r), allreduce 4 sum cols x r
                    (``powersgd.py``: matrices that shrink at least 2x, r = min(R, rows, cols))
    randomk:RATIO   allreduce 4k, k = ceil(RATIO x E)

The *tiers* (``compress/tiers.py``). ``all``: the schedule on every rank, flat. ``slowest``
(gradsync's default for a job on several hosts): a float32 reduce-scatter inside each unit,
the compressor among one *owner* per unit, a float32 allgather inside the unit, nested
through every tier the cluster file names, so only the top tier's traffic is compressed
(what ``tiers.py`` does when the job's topology names the cluster's groups). ``hosts``: the
same with only nodes known (a topology of host names alone): compressed across nodes,
everything above a node. Element-wise compressors give each rank of a unit its block;
PowerSGD, which needs whole matrices, reduces onto the unit's first rank (its *leader*) and
back: the library's *funnel* (``collectives/funnel.py``), a pipelined chain (the ring with
one non-empty block: S + k - 2 steps of a segment of ``CHUNK_BYTES`` each way, for S
segments and k ranks), a binomial tree (ceil(log2 k) rounds of the whole bucket each way) or
a split into k blocks (a reduce-scatter and a gather, a scatter and an allgather), the one
its cost model predicts fastest on the unit, timed by the same formulas
(``funnel.round_trip_time``).

Time of a call on a fabric (the cost model's ``TierFabric``): an allreduce is the cost model's
(``costs.allreduce_time``: the planner's choice for a flat schedule; inside a tiered one
recursive doubling, halving-doubling or the ring, as ``comm.ViewComm`` chooses them, both by
``costs.choose``: the cheapest, or a ring within ``costs.RING_MARGIN`` of it); the alltoall
is the cheaper of ``alltoall.py``'s two, as ``comm`` chooses them (``alltoall_time``): the
pairwise exchange, n-1 steps in which rank i sends a block to i + d (the messages that
leave each unit in step d share its uplink), or Bruck's ceil(log2 n) steps at d = 1, 2, 4, ..
of about n/2 blocks each (the bytes a rank sends, ``sent_bytes``, follow the choice); the
allgather is the cheaper of ``allgather.py``'s two, as ``comm`` chooses them
(``allgather_time``): ``ring.allgather``, n-1 ring steps of one block, or Bruck's
ceil(log2 n) steps at d = 1, 2, 4, .. of min(d, n - d) blocks each (both send n-1 blocks).

Compute. Compressing costs ``seconds per element`` (``rate``) on the elements a rank
compresses, on the bucket's critical path (compress, send, decompress, one after another, as
the library runs them). A cluster file may set ``compress_seconds_per_element`` per kind,
measured by ``python3 -m gradsync.simulate.calibrate`` on its machines; otherwise the rate is
``PASSES[kind]`` bytes of memory traffic per element at the cluster's ``reduce_bandwidth``
(the streaming rate at which one rank sums arrays): the passes the library's code makes over
the data, counted below, as if they ran at the device's streaming rate. That is an
assumption for GPUs (gradsync's compressors run on CPU tensors; a fused GPU kernel makes
fewer passes), printed with every projection that uses it.

Local SGD and DiLoCo (``compress/diloco.py``): H inner steps with no gradient exchange, then
one allreduce of every parameter's outer gradient (float32, or through the compressor after
``+``), not overlapped with compute (``delay=0``), and the outer step's passes over the
parameters. Per step: the inner step plus (sync + outer step) / H. The ranks wait for each
other once per window, not every step, so per-step jitter averages over H steps: the
slowest rank's window is ``H mu (1 + sqrt(p^2 + c^2 / H) e_N)`` (``straggle.py``'s terms;
the persistent spread p does not average out).

Worked example, int8 over 4 ranks, E = 10,000 elements, block 1024: ceil(10,000/4) = 2,500
per rank, blocks of 1,024, 3 per chunk, c = 3,072; the alltoall sends 4 x (12 + 3,072) =
12,336 bytes of which a rank keeps a quarter (by the pairwise exchange), the allgather
3,084 bytes: 2 x 3/4 x 12,336 = 18,504 bytes sent per rank against 60,000 for a float32
ring (3.2x fewer; 3.97x for large buckets, where the padding is negligible).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

import numpy as np

from ..collectives import costs, funnel
from ..collectives.alltoall import moving_blocks

__all__ = ["Compression", "parse", "schedule", "sent_bytes", "powersgd_plan", "int8_layout",
           "randomk_count", "alltoall_time", "allgather_time", "funnel_time", "PASSES",
           "OUTER_PASSES", "KINDS", "TIERS"]

KINDS = ("none", "fp16", "bf16", "int8", "int4", "fp8", "powersgd", "randomk", "localsgd",
         "diloco")
TIERS = ("slowest", "hosts", "all")
SUB_ALLREDUCES = ("doubling", "halving_doubling", "ring")
"""``compress.comm.SUB_ALLREDUCES``: a tiered sub-allreduce runs the cheapest of these."""
CHUNK_BYTES = 1 << 20
"""``Config.chunk_bytes``'s default: the funnel's chain cuts segments of it."""

# Bytes of memory traffic per element of a bucket that a rank compresses, counted from the
# library's passes (each read and write of a float32 is 4 bytes, of a float64 8, of an int8 1):
PASSES = {
    "none": 0,
    # _CastCompressor: tensor.to(bf16) reads 4, writes 2; back: reads 2, writes 4.
    "fp16": 12, "bf16": 12,
    # quantized._reduce per element: residual add 12, abs+amax 12, divide 8, round/clamp/
    # cast 21, dequantize for the residual 13, residual update 28, wire copy 2, the owner's
    # float64 sum of every rank's version 49, the final dequantize and copy 21: about 166.
    "int8": 166, "fp8": 166,
    # int4: int8's passes with half the wire bytes, plus packing (the codes read and the
    # nibbles shifted, or'd and written: 3) and unpacking them twice (the residual's and the
    # result's dequantize: 2 x 3): about 175.
    "int4": 175,
    # powersgd._reduce on compressed elements: residual add 12, M Q and M^T P (each reads M:
    # 8), the new residual M - P Q^T (16) and its copy (8), the result P Q^T written back (12).
    "powersgd": 56,
    # randomk._reduce: randperm's permutation written and read (16), residual add 12,
    # residual copy 8, zero and scatter back 4 + (k), gather (k).
    "randomk": 40,
}
OUTER_PASSES = 60
"""DiLoCo's outer step per parameter (``diloco._land``): delta = anchor - theta (12), the
Nesterov momentum (12) and anchor update (20), theta = anchor (8), the flat copy (8)."""

_SPEC = re.compile(r"^(?P<kind>[a-z0-9]+)(?::(?P<arg>[0-9.eE+-]+))?(?:\+(?P<outer>[a-z0-9:.]+))?"
                   r"(?:@(?P<tiers>[a-z]+))?$")


@dataclass(frozen=True)
class Compression:
    """A compression as the simulator models it (``parse`` makes one from text)."""

    kind: str = "none"
    rank: int = 0
    """PowerSGD's rank r."""
    ratio: float = 1.0
    """Random-k's share of elements sent."""
    every: int = 1
    """Local SGD and DiLoCo: H, inner steps per synchronisation."""
    outer: "Compression | None" = None
    """DiLoCo: the compressor of the outer gradient (None: float32)."""
    tiers: str = "slowest"
    block: int = 1024
    """int8/int4/fp8 elements per scale (``Int8(block=1024)``)."""

    @property
    def periodic(self) -> bool:
        return self.kind in ("localsgd", "diloco")

    @property
    def owns_reduction(self) -> bool:
        """Replaces the allreduce (tiered by default); a cast or none does not."""
        return self.kind in ("int8", "int4", "fp8", "powersgd", "randomk")

    @property
    def shardable(self) -> bool:
        return self.kind != "powersgd"

    def describe(self) -> str:
        arg = {"powersgd": self.rank, "randomk": self.ratio}.get(self.kind)
        if self.periodic:
            arg = self.every
        text = self.kind + (f":{arg:g}" if arg is not None else "")
        if self.outer is not None:
            text += "+" + self.outer.describe()
        if self.owns_reduction and self.tiers != "slowest":
            text += "@" + self.tiers
        return text


def parse(text: str) -> Compression:
    """``int8``, ``powersgd:4@all``, ``randomk:0.01``, ``diloco:500+int8`` -> Compression."""
    m = _SPEC.match(text.strip().lower())
    if not m or m["kind"] not in KINDS:
        raise ValueError(f"compression {text!r}: choose from none, fp16, bf16, int8, int4, fp8, "
                         f"powersgd:R, randomk:RATIO, localsgd:H, diloco:H[+int8|...], each "
                         f"with @slowest (default), @hosts or @all")
    kind, arg, tiers = m["kind"], m["arg"], m["tiers"] or "slowest"
    if tiers not in TIERS:
        raise ValueError(f"compression {text!r}: tiers {tiers!r}; choose from {', '.join(TIERS)}")
    needs = {"powersgd": "rank", "randomk": "ratio", "localsgd": "H", "diloco": "H"}
    if (arg is None) == (kind in needs) and kind != "powersgd":
        raise ValueError(f"compression {text!r}: {kind} " + (f"takes {kind}:{needs[kind]}"
                         if kind in needs else "takes no :argument"))
    c = Compression(kind, tiers=tiers)
    try:
        if kind == "powersgd":
            c = replace(c, rank=int(arg) if arg is not None else 4)
            bad = c.rank < 1
        elif kind == "randomk":
            c = replace(c, ratio=float(arg))
            bad = not 0 < c.ratio <= 1
        elif kind in ("localsgd", "diloco"):
            c = replace(c, every=int(arg))
            bad = c.every < 1
        else:
            bad = False
    except ValueError:
        bad = True
    if bad:
        raise ValueError(f"compression {text!r}: bad {needs.get(kind, 'argument')} {arg!r}")
    if m["outer"]:
        if kind != "diloco":
            raise ValueError(f"compression {text!r}: only diloco:H takes +compressor")
        c = replace(c, outer=parse(m["outer"] + ("@" + tiers if m["tiers"] else "")))
        if c.outer.periodic:
            raise ValueError(f"compression {text!r}: the outer compressor cannot be periodic")
    return c


# --- the library's formats, in numbers --------------------------------------------------------

def int8_layout(numel: int, n: int, block: int = 1024) -> tuple[int, int]:
    """``_Quantized.layout``: (elements per block, blocks per chunk)."""
    per_rank = -(-numel // n)
    b = max(1, min(block, per_rank))
    return b, -(-per_rank // b)


def randomk_count(numel: int, ratio: float) -> int:
    """``RandomK.count``."""
    return min(numel, max(1, math.ceil(ratio * numel))) if numel else 0


def powersgd_plan(shapes, rank: int, min_rate: float = 2.0) -> list:
    """``PowerSGD.plan``: per tensor (rows, cols, r) when compressed, else None."""
    out = []
    for shape in shapes:
        if len(shape) < 2:
            out.append(None)
            continue
        rows, cols = int(shape[0]), int(np.prod(shape[1:]))
        r = min(rank, rows, cols)
        out.append((rows, cols, r) if r and rows * cols >= min_rate * (rows + cols) * r
                   else None)
    return out


def shapes_of(elements: float, matrix: tuple[int, int]) -> list[tuple]:
    """A bucket of ``elements`` as gradients of ``matrix``'s shape, the rest as one matrix of
    as many whole rows and a flat tail shorter than a row: how the simulator gives PowerSGD
    shapes it does not otherwise know. Biases and norms (a fraction of a percent of a CNN's
    or a transformer's parameters) are not modelled apart."""
    rows, cols = matrix
    e = int(round(elements))
    whole, rest = divmod(e, rows * cols)
    out = [(rows, cols)] * whole
    if rest >= cols:
        out.append((rest // cols, cols))
    if rest % cols:
        out.append((rest % cols,))
    return out


def schedule(c: Compression, elements: float, n: int, shapes=None) -> list[tuple[str, float]]:
    """The collectives one bucket of ``elements`` costs each rank of a flat group of ``n``:
    ``(collective, bytes)`` with the alltoall's whole send buffer and the allgather's one
    block (the module docstring's table)."""
    e = int(round(elements))
    if c.kind in ("none", "localsgd", "diloco"):
        return [("allreduce", 4 * e)]
    if c.kind in ("fp16", "bf16"):
        return [("allreduce", 2 * e)]
    if c.kind in ("int8", "int4", "fp8"):
        if e == 0:
            return []
        block, blocks = int8_layout(e, n, c.block)
        wire = 4 * blocks + (block if c.kind != "int4" else (block + 1) // 2) * blocks
        return [("alltoall", n * wire), ("allgather", wire)]
    if c.kind == "randomk":
        return [("allreduce", 4 * randomk_count(e, c.ratio))] if e else []
    plan = powersgd_plan(shapes if shapes is not None else [(e,)], c.rank)
    shapes = shapes if shapes is not None else [(e,)]
    plain = sum(int(np.prod(s)) for s, p in zip(shapes, plan) if p is None)
    ps = sum(rows * r for rows, _, r in filter(None, plan))
    qs = sum(cols * r for _, cols, r in filter(None, plan))
    return [("allreduce", 4 * (plain + ps))] + ([("allreduce", 4 * qs)] if qs else [])


def sent_bytes(call: tuple[str, float], n: int, alltoall: str = "pairwise") -> float:
    """Bytes one rank sends for ``call`` among ``n`` ranks, as gradsync runs it: a ring
    allreduce 2(n-1)/n of the data, the alltoall by ``alltoall`` all but its own block
    (pairwise) or the blocks of each of Bruck's steps (about (log2 n)/2 of the data), the
    allgather n-1 blocks (by the ring or Bruck's, which each give a rank each block once),
    each pass of the float32 reduce-scatter or gather (n-1)/n, and each way of the funnel
    (n-1)/n on average (the whole bucket n-1 times over, by the chain or the tree; the split
    sends more, ``funnel.mean_sent``)."""
    kind, nbytes = call
    if n < 2:
        return 0.0
    if kind == "alltoall" and alltoall == "bruck":
        steps = range((n - 1).bit_length())
        return sum(moving_blocks(n, 1 << k) for k in steps) / n * nbytes
    share = {"allreduce": 2 * (n - 1) / n, "alltoall": (n - 1) / n, "allgather": n - 1,
             "reduce_scatter": (n - 1) / n, "gather_blocks": (n - 1) / n,
             "reduce_to_leader": (n - 1) / n, "broadcast_from_leader": (n - 1) / n}[kind]
    return share * nbytes


# --- time on a fabric ------------------------------------------------------------------------

def alltoall_time(f, nbytes: float) -> float:
    """The alltoall of ``nbytes`` per rank (n uniform blocks) on ``f``, by the cheaper of
    ``alltoall.py``'s pairwise exchange and Bruck's algorithm, as ``comm.ViewComm`` and
    ``comm.WorldComm`` choose (``costs.cheapest_alltoall``)."""
    return min(costs.alltoall_time(a, f, nbytes) for a in costs.ALLTOALLS)


def allgather_time(f, nbytes: float) -> float:
    """The allgather of one block of ``nbytes`` from each of ``f``'s n ranks, by the cheaper of
    ``allgather.py``'s ring and Bruck's algorithm, as ``comm.ViewComm`` and ``comm.WorldComm``
    choose (``costs.cheapest_allgather``, which takes all n blocks' bytes)."""
    return min(costs.allgather_time(a, f, f.n * nbytes) for a in costs.ALLGATHERS)


def call_time(f, call: tuple[str, float], algorithms: "tuple[str, ...] | None") -> float:
    """Seconds of one call on fabric ``f``. An allreduce runs the one of ``algorithms`` that
    the planner's rule picks (``costs.choose``: the cheapest, or a ring within its margin)
    or, with None, of ``SUB_ALLREDUCES``, as ``comm.ViewComm`` chooses for a tiered
    sub-group."""
    kind, nbytes = call
    if f.n < 2 or nbytes <= 0:
        return 0.0
    if kind == "alltoall":
        return alltoall_time(f, nbytes)
    if kind == "allgather":
        return allgather_time(f, nbytes)
    if algorithms is None:
        algorithms = SUB_ALLREDUCES
    times = {a: costs.allreduce_time(a, f, nbytes) for a in algorithms}
    return times[costs.choose(f, times)]


def funnel_time(f, nbytes: float) -> float:
    """Seconds of the funnel of ``nbytes`` onto the leader of ``f``'s ranks and back, by the
    schedule ``comm.ViewComm`` runs (``funnel.schedule``, at ``CHUNK_BYTES``)."""
    how = funnel.schedule(f, nbytes, CHUNK_BYTES)
    return funnel.round_trip_time(how, f, nbytes, CHUNK_BYTES)


@dataclass
class Cost:
    """One bucket's exchange: seconds on its critical path, and what it moved and computed."""

    seconds: float = 0.0
    compute: float = 0.0
    """Seconds of compression compute on the critical path (inside ``seconds``)."""
    fp32_bytes: float = 0.0
    """Bytes a rank sends uncompressed (every byte when nothing is compressed)."""
    wire_bytes: float = 0.0
    """Bytes a rank sends compressed."""
    algorithm: str = ""
    """The flat allreduce's algorithm, or ``hierarchical`` for a tiered reduction."""


def rate(cluster, kind: str) -> float:
    """Seconds of compression compute per element: the cluster file's measured rate, else
    ``PASSES[kind]`` bytes at its ``reduce_bandwidth`` (an assumption: module docstring)."""
    measured = cluster.compress_seconds_per_element
    if kind in measured:
        return measured[kind]
    return PASSES[kind] / cluster.reduce_bandwidth


def exchange(cluster, fabric, c: Compression, nbytes: float, bytes_per_param: float,
             algorithms: tuple[str, ...], matrix: tuple[int, int]) -> Cost:
    """One bucket of ``nbytes`` of gradients under ``c`` on ``fabric``; ``algorithms``: the
    candidates of the flat allreduce (the planner's rule picks one: ``costs.choose``)."""
    elements = nbytes / bytes_per_param
    if fabric.n < 2:
        return Cost()
    if c.kind in ("none", "localsgd", "diloco", "fp16", "bf16"):
        wire = nbytes if c.kind not in ("fp16", "bf16") else elements * min(2, bytes_per_param)
        timed = {a: costs.allreduce_time(a, fabric, wire) for a in algorithms}
        best = costs.choose(fabric, timed)
        sent = sent_bytes(("allreduce", wire), fabric.n)
        if c.kind in ("fp16", "bf16"):
            work = rate(cluster, c.kind) * elements
            return Cost(timed[best] + work, work, 0.0, sent, best)
        return Cost(timed[best], 0.0, sent, 0.0, best)

    def flat(f, e: float, share: float, lead: bool, algs) -> Cost:
        """The compressor's own schedule among the ``f.n`` ranks (or owners) of ``f``, each
        carrying ``e`` elements; ``share``: a real rank's part of an owner's bytes."""
        def calls_of(elements):
            return schedule(c, elements, f.n,
                            shapes_of(elements, matrix) if c.kind == "powersgd" else None)

        calls = calls_of(e)
        took = sum(call_time(f, call, algs) for call in calls)
        # The alltoall's and the allgather's algorithms, as timed (``alltoall_time``,
        # ``allgather_time``): the alltoall's bytes follow its choice.
        hows = [costs.cheapest_alltoall(f, b) if kind == "alltoall" else
                costs.cheapest_allgather(f, f.n * b) if kind == "allgather" else ""
                for kind, b in calls]
        work = rate(cluster, c.kind) * (e if lead else e * share)
        if lead:  # one rank (the leader) sends for its unit: the unit's average
            sent = share * sum(sent_bytes(call, f.n, how) for call, how in zip(calls, hows))
        else:  # each rank sends its own block's schedule (its own k, its own padding)
            sent = sum(sent_bytes(call, f.n, how)
                       for call, how in zip(calls_of(e * share), hows))
        if algs is None:
            label = "hierarchical"
        elif calls and calls[0][0] == "allreduce":
            label = costs.cheapest(f, calls[0][1], algs)
        else:
            label = f"alltoall ({hows[0]})+allgather ({hows[1]})"
        return Cost(took + work, work, 0.0, sent, label)

    def tiered(f, e: float, share: float, lead: bool, depth: int) -> Cost:
        cut = f.split() if (c.tiers == "slowest" or depth == 0) else None
        if cut is None or f.n < 2:
            return flat(f, e, share, lead, None)
        parts, owners = cut
        k = parts[0].n  # a full unit's ranks (a partial last unit has fewer)
        fp32 = share * 2 * (k - 1) / k * 4 * e  # float32 reduce-scatter and gather
        if c.shardable:
            # As costs.hierarchical: each rank of a unit of k handles ceil(m/k) of the m
            # blocks across the units, the unit's ranks at the same time.
            m = max(u.n for u in parts)
            inside = max(costs.ring(u, 4 * e) for u in parts)
            subs = {size: tiered(owners, e * size / m, share / size, False, depth + 1)
                    for size in {u.n for u in parts}}
            cross = max(math.ceil(m / size) * s.seconds for size, s in subs.items())
            full, reps = subs[k], math.ceil(m / k)
            return Cost(inside + cross, reps * full.compute, fp32 + reps * full.fp32_bytes,
                        reps * full.wire_bytes, "hierarchical")
        # PowerSGD: onto the unit's leader and back by the funnel the library chooses.
        inside = max(funnel_time(u, 4 * e) for u in parts)
        how = funnel.schedule(parts[0], 4 * e, CHUNK_BYTES)
        fp32 = share * funnel.mean_sent(how, k, 4 * e)
        sub = tiered(owners, e, share / k, True, depth + 1)
        return Cost(inside + sub.seconds, sub.compute, fp32 + sub.fp32_bytes, sub.wire_bytes,
                    "hierarchical")

    if c.tiers == "all" or fabric.split() is None:
        # tiers="all", or nothing to split (one host, one rank per host): the flat schedule
        # on the job's World, whose allreduces the planner chooses.
        return flat(fabric, elements, 1.0, False, algorithms)
    return tiered(fabric, elements, 1.0, not c.shardable, 0)
