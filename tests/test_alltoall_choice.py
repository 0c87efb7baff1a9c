"""Bruck's alltoall or the pairwise exchange: the cost model's choice, the simulator's time, and
the compressors' Comms choosing the same on every rank.

The model's formulas against a fabric of fixed links (the numbers of ``costs.py``'s worked
example), the choice on a job's ranks (``RankFabric``) and on Summit (``TierFabric``), the
simulator's ``alltoall_time`` against the cheaper formula, and ``compress.comm``'s
``ViewComm`` and ``WorldComm`` running int8's alltoall over ranks as threads
(``test_algorithms.run_ok``), each rank with its own copy of the topology, as processes
have.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradsync.cluster.topology import Topology
from gradsync.collectives import costs
from gradsync.collectives.costs import RankFabric, bruck_alltoall, pairwise_alltoall
from gradsync.compress.comm import ViewComm, WorldComm
from gradsync.simulate import cluster as cluster_file
from gradsync.simulate import compression as simulated
from gradsync.simulate.fabric import TierFabric
from test_algorithms import Counting, run_ok


class Links:
    """Every shift step one message a rank over its own link: alpha + b / beta."""

    reduce_bandwidth = 400e9

    def __init__(self, n: int, alpha: float = 3e-6, beta: float = 23e9):
        self.n, self.alpha, self.beta = n, alpha, beta

    def shift_step(self, distance: int, nbytes: float) -> float:
        return self.alpha + nbytes / self.beta


def test_the_formulas_are_the_worked_examples():
    """``costs.py``: 4,560 ranks at 3 us and 23 GB/s. 1 MB: pairwise 13.72 ms, Bruck 0.33 ms
    (13 steps, 27,040 blocks); 1 GB: pairwise 57 ms, Bruck 0.29 s."""
    f = Links(4560)
    block = 1e6 / 4560
    assert pairwise_alltoall(f, 1e6) == pytest.approx(4559 * (3e-6 + block / 23e9)
                                                      + block / 400e9)
    moved = 27_040 * block
    assert bruck_alltoall(f, 1e6) == pytest.approx(13 * 3e-6 + moved / 23e9
                                                   + (2e6 + 2 * moved) / 400e9)
    assert (round(pairwise_alltoall(f, 1e6) * 1e3, 2), round(bruck_alltoall(f, 1e6) * 1e3, 2)) \
        == (13.72, 0.33)
    assert (round(pairwise_alltoall(f, 1e9), 3), round(bruck_alltoall(f, 1e9), 2)) \
        == (0.057, 0.29)
    assert costs.cheapest_alltoall(f, 1e6) == "bruck"
    assert costs.cheapest_alltoall(f, 1e9) == "pairwise"
    # One or two ranks: no steps to save, and Bruck's copies cost more.
    assert costs.cheapest_alltoall(Links(2), 1e3) == "pairwise"
    assert pairwise_alltoall(Links(1), 1e6) == bruck_alltoall(Links(1), 1e6) == 0.0
    with pytest.raises(ValueError, match="no cost model for alltoall 'star'"):
        costs.alltoall_time("star", f, 1e6)


def hosts(k: int, latency: str, bandwidth: str) -> Topology:
    """``k`` ranks, each on its own host, on links of ``latency`` and ``bandwidth``."""
    return Topology.from_hosts([f"h{i}" for i in range(k)],
                               {"tiers": {"host": {"bandwidth": bandwidth, "latency": latency}}})


def test_the_cost_model_sends_tiny_blocks_by_bruck_and_large_by_pairwise():
    """64 hosts 50 us apart (1.25 GB/s): 64-byte blocks take 6 steps of 32 blocks rather than
    63 of one; 1 MiB blocks go once each, pairwise. Summit's 4,560 nodes (int8's owners with
    tiers at hosts): a 25 MB bucket's int8 blocks (about 230 bytes) by Bruck."""
    f = RankFabric(hosts(64, "50us", "1.25GB/s"), range(64))
    assert costs.cheapest_alltoall(f, 64 * 64) == "bruck"
    assert costs.cheapest_alltoall(f, 64 << 20) == "pairwise"
    owners = TierFabric(cluster_file.load("summit"), 27360, 6)
    assert owners.n == 4560
    assert costs.cheapest_alltoall(owners, 4560 * 232) == "bruck"
    assert costs.cheapest_alltoall(owners, 4560 * (1 << 20)) == "pairwise"


