"""gradsync simulate with compression: the model's bytes are the compressors' own.

Pure computation, one process: each library compressor runs on a real tensor through a
``Comm`` that records its collectives (and returns plausible data), and the simulator's
schedule must name the same collectives with the same sizes; the tiered schedule is checked
the same way on one rank of a two-tier placement. Then local SGD's amortisation, the
compression compute, the published check (pytorch#74148) within its stated tolerance, and
the command line.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from gradsync.cluster.topology import Topology
from gradsync.collectives import funnel
from gradsync.collectives.costs import allreduce_time, cheapest_alltoall
from gradsync.compress import FP8, Int4, Int8, PowerSGD, RandomK
from gradsync.run.cli import main as gradsync_main
from gradsync.simulate import cluster as cluster_file
from gradsync.simulate.compression import (CHUNK_BYTES, call_time, exchange, int8_layout,
                                           parse, powersgd_plan, randomk_count, rate, schedule,
                                           sent_bytes, shapes_of)
from gradsync.simulate.fabric import TierFabric
from gradsync.simulate.step import CANDIDATES, Model, parse_model, simulate
from gradsync.simulate.straggle import expected_max
from gradsync.simulate.validate import COMPRESSED, POWERSGD_SHARE_OBSERVED, powersgd_share, predict
from gradsync.torch.compression import BF16Compressor, FP16Compressor


class Recording:
    """A ``Comm`` of ``size`` ranks seen from rank ``rank``: records each collective as
    ``(collective, bytes)`` in ``log`` and answers as if every rank had sent the same."""

    def __init__(self, size: int, rank: int = 0, log=None, topology=None):
        self.size, self.rank = size, rank
        self.log = [] if log is None else log
        self.topology = topology

    def allreduce_sum_(self, t):
        self.log.append(("allreduce", t.numel() * t.element_size(), self.size))

    def alltoall(self, send):
        self.log.append(("alltoall", send.numel() * send.element_size(), self.size))
        return send.clone()

    def allgather(self, mine):
        self.log.append(("allgather", mine.numel() * mine.element_size(), self.size))
        return mine.repeat(self.size)

    # The tiered interface (compress/comm.py): a placement, sub-groups, float32 phases.
    def begin_tiered(self, description):
        pass

    def placement(self):
        return self.topology

    def sub(self, ranks):
        return Recording(len(ranks), ranks.index(self.rank), self.log)

    def reduce_scatter_sum_(self, t, counts):
        self.log.append(("reduce_scatter", t.numel() * t.element_size(), self.size))

    def gather_blocks_(self, t, counts):
        self.log.append(("gather_blocks", t.numel() * t.element_size(), self.size))

    def reduce_to_leader_(self, t):
        self.log.append(("reduce_to_leader", t.numel() * t.element_size(), self.size))

    def broadcast_from_leader_(self, t):
        self.log.append(("broadcast_from_leader", t.numel() * t.element_size(), self.size))


FUNNEL = ("reduce_to_leader", "broadcast_from_leader")
FP32 = ("reduce_scatter", "gather_blocks") + FUNNEL
"""The tiered reduction's float32 phases inside a unit."""


def _library(kind: str):
    return {"int8": Int8(tiers="all"), "int4": Int4(tiers="all"), "fp8": FP8(tiers="all"),
            "powersgd": PowerSGD(rank=2, tiers="all"),
            "randomk": RandomK(ratio=0.05, tiers="all")}[kind]


SHAPES = [[(3000,)], [(64, 96), (96,), (200, 30), (5, 5), (17,)], [(1,)], [(40, 50, 3)]]


@pytest.mark.parametrize("n", [2, 3, 8])  # (one rank exchanges nothing in the model)
@pytest.mark.parametrize("shapes", SHAPES, ids=["flat", "layers", "one", "conv"])
@pytest.mark.parametrize("kind,text", [("int8", "int8@all"), ("int4", "int4@all"),
                                       ("fp8", "fp8@all"), ("powersgd", "powersgd:2@all"),
                                       ("randomk", "randomk:0.05@all")])
