"""The planner's cost model on synthetic topologies, ``gradsync plan``, ``gradsync probe``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gradsync.bench import plan as plan_cli
from gradsync.cluster.topology import Topology, load
from gradsync.collectives import costs
from gradsync.collectives import planner
from gradsync.collectives.planner import Plans, choose_allreduce, plan, predict
from gradsync.compress.comm import chosen
from gradsync.config import Config
from forked_jobs import spawn

GBIT = {"tiers": {"host": {"bandwidth": "1gbit", "latency": "100us"},
                  "local": {"bandwidth": "5GB/s", "latency": "5us"}}}
MiB = 1 << 20


def topo(layout: str, spec=None) -> Topology:
    return Topology.from_hosts(list(layout), spec or GBIT)


def choice(layout: str, nbytes: int, spec=None) -> str:
    return choose_allreduce(nbytes, len(layout), "auto", Config(), False, topo(layout, spec))


def test_large_messages_across_hosts_go_hierarchical():
    assert choice("aabb", 64 * MiB) == "hierarchical"
    assert choice("aaabbb", 64 * MiB) == "hierarchical"
    assert choice("aab", 64 * MiB) == "hierarchical"


def test_small_messages_take_the_fewest_steps():
    assert choice("aabb", 4096) == "doubling"
    assert choice("aaaabbbb", 1024) == "doubling"


def test_predicted_gains_match_the_traffic_argument():
    # 2 hosts x 2 ranks: a ring dealt across hosts puts every edge on the slow tier and
    # two streams on each NIC; in host order two edges cross; the hierarchical allreduce
    # moves 2(H-1)/H of the data per host over both of its ranks' streams.
    t = topo("abab")
    flat = predict("ring", 64 * MiB, t)
    ordered = predict("topo_ring", 64 * MiB, t)
    hier = predict("hierarchical", 64 * MiB, t)
    assert flat / hier == pytest.approx(2.9, rel=0.1)
    assert ordered / hier == pytest.approx(1.46, rel=0.1)
    # Inter-host bandwidth of the hierarchical plan: (H-1)/H * 2 of the data through 1 Gbit/s.
    assert 64 * MiB / hier == pytest.approx(125e6, rel=0.1)


def test_three_tiers_keep_the_slowest_tier_for_the_least_traffic():
    spec = {**GBIT, "groups": {"g0": ["a", "b"], "g1": ["c", "d"]}}
    spec["tiers"] = {**GBIT["tiers"], "group": {"bandwidth": "200mbit", "latency": "200us"}}
    t = topo("aabbccdd", spec)
    # The group uplinks carry 2(G-1)/G of the data instead of the ring's 2(n-1)/n: 1.75x less.
    assert predict("hierarchical", 64 * MiB, t) < predict("topo_ring", 64 * MiB, t) / 1.4
    assert choice("aabbccdd", 64 * MiB, spec) == "hierarchical"


def _grouped(uplink: str) -> Topology:
    """2 groups x 2 hosts x 2 ranks; each group's uplink (the whole of it) at ``uplink``."""
    spec = {"tiers": {**GBIT["tiers"], "group": {"bandwidth": uplink, "latency": "200us"}},
            "groups": {"g0": ["a", "b"], "g1": ["c", "d"]}}
    return topo("aabbccdd", spec)


@pytest.mark.parametrize("uplink,across", [("1gbit", 125e6), ("2gbit", 250e6), ("4gbit", 250e6)])
def test_the_step_across_groups_leaves_through_every_nic_of_the_group(uplink, across):
    # hierarchical.py: a 2-rank ring in each host, a 2-host ring of each host's stand-in in
    # each group (S through its NIC), then each host's rank rings its half of the group's
    # share across the groups through its own NIC: the group's S leaves through 2 NICs
    # (250 MB/s) or its uplink, whichever is slower. Issue 27: the model once sent it through
    # one NIC (125 MB/s), so only the uplink at 1 Gbit/s, the NIC's rate, kept its figure.
    s, fold = 64 * MiB, 64 * MiB / 2 / 6e9
    inside = 2 * (5e-6 + s / 2 / 5e9) + fold
    hosts = 2 * (100e-6 + s / 2 / 125e6) + fold
    groups = 2 * (200e-6 + s / 2 / across) + fold
    assert predict("hierarchical", s, _grouped(uplink)) == pytest.approx(inside + hosts + groups)


