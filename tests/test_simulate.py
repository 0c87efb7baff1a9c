"""gradsync simulate: the shared cost model, closed forms, the step model, published points.

Pure computation (no processes). The measured-here points are in test_simulate_netns.py
(slow tier: they build emulated clusters and train on them).
"""

from __future__ import annotations

import builtins
import json
import math
import string
import time

import pytest

from gradsync.collectives.costs import RankFabric, allreduce_time
from gradsync.collectives.planner import choose_allreduce
from gradsync.config import Config
from gradsync.errors import ConfigError
from gradsync.run.cli import main as gradsync_main
from gradsync.simulate import cluster as cluster_file
from gradsync.simulate.fabric import TierFabric
from gradsync.simulate.step import Model, _timeline, parse_model, simulate
from gradsync.simulate.validate import PUBLISHED, predict
from gradsync.topology import Topology

MB = 1e6
LOCAL = {"bandwidth": "5GB/s", "latency": "5us"}
HOST = {"bandwidth": "1gbit", "latency": "100us"}
GROUP = {"bandwidth": "200mbit", "latency": "200us"}

# The planner's choice for each layout (one letter a host, ranks in rank order) and each size
# 256 B, 1 KiB, ..., 256 MiB (x4), recorded from the planner before its formulas moved to
# collectives/costs.py: do = doubling, ha = halving_doubling, ri = ring, hi = hierarchical.
BEFORE = {
    "ab": "do do do do do do do ha ha ri ha",
    "aab": "do do do do hi hi hi hi hi hi hi",
    "aabb": "do do do hi hi hi hi hi hi hi hi",
    "abab": "do do do ha ha ha ha ha ha ha ha",
    "aaabbb": "hi hi hi hi hi hi hi hi hi hi hi",
    "aabbcc": "do do hi hi hi hi hi hi hi hi hi",
    "abcabc": "do hi hi hi hi hi hi hi hi hi hi",
    "aaaabbbb": "do do do hi hi hi hi hi hi hi hi",
    "aabbb": "do do do hi hi hi hi hi hi hi hi",
    "abcd": "do do do do ha ha ha ha ha ha ha",
    "aabbccdd/g0=ab;g1=cd": "do do hi hi hi hi hi hi hi hi hi",
    "aabbcc/g0=ab;g1=c": "do do hi hi hi hi hi hi hi hi hi",
    "aabbccddeeff": "do do do hi hi hi hi hi hi hi hi",
}


def _topology(key: str) -> Topology:
    layout, _, groups = key.partition("/")
    spec = {"tiers": {"local": LOCAL, "host": HOST}}
    if groups:
        spec["tiers"]["group"] = GROUP
        spec["groups"] = {g: list(hosts) for g, hosts in
                          (item.split("=") for item in groups.split(";"))}
    return Topology.from_hosts(list(layout), spec)


@pytest.mark.parametrize("key", sorted(BEFORE))
def test_the_planner_chooses_as_before_the_cost_model_moved(key):
    topo = _topology(key)
    sizes = [1 << s for s in range(8, 30, 2)]
    got = [choose_allreduce(n, topo.size, "auto", Config(), False, topo)[:2] for n in sizes]
    assert " ".join(got) == BEFORE[key]


def _uniform(hosts: int, per_host: int, groups: int):
    """The same cluster as a Topology (planner) and as a cluster file (simulator)."""
    names = string.ascii_lowercase[:hosts]
    spec = {"tiers": {"local": LOCAL, "host": HOST, "group": GROUP}}
    per_group = hosts // groups
    if groups > 1:
        spec["groups"] = {f"g{g}": list(names[g * per_group:(g + 1) * per_group])
                          for g in range(groups)}
    topo = Topology.from_hosts([h for h in names for _ in range(per_host)], spec)
    tiers = [LOCAL, {**HOST, "fanout": per_group}]
    if groups > 1:  # the planner's group bandwidth is the whole uplink; the file's is per node
        tiers.append({"fanout": groups, "bandwidth": 25e6 / per_group, "latency": "200us"})
    c = cluster_file.parse({"ranks_per_node": per_host, "tiers": tiers,
                            "reduce_bandwidth": topo.reduce_bandwidth})
    return topo, c


@pytest.mark.parametrize("hosts,per_host,groups", [(2, 2, 1), (3, 2, 1), (5, 3, 1), (2, 1, 1),
                                                   (4, 3, 2), (6, 4, 3), (8, 3, 4)])
def test_closed_forms_give_the_planners_numbers(hosts, per_host, groups):
    topo, c = _uniform(hosts, per_host, groups)
    for alg in ("ring", "doubling", "halving_doubling", "hierarchical"):
        for nbytes in (1000, 1 << 20, 100 << 20):
            planner = allreduce_time(alg, RankFabric(topo, topo.ring_order()), nbytes)
            simulator = allreduce_time(alg, TierFabric(c, hosts * per_host), nbytes)
            assert simulator == pytest.approx(planner, rel=1e-12), (alg, nbytes)


