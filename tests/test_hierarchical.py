"""Topology model and hierarchical collectives, ranks as threads over in-memory pairs.

Hosts are assigned per rank (``layout``), including uneven hosts and numberings that
interleave hosts, and optionally grouped; every hierarchical collective is compared with a
NumPy reference, and the views' messages must pair up exactly (a mismatch would raise).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradsync.cluster.topology import Topology, load, parse_bandwidth, parse_latency, to_dict
from gradsync.collectives import hierarchical
from gradsync.collectives.ops import Max, Sum, make_reducer
from gradsync.errors import ConfigError
from test_algorithms import run_ranks

CHUNK = 64

# (hosts of each rank, groups or None)
LAYOUTS = [
    ("ab", None),                      # 2 hosts x 1
    ("aabb", None),                    # 2 x 2, host order
    ("abab", None),                    # 2 x 2, interleaved numbering
    ("aab", None),                     # uneven: 2 + 1
    ("abcab", None),                   # 3 hosts, uneven 2,2,1, interleaved
    ("aaab", None),                    # 3 + 1
    ("aabbcc", {"g0": ["a", "b"], "g1": ["c"]}),  # three tiers
    ("abcabc", {"g0": ["a"], "g1": ["b", "c"]}),  # three tiers, interleaved
    ("aaaa", None),                    # one host: flat
]


def topo_of(layout: str, groups) -> Topology:
    return Topology.from_hosts(list(layout), {"groups": groups} if groups else None)


def contributions(n: int, count: int, dtype):
    return [((np.arange(count) % 7 + 1) * (r + 1)).astype(dtype) for r in range(n)]


@pytest.mark.parametrize("layout, groups", LAYOUTS)
@pytest.mark.parametrize("count", [0, 1, 5, 37, 1000])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_allreduce(layout, groups, count, dtype):
    topo = topo_of(layout, groups)
    n = topo.size
    inputs = contributions(n, count, dtype)
    want = np.sum(inputs, axis=0).astype(dtype)

    def rank_fn(comm):
        data = inputs[comm.rank].copy()
        hierarchical.allreduce(comm, data, make_reducer(Sum, data.dtype), topo.ring_order(),
                               hierarchical.levels_of(topo), CHUNK, small_bytes=64)
        return data

    results, errors = run_ranks(n, rank_fn)
    assert errors == [None] * n
    for got in results:
        np.testing.assert_array_equal(got, want)


def test_allreduce_max_and_same_bits_on_every_rank():
    topo = topo_of("abcab", None)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(333).astype(np.float32) for _ in range(5)]

    def rank_fn(comm):
        data = inputs[comm.rank].copy()
        hierarchical.allreduce(comm, data, make_reducer(Sum, data.dtype), topo.ring_order(),
                               hierarchical.levels_of(topo), CHUNK)
        peak = inputs[comm.rank].copy()
        hierarchical.allreduce(comm, peak, make_reducer(Max, peak.dtype), topo.ring_order(),
                               hierarchical.levels_of(topo), CHUNK)
        return data, peak

    results, errors = run_ranks(5, rank_fn)
    assert errors == [None] * 5
    for data, peak in results:
        assert data.tobytes() == results[0][0].tobytes()
        np.testing.assert_allclose(data, np.sum(inputs, axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(peak, np.max(inputs, axis=0))


@pytest.mark.parametrize("layout, groups", LAYOUTS)
def test_allgather_uneven_counts(layout, groups):
    topo = topo_of(layout, groups)
    n = topo.size
    counts = [(3 * r + 2) % 5 for r in range(n)]  # some ranks contribute nothing
    offsets = np.concatenate([[0], np.cumsum(counts)])
    want = np.concatenate([np.full(c, r + 1, dtype=np.float64) for r, c in enumerate(counts)])

    def rank_fn(comm):
        data = np.zeros(sum(counts))
        data[offsets[comm.rank]:offsets[comm.rank + 1]] = comm.rank + 1
        hierarchical.allgather(comm, data, counts, topo.ring_order(),
                               hierarchical.levels_of(topo), CHUNK)
        return data

    results, errors = run_ranks(n, rank_fn)
    assert errors == [None] * n
    for got in results:
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layout, groups", LAYOUTS)
def test_broadcast_from_every_root(layout, groups):
    topo = topo_of(layout, groups)
    n = topo.size

    def rank_fn(comm):
        out = []
        for root in range(n):
            data = np.arange(50, dtype=np.int32) * (root + 1) if comm.rank == root else \
                np.zeros(50, dtype=np.int32)
            hierarchical.broadcast(comm, data, root, topo.ring_order(),
                                   hierarchical.levels_of(topo), CHUNK)
            out.append(data)
        return out

    results, errors = run_ranks(n, rank_fn)
    assert errors == [None] * n
    for per_rank in results:
        for root, got in enumerate(per_rank):
            np.testing.assert_array_equal(got, np.arange(50) * (root + 1))


# --- the topology model -------------------------------------------------------------------

@pytest.mark.parametrize("layout, groups, crossings", [
    ("abab", None, {"local": 2, "host": 2, "group": 0}),
    ("abcabc", None, {"local": 3, "host": 3, "group": 0}),
    ("abcabc", {"g0": ["a", "c"], "g1": ["b"]}, {"local": 3, "host": 1, "group": 2}),
    ("aaaa", None, {"local": 4, "host": 0, "group": 0}),
])
def test_ring_order_crosses_slow_tiers_least(layout, groups, crossings):
    topo = topo_of(layout, groups)
    order = topo.ring_order()
    assert sorted(order) == list(range(topo.size))
    assert topo.crossings(order) == crossings
    assert topo.crossings(list(range(topo.size)))["local"] <= crossings["local"]


def test_units_are_parsed_as_networks_quote_them():
    assert parse_bandwidth("1Gbit/s") == parse_bandwidth("1gbit") == 125e6
    assert parse_bandwidth("125MB/s") == 125e6
    assert parse_bandwidth("1GiB/s") == 1 << 30
    assert parse_bandwidth(5e8) == 5e8
    assert parse_latency("50us") == pytest.approx(50e-6)
    assert parse_latency("0.1ms") == pytest.approx(1e-4)


@pytest.mark.parametrize("spec, field", [
    ({"tierz": {}}, "tierz"),
    ({"tiers": {"nic": {"bandwidth": 1}}}, "tiers.nic"),
    ({"tiers": {"host": {"bandwidth": "fast"}}}, "tiers.host.bandwidth"),
    ({"tiers": {"host": {"latency": "-1ms"}}}, "tiers.host.latency"),
    ({"tiers": {"host": {"speed": 1}}}, "tiers.host"),
    ({"groups": {"g0": ["a"]}}, "groups"),                  # host b in no group
    ({"groups": {"g0": ["a", "b"], "g1": ["b"]}}, "groups"),  # b twice
    ({"reduce_bandwidth": 0}, "reduce_bandwidth"),
])
def test_bad_files_name_the_field(spec, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        Topology.from_hosts(["a", "b"], spec)


def test_file_round_trip(tmp_path):
    topo = Topology.from_hosts(list("aabbc"), {
        "tiers": {"host": {"bandwidth": "1gbit", "latency": "80us"}},
        "groups": {"rack0": ["a", "b"], "rack1": ["c", "d"]}})
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(to_dict(topo)))
    again = Topology.from_hosts(list("aabbc"), load(path))
    assert again == topo
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        load(bad)