@pytest.mark.parametrize("ranks,stride,nbytes,cheaper", [
    (27360, 6, 4560 * 232, "bruck"),  # int8@hosts' owners, a 25 MB bucket
    (27360, 1, 27360 * 40, "bruck"),  # int8@all
    (12, 1, 100 << 20, "pairwise"),  # two nodes, a large bucket
])
def test_the_simulator_times_the_cheaper_alltoall(ranks, stride, nbytes, cheaper):
    """``simulate/compression.alltoall_time`` is the cheaper formula, which every call of an
    alltoall is timed by."""
    f = TierFabric(cluster_file.load("summit"), ranks, stride)
    timed = {alg: costs.alltoall_time(alg, f, nbytes) for alg in costs.ALLTOALLS}
    assert min(timed, key=timed.__getitem__) == cheaper
    assert simulated.alltoall_time(f, nbytes) == min(timed.values())
    assert simulated.call_time(f, ("alltoall", nbytes), None) == min(timed.values())


class Recording(Counting):
    """``Counting`` that also keeps the descriptions the collectives begin with."""

    def __init__(self, comm):
        super().__init__(comm)
        self.begun: list[str] = []

    def begin(self, description, check=True):
        self.begun.append(description)
        self._comm.begin(description, check)


def through(front: str, comm, k: int, topo: Topology):
    """The compressors' Comm over ``comm``'s first ``k`` ranks, as ``front`` builds it:
    ``ViewComm`` (inside a tiered reduction) or ``WorldComm`` (the World's ranks), on a
    ``Recording`` of what it sends; returns (that Comm, the recording)."""
    recording = Recording(comm.view(list(range(k))) if front == "view" else comm)
    config = SimpleNamespace(chunk_bytes=1 << 20, check_collectives=True)
    if front == "view":
        return ViewComm(recording, config, topo), recording
    world = SimpleNamespace(rank=comm.rank, size=k, comm=recording, topology=topo,
                            config=config)
    return WorldComm(world, "test"), recording


# Five hosts (odd: Bruck's steps move 2, 2 and 1 blocks): far apart with tiny blocks, Bruck's 3
# latencies beat the pairwise exchange's 4; close by with 64 KiB blocks, the pairwise
# exchange's one pass over the link beats Bruck's 5 blocks and copies.
CHOICES = {"far": ("10ms", "100GB/s", 16, "bruck", 3),
           "near": ("1us", "1GB/s", 64 << 10, "pairwise", 4)}


@pytest.mark.parametrize("front", ["view", "world"])
@pytest.mark.parametrize("links", sorted(CHOICES))
def test_compress_comms_choose_the_same_alltoall_on_every_rank(links, front):
    """``ViewComm`` (inside a tiered reduction) and ``WorldComm`` (the World's ranks): every
    rank, with its own topology, runs the algorithm the cost model picks on the ranks (told
    by its steps), and gets every rank's block for it; the World's description names it."""
    latency, bandwidth, block, want, steps = CHOICES[links]
    k = 5
    assert costs.cheapest_alltoall(RankFabric(hosts(k, latency, bandwidth), range(k)),
                                   k * block) == want

    def rank_fn(comm):
        r = comm.rank
        fronted, recording = through(front, comm, k, hosts(k, latency, bandwidth))
        send = torch.from_numpy(np.concatenate(
            [np.full(block, 16 * r + d, dtype=np.uint8) for d in range(k)]))
        got = fronted.alltoall(send)
        return got.numpy(), recording.steps, recording.begun

    for r, (got, taken, begun) in enumerate(run_ok(k, rank_fn)):
        assert got.tobytes() == np.repeat(16 * np.arange(k) + r, block).astype(np.uint8).tobytes()
        assert taken == steps, (r, taken)
        if front == "world":
            assert begun == [f"compressed alltoall 'test #1 alltoall' uint8[{k}x{block}] "
                             f"by {want}"]
