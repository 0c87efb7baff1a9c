"""Bruck's alltoall or the pairwise exchange: the cost model's choice.

The model's formulas against a fabric of fixed links (the numbers of ``costs.py``'s worked
example), and the choice on a job's ranks (``RankFabric``) and on Summit (``TierFabric``).
"""

from __future__ import annotations

import pytest

from gradsync.cluster.topology import Topology
from gradsync.collectives import costs
from gradsync.collectives.costs import RankFabric, bruck_alltoall, pairwise_alltoall
from gradsync.simulate import cluster as cluster_file
from gradsync.simulate.fabric import TierFabric


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