def test_non_blocking_groups_go_hierarchical_and_oversubscribed_ones_as_before():
    # With group uplinks as fast as their hosts' NICs together the hierarchical plan moves
    # the least through every NIC and wins large messages (issue 27: the model had it lose
    # to the ring in topology order from 1 MiB up); oversubscribed uplinks bound it as before.
    for nbytes in (1 * MiB, 64 * MiB, 256 * MiB):
        t = _grouped("2gbit")
        assert choose_allreduce(nbytes, 8, "auto", Config(), False, t) == "hierarchical"
        assert predict("hierarchical", nbytes, t) < predict("topo_ring", nbytes, t)
    assert [choose_allreduce(1 << e, 8, "auto", Config(), False, _grouped("200mbit"))
            for e in (10, 16, 20, 26)] == ["doubling", "hierarchical", "hierarchical",
                                           "hierarchical"]


SLOW = {"tiers": {"host": {"bandwidth": "100mbit", "latency": "100us"},
                  "local": {"bandwidth": "5GB/s", "latency": "5us"}}}
BUCKET = 5_300_000  # issue 38's language model's float32 gradients, one DDP bucket


@pytest.mark.parametrize("spec", [SLOW, None], ids=["100mbit", "default-tiers"])
def test_a_bandwidth_bound_link_takes_the_ring_over_halving_doublings_bursts(spec):
    # Issue 38: 4 hosts of one rank, a 5.3 MB allreduce. Both send 2(n-1)/n S a rank; the
    # model has halving-doubling faster by two latencies (0.03% at 100 Mbit/s, 1.4% with the
    # default tiers), and measured it was slower on shaped links (costs.RING_MARGIN). The
    # planner ran halving-doubling here before; now the ring.
    t = Topology.from_hosts(list("abcd"), spec) if spec else Topology.from_hosts(list("abcd"))
    hd, ring = predict("halving_doubling", BUCKET, t), predict("ring", BUCKET, t)
    assert hd < ring < hd * (1 + costs.RING_MARGIN)
    assert choose_allreduce(BUCKET, 4, "auto", Config(), False, t) == "ring"
    assert choose_allreduce(4 * MiB, 4, "auto", Config(), False, t) == "ring"
    # A tiered exchange's sub-group (compress.comm) chooses by the same rule.
    assert chosen("allreduce", t, [0, 1, 2, 3], BUCKET, 1 << 20) == "ring"


def test_latency_bound_messages_keep_doubling_and_halving_doubling():
    slow = topo("abcd", SLOW)
    assert choose_allreduce(4096, 4, "auto", Config(), False, slow) == "doubling"  # 27% faster
    default = Topology.from_hosts(list("abcd"))
    assert [choose_allreduce(n, 4, "auto", Config(), False, default)
            for n in (4096, 256 << 10, MiB)] == ["doubling", "halving_doubling",
                                                "halving_doubling"]  # 2.8x, 18%, 6.3% faster
    # Within the margin yet latency-bound (the latencies more than half the time): 16 KiB
    # over 2 hosts x 2 ranks dealt alternately, halving-doubling 0.2% ahead of the
    # hierarchical plan, stays.
    t = topo("abab")
    hd = predict("halving_doubling", 16 << 10, t)
    assert predict("hierarchical", 16 << 10, t) < hd * (1 + costs.RING_MARGIN)
    assert choose_allreduce(16 << 10, 4, "auto", Config(), False, t) == "halving_doubling"
    assert choose_allreduce(MiB, 4, "auto", Config(), False, t) == "hierarchical"