def test_the_flat_schedule_is_what_each_compressor_sends(kind, text, shapes, n):
    numel = sum(math.prod(s) for s in shapes)
    comm = Recording(n)
    _library(kind).reduce(torch.randn(numel), shapes, comm, "bucket", average=True)
    got = [(what, nbytes) for what, nbytes, _ in comm.log]
    assert got == schedule(parse(text), numel, n, shapes)


def test_the_casts_send_two_bytes_an_element():
    t = torch.randn(1000)
    for codec, text in ((BF16Compressor, "bf16"), (FP16Compressor, "fp16")):
        wire, _ = codec.compress(t)
        assert schedule(parse(text), 1000, 4) == [("allreduce", wire.numel() * wire.element_size())]


def test_the_formats_are_the_librarys():
    # The numbers the schedule is built from, against the compressors' own methods.
    for numel, n in ((10_000, 4), (5, 8), (1 << 20, 6), (1025, 1)):
        assert int8_layout(numel, n) == Int8().layout(numel, n)
        assert int8_layout(numel, n, 64) == Int8(block=64).layout(numel, n)
        assert randomk_count(numel, 0.013) == RandomK(ratio=0.013).count(numel)
    shapes = [(512, 4608), (2048, 512), (64,), (3, 3), (1000, 2)] + shapes_of(6.25e6, (512, 4608))
    for r in (1, 4, 32):
        assert powersgd_plan(shapes, r) == PowerSGD(rank=r).plan(shapes)
    # The worked example of compression.py: int8, 4 ranks, 10,000 elements.
    calls = schedule(parse("int8"), 10_000, 4)
    assert calls == [("alltoall", 12_336), ("allgather", 3_084)]
    assert sum(sent_bytes(c, 4) for c in calls) == 18_504


def _two_tier(hosts: int, per_host: int):
    spec = {"name": "test", "ranks_per_node": per_host, "reduce_bandwidth": "10GB/s",
            "tiers": [{"bandwidth": "10GB/s", "latency": "1us"},
                      {"fanout": 0, "bandwidth": "1Gbit/s", "latency": "50us"}]}
    return cluster_file.parse(spec)


@pytest.mark.parametrize("hosts,per_host", [(2, 2), (3, 4), (4, 1)])
@pytest.mark.parametrize("kind,text", [("int8", "int8"), ("powersgd", "powersgd:2"),
                                       ("randomk", "randomk:0.05")])
def test_the_tiered_bytes_are_what_rank_0_sends(kind, text, hosts, per_host):
    # compress/tiers.py on rank 0 of hosts x per_host ranks: float32 inside its host, the
    # compressor among one owner per host; the model's bytes per rank must match (for
    # PowerSGD, which rank 0 runs for its whole host, the host's average times per_host).
    numel = per_host * hosts * 3 * 1024
    matrix = (per_host * hosts * 3, 1024)
    shapes = shapes_of(numel, matrix)
    names = [f"h{i // per_host}" for i in range(hosts * per_host)]
    comm = Recording(hosts * per_host, 0, topology=Topology.from_hosts(names))
    lib = {"int8": Int8(), "powersgd": PowerSGD(rank=2), "randomk": RandomK(ratio=0.05)}[kind]
    lib.reduce(torch.randn(numel), shapes, comm, "bucket", average=True)
    cluster = _two_tier(hosts, per_host)
    # The funnel's bytes depend on its schedule, the one the model picks on a host (here the
    # chain on 2 ranks, the split on 4); tests/test_compress_funnel.py counts them.
    unit = TierFabric(cluster, per_host)
    fp32 = sum(funnel.mean_sent(funnel.schedule(unit, b, CHUNK_BYTES), size, b) / 2
               if w in FUNNEL else sent_bytes((w, b), size)
               for w, b, size in comm.log if w in FP32)
    # The alltoall by the algorithm the model chooses among the owners (Bruck's on 4 hosts
    # 50 us apart, for blocks of 3 KB).
    owners = TierFabric(cluster, hosts * per_host, per_host)
    wire = sum(sent_bytes((w, b), size, cheapest_alltoall(owners, b) if w == "alltoall"
                          else "pairwise") for w, b, size in comm.log if w not in FP32)
    cost = exchange(cluster, TierFabric(cluster, hosts * per_host), parse(text), 4 * numel, 4,
                    CANDIDATES, matrix)
    leader = per_host if kind == "powersgd" else 1
    assert (cost.fp32_bytes, cost.wire_bytes * leader) == pytest.approx((fp32, wire))
    if per_host == 1:  # nothing to split: the flat schedule, as tiers.py falls back to
        assert fp32 == 0 and cost.algorithm != "hierarchical"
    else:
        assert all(size == hosts for w, _, size in comm.log if w not in FP32)
        # PowerSGD's whole matrices go onto the host's leader and back by the funnel, the
        # element-wise compressors' blocks by a reduce-scatter and a block gather.
        phases = {w for w, _, _ in comm.log if w in FP32}
        assert phases == set(FUNNEL if kind == "powersgd" else FP32[:2])