def test_a_ring_across_nodes_in_closed_form():
    # 4 nodes x 2 ranks on 1 Gbit/s (125 MB/s): each of the 2(n-1) = 14 steps moves S/8 over
    # one NIC per node, so it lasts 100 us + S/8 / 125 MB/s; 7 of them fold S/8 at 6 GB/s.
    c = cluster_file.parse({"ranks_per_node": 2, "reduce_bandwidth": "6GB/s",
                            "tiers": [LOCAL, {**HOST, "fanout": 4}]})
    s = 80 * MB
    expected = 14 * (100e-6 + s / 8 / 125e6) + 7 * s / 8 / 6e9
    assert allreduce_time("ring", TierFabric(c, 8), s) == pytest.approx(expected)
    # Hierarchical: a 2-rank ring inside each node, then a 4-node ring of the whole S
    # through each NIC: 6 steps of S/4 (3 folding), 2(H-1)/H of S per NIC.
    inside = 2 * (5e-6 + s / 2 / 5e9) + s / 2 / 6e9
    across = 6 * (100e-6 + s / 4 / 125e6) + 3 * s / 4 / 6e9
    assert allreduce_time("hierarchical", TierFabric(c, 8), s) == pytest.approx(inside + across)


def test_oversubscription_divides_the_uplink_among_the_units_nodes():
    c = cluster_file.parse({"ranks_per_node": 1, "tiers": [
        LOCAL, {"fanout": 4, "bandwidth": "10Gbit/s", "latency": "1us"},
        {"fanout": 8, "bandwidth": "10Gbit/s", "latency": "1us", "oversubscription": 4}]})
    assert c.uplinks() == [5e9, 1.25e9, 4 * 1.25e9 / 4]
    assert c.unit_ranks() == [1, 1, 4, math.inf] and c.capacity == 32
    with pytest.raises(ValueError, match="holds at most 32 ranks"):
        TierFabric(c, 33)


def test_the_step_overlaps_buckets_with_backward_as_documented():
    # The worked example of step.py: compute 100 ms, two 10 MB buckets of 40 ms each.
    model = Model(params=5e6, compute=0.1, bucket_bytes=10 * MB)
    assert model.buckets() == [10 * MB, 10 * MB]
    assert _timeline(model, [0.04, 0.04]) == pytest.approx(0.1 + 0.2 / 3 + 0.08 - 0.1)
    # Communication shorter than the rest of backward is hidden but for the last bucket.
    assert _timeline(model, [0.01, 0.01]) == pytest.approx(0.11)
    assert Model(params=6e6, compute=0.1, bucket_bytes=10 * MB).buckets() == [10 * MB, 10 * MB,
                                                                              4 * MB]


def test_one_gpu_is_pure_compute_and_more_gpus_cost_more():
    c = cluster_file.load("summit")
    model = parse_model("params=60M,compute_ms=180,buckets=25MB")
    one = simulate(c, model, 1)
    assert (one.step, one.exposed, one.efficiency, one.algorithms) == (0.18, 0.0, 1.0, {})
    rows = [simulate(c, model, n) for n in (6, 96, 1536)]
    assert [r.busiest_tier for r in rows] == ["nvlink", "cabinet", "cabinet"]
    assert rows[0].efficiency > rows[1].efficiency > rows[2].efficiency > 0.9
    half = simulate(c, parse_model("params=60M,compute_ms=180,compression=fp16"), 1536)
    assert half.exposed < rows[2].exposed


@pytest.mark.parametrize("algorithm,expected", [
    # docs/simulate.md, "The Summit scaling plot": efficiency and step ms at 6, 96, 1,536 GPUs.
    ("auto", [(0.997, 180.6), (0.991, 181.7), (0.980, 183.7)]),
    ("ring", [(0.997, 180.6), (0.991, 181.7), (0.925, 194.5)]),
    ("halving_doubling", [(0.994, 181.1), (0.566, 318.1), (0.555, 324.4)]),
])
def test_the_summit_table_in_the_docs(algorithm, expected):
    c = cluster_file.load("summit")
    model = parse_model("params=60M,compute_ms=180,buckets=25MB")
    got = [simulate(c, model, n, algorithm) for n in (6, 96, 1536)]
    assert [(round(r.efficiency, 3), round(r.step * 1e3, 1)) for r in got] == expected


def test_27360_ranks_without_simulating_each_rank():
    c = cluster_file.load("summit")
    model = parse_model("params=60M,compute_ms=180,buckets=25MB")
    start = time.perf_counter()
    for alg in ("auto", "ring", "hierarchical", "halving_doubling", "doubling"):
        r = simulate(c, model, 27360, alg)
        assert 0 < r.efficiency < 1 and r.busiest_tier
    print(f"27,360 ranks, 5 algorithms: {time.perf_counter() - start:.2f} s")