def test_the_ring_family_is_preferred_only_over_the_bursty_algorithms():
    # costs.choose on made-up times on a 100 Mbit/s link: a ring within the margin of a
    # cheaper doubling or halving-doubling wins; a cheapest ring stays; outside the margin,
    # or between the two bursty ones, the cheapest stays.
    f = costs.RankFabric(topo("abcd", SLOW), range(4))
    m = costs.RING_MARGIN
    assert costs.choose(f, {"halving_doubling": 1.0, "ring": 1 + m / 2}) == "ring"
    assert costs.choose(f, {"halving_doubling": 1.0, "ring": 1 + 2 * m}) == "halving_doubling"
    assert costs.choose(f, {"doubling": 1.0, "topo_ring": 1.01, "ring": 1.02}) == "topo_ring"
    assert costs.choose(f, {"ring": 1.0, "hierarchical": 0.99}) == "hierarchical"
    assert costs.choose(f, {"doubling": 1.0, "halving_doubling": 1.01}) == "doubling"
    # Latency-bound: halving-doubling's four latencies (400 us) are more than half its time.
    assert costs.choose(f, {"halving_doubling": 6e-4, "ring": 6.1e-4}) == "halving_doubling"


def test_plan_prints_the_choice_the_planner_makes():
    t = topo("abcd", SLOW)
    sizes = [1 << e for e in range(8, 28, 2)] + [BUCKET]
    assert [row["choice"] for row in plan(t, sizes)] == [
        choose_allreduce(n, 4, "auto", Config(), False, t) for n in sizes]


def test_one_host_uses_the_shared_memory_group_or_sizes():
    assert choose_allreduce(64 * MiB, 4, "auto", Config(), True, topo("aaaa")) == "shm"
    assert choose_allreduce(4096, 4, "auto", Config(), False, topo("aaaa")) == "doubling"
    assert choose_allreduce(64 * MiB, 4, "auto", Config(), False, topo("aaaa")) == "ring"
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        choose_allreduce(1, 2, "rings", Config(), False, topo("ab"))


def test_plan_prints_every_candidate_and_a_choice(capsys, tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(GBIT))
    assert plan_cli.main(["--hosts", "h0:2,h1:2", "--alternate", "--topology", str(path),
                          "--sizes", "4K:64M"]) == 0
    out = capsys.readouterr().out
    assert "ranks: h0 h1 h0 h1" in out
    rows = [line.split() for line in out.splitlines() if line and line[0] != "#"][1:]
    assert len(rows) == 8 and rows[0][0] == "4096" and rows[-1][0] == str(64 * MiB)
    assert all(len(r) == 7 for r in rows)
    assert plan_cli.placement("a:2,b:1", True) == ["a", "b", "a"]


# --------------------------------------------------------------- close calls, measured
HD, RING = "halving_doubling", "ring"


def _trials(plans: Plans, nbytes: int, seconds: dict, agree=lambda costs: None) -> list[str]:
    """Runs allreduces of ``nbytes`` through ``plans`` while it is trying, each taking
    ``seconds[algorithm]``; the algorithms they ran, and then the one kept."""
    ran = []
    while len(ran) < 20:
        alg = plans.allreduce(nbytes)
        if not plans.trying:
            return ran + [alg]
        ran.append(alg)
        plans.ran(nbytes, "auto", alg, seconds[alg], agree)
    raise AssertionError(f"still trying after {ran}")


TURNS = [HD] * planner.TRIAL_BLOCK + [RING] * planner.TRIAL_BLOCK


@pytest.mark.parametrize("hd, ring, kept, turns", [
    (0.012, 0.01, RING, planner.TRIAL_ROUNDS), (0.01, 0.012, HD, planner.TRIAL_ROUNDS),
    (0.01, 0.0103, RING, planner.TRIAL_ROUNDS), (0.013, 0.01, RING, 1)],
    ids=["ring-faster", "hd-faster", "hd-within-the-margin", "hd-far-behind-after-one-turn"])