@pytest.mark.parametrize("nbytes,how", [(4 << 10, "tree"), (256 << 10, "split"),
                                         (25e6, "chain")])
def test_tiered_powersgd_is_timed_by_the_librarys_funnel(nbytes, how):
    """Two hosts of 6 ranks: the host's sum onto its leader and back costs the round trip of
    the schedule ``comm.ViewComm`` runs (``funnel.schedule``: 4 KiB by the tree, 3 rounds
    each way against 5 chain steps; 256 KiB split into 6 blocks; 25 MB by the chain, whose
    24 segments keep it full), then PowerSGD among the 2 leaders. (The model of a chain of
    k - 1 hops of the whole bucket each way, which the library never ran, took 2 x 5
    whole-bucket steps.)"""
    cluster = _two_tier(2, 6)
    fabric = TierFabric(cluster, 12)
    parts, owners = fabric.split()
    assert funnel.schedule(parts[0], nbytes, CHUNK_BYTES) == how
    funnelled = min(funnel.round_trip_time(h, parts[0], nbytes, CHUNK_BYTES)
                    for h in funnel.SCHEDULES)
    e, matrix = nbytes / 4, (64, 1024)
    leaders = sum(call_time(owners, call, None)
                  for call in schedule(parse("powersgd:2"), e, 2, shapes_of(e, matrix)))
    got = exchange(cluster, fabric, parse("powersgd:2"), nbytes, 4, CANDIDATES, matrix)
    assert got.seconds == pytest.approx(funnelled + leaders + rate(cluster, "powersgd") * e)


def test_compression_compute_is_the_rate_times_the_elements_a_rank_compresses():
    cluster = _two_tier(4, 1)
    fabric = TierFabric(cluster, 4)
    default = exchange(cluster, fabric, parse("int8"), 4e6, 4, CANDIDATES, (1000, 1000))
    # No measured rate: 166 bytes of passes per element at reduce_bandwidth (10 GB/s).
    assert default.compute == pytest.approx(1e6 * 166 / 10e9)
    measured = cluster_file.parse({"name": "m", "ranks_per_node": 1, "reduce_bandwidth": "10GB/s",
                                   "compress_seconds_per_element": {"int8": 2e-9},
                                   "tiers": [{"bandwidth": "10GB/s", "latency": "1us"},
                                             {"fanout": 0, "bandwidth": "1Gbit/s",
                                              "latency": "50us"}]})
    got = exchange(measured, TierFabric(measured, 4), parse("int8"), 4e6, 4, CANDIDATES,
                   (1000, 1000))
    assert got.compute == pytest.approx(2e-3)
    assert got.seconds - got.compute == pytest.approx(default.seconds - default.compute)
    # Tiered over 2 ranks a host: each rank compresses its half.
    two = _two_tier(2, 2)
    half = exchange(two, TierFabric(two, 4), parse("int8"), 4e6, 4, CANDIDATES, (1000, 1000))
    assert half.compute == pytest.approx(0.5e6 * 166 / 10e9)