@pytest.mark.parametrize("point", PUBLISHED, ids=[p.name for p in PUBLISHED])
def test_published_points(point):
    got = predict(point)
    if point.name in ("Horovod Inception V3", "Kurth et al. DeepLabv3+ (FP32)"):
        # Known gaps (docs/simulate.md, "Assumptions, and where the model is known to be
        # wrong"; no constant tuned to close them): the model has no term for
        # framework overheads, stragglers or I/O, so it is optimistic: 5.1 and 8.7 points.
        assert point.observed < got < point.observed + 0.10, got
    else:
        assert abs(got - point.observed) <= 0.05, got


def test_shipped_cluster_files_load_and_cite_their_numbers():
    names = cluster_file.shipped()
    assert {"summit", "horovod-512", "ddl-256", "goyal-256", "emulated-2x2",
            "emulated-3x1-groups"} <= set(names)
    for name in names:
        c = cluster_file.load(name)
        assert c.source and c.assumed, name


@pytest.mark.parametrize("spec,message", [
    ({"tiers": [LOCAL]}, "ranks_per_node is required"),
    ({"ranks_per_node": 0, "tiers": [LOCAL]}, "ranks_per_node must be a positive integer"),
    ({"ranks_per_node": 2, "tiers": []}, "tiers must be a non-empty list"),
    ({"ranks_per_node": 2, "tiers": [{"bandwidth": "1GB/s"}]}, r"tiers\[0\]: latency"),
    ({"ranks_per_node": 2, "tiers": [LOCAL, {**HOST, "fanout": 1}, HOST]},
     r"tiers\[1\].fanout: must be an integer >= 2"),
    ({"ranks_per_node": 2, "tiers": [LOCAL, {**HOST, "oversubscription": 0.5}]},
     "oversubscription: must be a number >= 1"),
    ({"ranks_per_node": 2, "tiers": [LOCAL, {**HOST, "bandwidth": "fast"}]},
     r"tiers\[1\].bandwidth: 'fast' is not a bandwidth"),
    ({"ranks_per_node": 2, "tiers": [LOCAL], "racks": 3}, r"unknown field\(s\) \['racks'\]"),
])
def test_bad_cluster_files_are_named(spec, message):
    with pytest.raises(ConfigError, match=message):
        cluster_file.parse(spec)


def test_bad_models_are_named():
    for text, message in [("compute_ms=5", "params= is required"),
                          ("params=1M,compute_ms=5,speed=3", r"unknown key\(s\) \['speed'\]"),
                          ("params=lots,compute_ms=5", "not a number"),
                          ("params=1M,compute_ms=5,compression=zip", "compression 'zip'")]:
        with pytest.raises(ValueError, match=message):
            parse_model(text)
    assert parse_model("params=60M,compute_ms=180,buckets=25MiB").bucket_bytes == 25 << 20


def test_command_line_table_json_and_validate(capsys):
    argv = ["simulate", "--cluster", "summit", "--model", "params=60M,compute_ms=180",
            "--gpus", "6,27360"]
    assert gradsync_main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line and line[0] != "#"]
    assert rows[0][:4] == ["gpus", "step_ms", "exposed_ms", "eff"]
    assert [r[0] for r in rows[1:]] == ["6", "27360"] and rows[2][4] == "spine"
    assert gradsync_main(argv + ["--json", "--algorithm", "ring"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["algorithms"] for r in got] == [{"ring": 10}, {"ring": 10}]
    assert gradsync_main(["simulate", "--validate"]) == 0
    out = capsys.readouterr().out
    assert all(p.name in out for p in PUBLISHED)
    assert "add --measure" in out  # the measured-here points need root: said, not dropped
    for name in {p.cluster for p in PUBLISHED}:  # each file's sources and assumptions
        assert f"# cluster file {name} " in out
        assert all(text[:40] in out.replace("\n#     ", " ")
                   for text in cluster_file.load(name).assumed), name
    with pytest.raises(SystemExit):
        gradsync_main(["simulate", "--cluster", "summit"])
    assert "needs --model, --gpus" in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_install_command(monkeypatch):
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit, match=r"pip install 'gradsync\[simulate\]'"):
        gradsync_main(["simulate", "--cluster", "summit", "--model", "params=1M,compute_ms=1",
                       "--gpus", "6", "--plot", "x.png"])


def test_plot_draws_a_png(tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.fail("--plot needs matplotlib: pip install -e '.[simulate]' (or '.[test]')")
    path = tmp_path / "scaling.png"
    assert gradsync_main(["simulate", "--cluster", "summit", "--model",
                          "params=60M,compute_ms=180", "--gpus", "6,96", "--plot",
                          str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