def test_a_close_call_on_guessed_tiers_is_measured_and_the_faster_kept(hd, ring, kept, turns):
    # 4 hosts, the default tiers (a guessed 10 Gbit/s): 1 MiB is halving-doubling's by 6.3%
    # predicted, within planner.TRIAL_MARGIN of the ring, so the first allreduces take both in
    # turns and the faster is kept, halving-doubling only beyond costs.RING_MARGIN. Measured on
    # 4 emulated hosts: the ring at 100 Mbit/s, halving-doubling at 1 Gbit/s (docs/topology.md,
    # "Close calls, measured"). Halving-doubling behind by more than planner.TRIAL_MARGIN
    # after one turn each (1.7x at 25 Mbit/s) ends the trials there, with the ring.
    plans = Plans(4, Config(), False, Topology.from_hosts(list("abcd")))
    assert not plans.trying
    ran = _trials(plans, MiB, {HD: hd, RING: ring})
    assert ran == TURNS * turns + [kept]
    assert not plans.trying
    # Another size of the class (a power of 4) takes the outcome without trials of its own.
    assert plans.allreduce(1_090_000) == kept and not plans.trying
    # Outside the margin the model's choice stands, untried: doubling at 64 KiB (71% ahead of
    # the ring), the ring at 4 MiB (its own choice).
    assert plans.allreduce(64 << 10) == "doubling" and not plans.trying
    assert plans.allreduce(4 * MiB) == RING and not plans.trying


def test_each_call_counts_at_the_least_of_the_ranks_times_and_the_first_of_a_turn_not_at_all():
    # A rank's time for a call holds its wait for the last rank to arrive; the least over the
    # ranks (``agree``, a minimum over the job) does not. This rank found halving-doubling
    # faster; another rank, last to arrive at the ring's calls, timed them at 0.009 s: the
    # ring is kept. The first call of each turn is not counted: its 10 s leave no trace. The
    # ranks agree after one turn each (halving-doubling not far enough behind to stop there:
    # 0.010 against 0.009 s) and at the end.
    agreed = []

    def agree(calls):
        assert calls.dtype == np.float64 and calls.shape in ((2,), (2 * planner.TRIAL_ROUNDS,))
        agreed.append(calls.copy())
        half = calls.size // 2
        calls[half:] = np.minimum(calls[half:], 0.009 / MiB)

    plans = Plans(4, Config(), False, Topology.from_hosts(list("abcd")))
    seconds = iter([10.0, 0.010, 10.0, 0.012] * planner.TRIAL_ROUNDS)
    alg = plans.allreduce(MiB)
    while plans.trying:
        plans.ran(MiB, "auto", alg, next(seconds), agree)
        alg = plans.allreduce(MiB)
    assert alg == RING and len(agreed) == 2
    assert agreed[0] * MiB == pytest.approx([0.010, 0.012])  # this rank's, counted
    assert agreed[1] * MiB == pytest.approx([0.010] * 3 + [0.012] * 3)


def test_declared_tiers_requests_and_one_host_are_not_tried():
    default = Topology.from_hosts(list("abcd"))
    cases = {
        "declared": Plans(4, Config(), False, Topology.from_hosts(
            list("abcd"), {"tiers": {"host": {"bandwidth": "10gbit", "latency": "50us"}}})),
        "configured": Plans(4, Config(algorithm=HD), False, default),
        "no trial rounds": Plans(4, Config(), False, default, trial_rounds=0),
        "one host": Plans(4, Config(), False, Topology.from_hosts(list("aaaa"))),
    }
    for why, plans in cases.items():
        first = plans.allreduce(MiB)
        assert not plans.trying, why
        assert first == plans.allreduce(MiB), why
    # A declared local tier leaves the host tier, the one crossed, guessed: tried.
    local_only = Plans(4, Config(), False, Topology.from_hosts(
        list("abcd"), {"tiers": {"local": {"bandwidth": "8GB/s"}}}))
    assert local_only.allreduce(MiB) == HD and local_only.trying
    plans = Plans(4, Config(), False, default)
    assert plans.allreduce(MiB, HD) == HD and not plans.trying  # a requested algorithm