@pytest.mark.parametrize("every", [1, 10, 500])
def test_local_sgd_pays_one_sync_every_h_steps(every):
    c = cluster_file.load("summit")
    model = parse_model("params=60M,compute_ms=180,buckets=25MB")
    for gpus in (96, 27360):
        plain = simulate(c, model, gpus)
        r = simulate(c, parse_model(f"params=60M,compute_ms=180,compression=localsgd:{every}"),
                     gpus)
        # The window's slowest rank: per-step jitter averages over H steps, the GPUs' own
        # spread does not (summit.json: 0.003 and 0.0148).
        wait = 0.18 * math.hypot(0.0148, 0.003 / math.sqrt(every)) * expected_max(gpus)
        assert r.straggle == pytest.approx(wait)
        # One float32 allreduce of the 240 MB of parameters (the planner's cheapest) and the
        # outer step's 60 bytes a parameter at summit.json's 400 GB/s, once in H steps.
        sync = min(allreduce_time(a, TierFabric(c, gpus), 240e6) for a in CANDIDATES) \
            + 60 * 60e6 / 400e9
        assert r.step == pytest.approx(0.18 + wait + sync / every)
        assert r.fp32_bytes * every == pytest.approx(2 * (gpus - 1) / gpus * 240e6)
        assert r.wire_bytes == 0 and r.sync_every == every
        if every >= 100:
            assert r.efficiency > plain.efficiency
    # H = 1 is synchronous parameter averaging: the same bytes as the step's allreduces.
    one = simulate(c, parse_model("params=60M,compute_ms=180,compression=localsgd:1"), 1536)
    assert one.fp32_bytes == pytest.approx(simulate(c, model, 1536).fp32_bytes)
    # DiLoCo with an int8 outer gradient: int8's bytes of the parameters, every H steps.
    d = simulate(c, parse_model("params=60M,compute_ms=180,compression=diloco:100+int8"), 1536)
    i8 = exchange(c, TierFabric(c, 1536), parse("int8"), 240e6, 4, CANDIDATES, (1024, 1024))
    assert (d.fp32_bytes, d.wire_bytes) == pytest.approx((i8.fp32_bytes / 100,
                                                          i8.wire_bytes / 100))


def test_compression_cuts_the_bytes_it_says_and_costs_its_compute():
    c = cluster_file.load("summit")
    rows = {}
    for text in ("none", "bf16", "int8", "int8@hosts", "int8@all", "powersgd:4", "randomk:0.01"):
        rows[text] = simulate(c, parse_model(f"params=60M,compute_ms=180,compression={text}"),
                              27360)
    none = rows["none"]
    assert none.compress == 0 and none.wire_bytes == 0
    assert rows["bf16"].wire_bytes == pytest.approx(none.fp32_bytes / 2)
    # int8@all: 1 byte an element and a 4-byte scale per block (of 1,024 on 96 GPUs, chunks
    # padded to whole blocks), against 4 bytes, where its alltoall goes by the pairwise
    # exchange. At 27,360 ranks it goes by Bruck's algorithm (blocks of 229 elements, a chunk
    # of 6.25M / 27,360), whose steps carry each block about (log2 n)/2 times: more bytes
    # than float32's hierarchical allreduce, in less time than the pairwise exchange.
    few = {t: simulate(c, parse_model(f"params=60M,compute_ms=180,compression={t}"), 96)
           for t in ("none", "int8@all")}
    assert 3.9 < few["none"].fp32_bytes / few["int8@all"].wire_bytes < 4 / (1 + 4 / 1024)
    assert rows["int8@all"].wire_bytes > none.fp32_bytes
    # gradsync's default compresses only the top tier (Summit's spine): the float32 phases
    # inside nodes and cabinets stay, so it sends more float32 than @hosts.
    assert rows["int8"].fp32_bytes > rows["int8@hosts"].fp32_bytes > 0
    assert all(r.compress > 0 for t, r in rows.items() if t != "none")


# pytorch#74148 (docs/simulate.md, "A compressed run"): the model's efficiency as recorded
# (it fails if the model moves either way), within 12 points of the at 4 and 6 GPUs;
# at 8 GPUs it is 30 points optimistic, and the cost of PowerSGD's two allreduces is 0.7%
# predicted against 15.2% observed: what the docs say the model misses, held as recorded.
RECORDED = {4: 0.9933, 6: 0.9877, 8: 0.9868}
TOLERANCE = {4: 0.12, 6: 0.12, 8: 0.31}


