"""Bruck's allgather or the ring: the cost model's formulas against the steps the algorithms
take, its choice, the simulator's time, and the compressors' Comms choosing the same on every
rank.

The formulas against a fabric of fixed links (``costs.py``'s worked example) and against a
fabric that records the steps it is asked to time, compared with what each rank of a run sends
(ranks as threads, ``test_algorithms.run_ok``); the choice on a job's ranks (``RankFabric``)
and on Summit (``TierFabric``); the simulator's allgather against the cheaper formula; and
``compress.comm``'s ``ViewComm`` and ``WorldComm`` running int8's allgather, each rank with
its own copy of the topology, as processes have.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch

from gradsync.cluster.topology import Topology
from gradsync.collectives import allgather, costs
from gradsync.collectives.costs import RankFabric, bruck_allgather, ring_allgather
from gradsync.simulate import cluster as cluster_file
from gradsync.simulate import compression as simulated
from gradsync.simulate.fabric import TierFabric
from test_algorithms import Counting, run_ok
from test_alltoall_choice import Links, hosts, through


class RingLinks(Links):
    """``Links`` whose ring step is a shift by one: one message a rank over its own link."""

    def ring_step(self, nbytes: float) -> float:
        return self.shift_step(1, nbytes)


def test_the_formulas_are_the_worked_examples():
    """``costs.py``: 4,560 ranks at 3 us and 23 GB/s. 1 MB: the ring 13.72 ms, Bruck 82 us
    (13 steps, 4,559 blocks, no copies); 1 GB: the ring 57 ms, Bruck 43.5 ms."""
    f = RingLinks(4560)
    block = 1e6 / 4560
    assert ring_allgather(f, 1e6) == pytest.approx(4559 * (3e-6 + block / 23e9))
    assert bruck_allgather(f, 1e6) == pytest.approx(13 * 3e-6 + 4559 * block / 23e9)
    assert (round(ring_allgather(f, 1e6) * 1e3, 2), round(bruck_allgather(f, 1e6) * 1e6)) \
        == (13.72, 82)
    assert (round(ring_allgather(f, 1e9) * 1e3), round(bruck_allgather(f, 1e9) * 1e3, 1)) \
        == (57, 43.5)
    assert costs.cheapest_allgather(f, 1e6) == costs.cheapest_allgather(f, 1e9) == "bruck"
    # Two or three ranks: the same steps, and the ring at a tie (the first of equals).
    for n in (2, 3):
        assert ring_allgather(RingLinks(n), 1e3) == bruck_allgather(RingLinks(n), 1e3)
        assert costs.cheapest_allgather(RingLinks(n), 1e3) == "ring"
    assert costs.cheapest_allgather(RingLinks(4), 1e3) == "bruck"
    assert ring_allgather(RingLinks(1), 1e6) == bruck_allgather(RingLinks(1), 1e6) == 0.0
    with pytest.raises(ValueError, match="no cost model for allgather 'star'"):
        costs.allgather_time("star", f, 1e6)


class Steps:
    """A fabric that records the steps a formula asks it to time, each at one second."""

    reduce_bandwidth = 1.0

    def __init__(self, n: int):
        self.n, self.asked = n, []

    def ring_step(self, nbytes: float) -> float:
        self.asked.append((1, nbytes))
        return 1.0

    def shift_step(self, distance: int, nbytes: float) -> float:
        self.asked.append((distance, nbytes))
        return 1.0


class Sends(Counting):
    """``Counting`` that keeps each exchange's peers, as distances ahead, and bytes sent."""

    def __init__(self, comm):
        super().__init__(comm)
        self.log: list[tuple[set[int], int]] = []

    def exchange(self, sends=(), recvs=(), lend=False):
        self.log.append(({(peer - self.rank) % self.size for peer, _ in sends},
                         sum(memoryview(buf).nbytes for _, buf in sends)))
        super().exchange(sends, recvs, lend)


@pytest.mark.parametrize("n", [2, 3, 5, 6, 7, 8])
def test_the_formulas_time_the_steps_each_rank_takes(n):
    """Each formula's steps are the algorithm's: Bruck's one shift step per exchange, at the
    distance every rank sends to and with the bytes it sends; the ring's n - 1 ring steps of a
    block each (one segment a block here), which the formula times as n - 1 of one."""
    block = 3 * n + 1  # float64 elements: 8 (3n + 1) bytes a block
    nbytes = 8 * n * block
    timed = {}
    for algorithm, formula in costs.ALLGATHERS.items():
        f = Steps(n)
        timed[algorithm] = formula(f, nbytes), f.asked

    def rank_fn(comm):
        logs = {}
        for algorithm in allgather.ALGORITHMS:
            data = np.zeros(n * block)
            data[comm.rank * block:(comm.rank + 1) * block] = comm.rank + 1
            sends = Sends(comm)
            allgather.uniform(sends, data, algorithm, 1 << 20)
            assert np.array_equal(data, np.repeat(np.arange(1.0, n + 1), block))
            logs[algorithm] = sends.log
        return logs

    seconds, asked = timed["bruck"]
    assert seconds == len(asked) == (n - 1).bit_length()
    assert sum(b for _, b in asked) == (n - 1) * 8 * block
    seconds, asked = timed["ring"]
    assert (seconds, asked) == (n - 1, [(1, 8 * block)])
    for logs in run_ok(n, rank_fn):
        assert logs["bruck"] == [({d}, b) for d, b in timed["bruck"][1]]
        assert logs["ring"] == [({1}, 8 * block)] * (n - 1)