def test_contested_needs_a_ring_close_behind_a_bursty_choice_on_a_bandwidth_bound_link():
    f = costs.RankFabric(topo("abcd", SLOW), range(4))
    m = planner.TRIAL_MARGIN
    assert planner.contested(f, {HD: 1.0, RING: 1 + m / 2}, HD) == RING
    assert planner.contested(f, {HD: 1.0, RING: 1 + 2 * m}, HD) is None
    assert planner.contested(f, {"doubling": 1.0, "topo_ring": 1.1, RING: 1.2},
                             "doubling") == "topo_ring"
    assert planner.contested(f, {HD: 1.0, RING: 0.99}, RING) is None
    assert planner.contested(f, {"doubling": 1.0, HD: 1.01}, "doubling") is None
    # Latency-bound: halving-doubling's four latencies (400 us) more than half its time.
    assert planner.contested(f, {HD: 6e-4, RING: 6.1e-4}, HD) is None


def test_the_topology_says_which_tiers_a_file_declared_and_the_slowest_spanned():
    t = Topology.from_hosts(["a", "a", "b"], {"tiers": {"host": {"latency": "1us"}}})
    assert t.declared == {"host"} and Topology.from_hosts(["a", "b"]).declared == set()
    assert t.slowest() == "host" and t.slowest([0, 1]) is None
    grouped = Topology.from_hosts(["a", "b", "c"], {"groups": {"g": ["a", "b"], "h": ["c"]}})
    assert grouped.slowest() == "group" and grouped.slowest([0, 1]) == "host"


@pytest.mark.multiprocess
def test_the_ranks_of_a_job_try_the_same_algorithms_and_keep_the_same_one():
    # 4 ranks playing 4 hosts (loopback TCP), the default tiers: every 1 MiB allreduce exact,
    # the first 2 x TRIAL_BLOCK x TRIAL_ROUNDS in turns, and every rank keeps the same one.
    calls = 2 * planner.TRIAL_BLOCK * planner.TRIAL_ROUNDS + 2
    ranks = spawn(4, "plan_trials.py", str(calls), timeout=90, lean=True,
                  env={"GRADSYNC_LOG_LEVEL": "INFO"},
                  per_rank_env=lambda r: {"GRADSYNC_HOSTNAME": f"h{r}"})
    assert all(r.returncode == 0 for r in ranks), [r.output for r in ranks]
    seen = [(line for line in r.output.splitlines() if line.startswith("RAN ")) for r in ranks]
    ran = [next(lines).split()[1:] for lines in seen]
    kept = {next(x for x in r.output.splitlines() if x.startswith("KEPT ")) for r in ranks}
    assert len(kept) == 1, kept
    winner = kept.pop().split()[1]
    assert winner in (HD, RING) and "TRYING False" in ranks[0].output
    # All the turns, or one each where halving-doubling was far behind (the ring then kept).
    turns = planner.TRIAL_ROUNDS if ran[0][len(TURNS)] == HD else 1
    assert turns == planner.TRIAL_ROUNDS or winner == RING, ran
    assert all(seq == TURNS * turns + [winner] * (calls - len(TURNS) * turns)
               for seq in ran), ran
    # Rank 0 says what it measured and kept, once; the others say nothing of it.
    said = [r.output.count(f"{HD} and {RING} measured in {turns} turn{'s' if turns > 1 else ''} each")
            for r in ranks]
    assert said == [1, 0, 0, 0], [r.output for r in ranks]
    assert f"): {winner} kept" in ranks[0].output


@pytest.mark.multiprocess
def test_probe_measures_each_tier_and_writes_a_loadable_file(tmp_path):
    out = tmp_path / "probe.json"
    ranks = spawn(4, "probe.py", "--out", str(out), "--pings", "20", "--streams", "2",
                  timeout=90, lean=True,
                  per_rank_env=lambda r: {"GRADSYNC_HOSTNAME": f"h{r // 2}"})
    assert all(r.returncode == 0 for r in ranks), [r.output for r in ranks]
    written = json.loads(out.read_text())
    assert set(written["measured"]) == {"local", "host"}
    assert written["measured"]["local"]["ranks"] == [0, 1]
    assert written["measured"]["host"]["ranks"] == [0, 2]
    again = Topology.from_hosts(["h0", "h0", "h1", "h1"], load(out))
    assert again.tiers["host"].bandwidth == written["tiers"]["host"]["bandwidth"] > 0