def test_the_published_compressed_check():
    for p in COMPRESSED:
        got = predict(p)
        assert round(got, 4) == RECORDED[p.gpus]
        assert abs(got - p.observed) <= TOLERANCE[p.gpus], (p.gpus, got)
    assert round(powersgd_share(), 4) == 1.0074
    assert POWERSGD_SHARE_OBSERVED == pytest.approx(1.152, abs=1e-3)


def test_bad_compressions_are_named():
    for text, message in [("zip", "choose from"), ("powersgd:0", "bad rank"),
                          ("randomk:2", "bad ratio"), ("localsgd", "takes localsgd:H"),
                          ("int8:3", "takes no"), ("int8@racks", "tiers 'racks'"),
                          ("int8+bf16", "only diloco"), ("diloco:5+localsgd:2", "periodic")]:
        with pytest.raises(ValueError, match=message):
            parse(text)
    assert parse("diloco:500+int8").describe() == "diloco:500+int8"
    assert parse("powersgd").rank == 4 and parse("powersgd:2@all").describe() == "powersgd:2@all"
    with pytest.raises(ValueError, match="matrix="):
        parse_model("params=1M,compute_ms=5,matrix=big")
    assert parse_model("params=1M,compute_ms=5,matrix=512x4608").matrix == (512, 4608)


def test_command_line_prints_compression(capsys):
    argv = ["simulate", "--cluster", "summit", "--model", "params=60M,compute_ms=180",
            "--gpus", "6,27360", "--compression", "int8"]
    assert gradsync_main(argv) == 0
    out = capsys.readouterr().out
    assert "compression int8" in out and "int8 compute 0.415 ns per element (assumed" in out
    header = next(line for line in out.splitlines() if line.startswith("   gpus"))
    assert header.split()[7:9] == ["compress_ms", "MB_sent"]  # after "busiest tier"
    assert gradsync_main(argv + ["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[1]["compression"] == "int8" and rows[1]["wire_mb"] > 0
    assert rows[1]["compress_ms"] == pytest.approx(
        simulate(cluster_file.load("summit"),
                 Model(params=60e6, compute=0.18, compression="int8"), 27360).compress * 1e3)
    with pytest.raises(SystemExit):
        gradsync_main(argv[:-1] + ["zip"])
    assert "compression 'zip'" in capsys.readouterr().err


def test_calibration_measures_every_kind():
    from gradsync.simulate.calibrate import measure

    rates = measure(elements=8192, repeats=1, matrix=64)
    assert set(rates) == {"bf16", "fp16", "int8", "int4", "fp8", "powersgd", "randomk"}
    assert all(0 < v < 1e-2 for v in rates.values()), rates  # seconds per element: any load
    cluster_file.parse({"name": "c", "ranks_per_node": 1, "compress_seconds_per_element": rates,
                        "tiers": [{"bandwidth": "1GB/s", "latency": "1us"}]})


# docs/simulate.md, "Projections with compression": Summit, 60M parameters, 180 ms, 25 MB
# buckets, efficiency at 1,536 and 27,360 GPUs (compute at the assumed passes). int8's
# alltoall by Bruck's algorithm where the cost model prefers it: before, by the pairwise
# exchange alone, int8 read (0.94, 0.911), int8@hosts (0.938, 0.485), int8@all (0.85, 0.102).
# Its allgather by Bruck's likewise: before, by the ring alone, int8 read (0.94, 0.92),
# int8@hosts (0.939, 0.701), int8@all (0.851, 0.175).
PROJECTED = {"none": (0.938, 0.909), "bf16": (0.943, 0.914), "int8": (0.94, 0.93),
             "int8@hosts": (0.943, 0.931), "int8@all": (0.9, 0.812),
             "powersgd:4": (0.932, 0.922), "powersgd:4@all": (0.948, 0.938),
             "randomk:0.01": (0.942, 0.932), "localsgd:8": (0.928, 0.915),
             "diloco:100+int8": (0.951, 0.941)}


@pytest.mark.parametrize("text", list(PROJECTED))
def test_the_projections_in_the_docs(text):
    c = cluster_file.load("summit")
    model = parse_model(f"params=60M,compute_ms=180,buckets=25MB,compression={text}")
    got = tuple(round(simulate(c, model, n).efficiency, 3) for n in (1536, 27360))
    assert got == PROJECTED[text]