def test_the_cost_model_gathers_tiny_blocks_by_bruck_and_large_ones_on_a_host_by_the_ring():
    """64 hosts 50 us apart, one rank each: Bruck's 6 steps carry the ring's bytes, so it wins
    at every size. 8 hosts of 4 ranks: Bruck's steps at distances 4, 8 and 16 put every rank's
    message on its host's NIC at once, where the ring in topology order sends one a host, so
    large blocks go by the ring. Summit's 4,560 nodes and 27,360 GPUs: int8's blocks by
    Bruck."""
    f = RankFabric(hosts(64, "50us", "1.25GB/s"), range(64))
    assert costs.cheapest_allgather(f, 64 * 64) == costs.cheapest_allgather(f, 64 << 20) == "bruck"
    shared = Topology.from_hosts([f"h{i // 4}" for i in range(32)], {
        "tiers": {"host": {"bandwidth": "1.25GB/s", "latency": "50us"}}})
    f = RankFabric(shared, range(32))
    assert costs.cheapest_allgather(f, 32 * 64) == "bruck"
    assert costs.cheapest_allgather(f, 32 << 20) == "ring"
    for stride, block in ((6, 232), (1, 233)):
        owners = TierFabric(cluster_file.load("summit"), 27360, stride)
        assert costs.cheapest_allgather(owners, owners.n * block) == "bruck"


@pytest.mark.parametrize("ranks,stride,block,cheaper", [
    (27360, 6, 2056, "bruck"),  # int8@hosts' stand-ins, a 25 MB bucket
    (27360, 1, 233, "bruck"),  # int8@all
    (96, 1, 66_000, "ring"),  # int8@all on 16 nodes: a node's six share its NIC
    (6, 1, 4_200_000, "bruck"),  # one node: no NIC to share, 3 steps against 5
])
def test_the_simulator_times_the_cheaper_allgather(ranks, stride, block, cheaper):
    """``simulate/compression.allgather_time`` is the cheaper formula of the allgather's n
    blocks, which every call of an allgather (one block) is timed by."""
    f = TierFabric(cluster_file.load("summit"), ranks, stride)
    timed = {alg: costs.allgather_time(alg, f, f.n * block) for alg in costs.ALLGATHERS}
    assert min(timed, key=timed.__getitem__) == cheaper
    assert simulated.allgather_time(f, block) == min(timed.values())
    assert simulated.call_time(f, ("allgather", block), None) == min(timed.values())


# Five hosts far apart, tiny blocks: Bruck's 3 latencies beat the ring's 4. Three hosts of two
# ranks close by, 64 KiB blocks: Bruck's steps at distance 2 and 4 send two of a host's ranks
# off it at once, the ring one, so the ring's 5 steps win.
CHOICES = {"far": (["h0", "h1", "h2", "h3", "h4"], "10ms", "100GB/s", 16, "bruck", 3),
           "shared": (["h0", "h0", "h1", "h1", "h2", "h2"], "1us", "1GB/s", 64 << 10, "ring", 5)}


@pytest.mark.parametrize("front", ["view", "world"])
@pytest.mark.parametrize("links", sorted(CHOICES))
def test_compress_comms_choose_the_same_allgather_on_every_rank(links, front):
    """``ViewComm`` (inside a tiered reduction) and ``WorldComm`` (the World's ranks): every
    rank, with its own topology, runs the allgather the cost model picks on the ranks (told by
    its steps), and gets every rank's block in rank order; the World's description names it."""
    names, latency, bandwidth, block, want, steps = CHOICES[links]
    k = len(names)

    def topology() -> Topology:
        return Topology.from_hosts(names, {"tiers": {"host": {"bandwidth": bandwidth,
                                                              "latency": latency}}})

    assert costs.cheapest_allgather(RankFabric(topology(), range(k)), k * block) == want

    def rank_fn(comm):
        r = comm.rank
        fronted, recording = through(front, comm, k, topology())
        got = fronted.allgather(torch.full((block,), 16 * r + 1, dtype=torch.uint8))
        return got.numpy(), recording.steps, recording.begun

    for r, (got, taken, begun) in enumerate(run_ok(k, rank_fn)):
        assert got.tobytes() == np.repeat(16 * np.arange(k) + 1, block).astype(np.uint8).tobytes()
        assert taken == steps, (r, taken)
        if front == "world":
            assert begun == [f"compressed allgather 'test #1 allgather' uint8[{k}x{block}] "
                             f"by {want}"]
