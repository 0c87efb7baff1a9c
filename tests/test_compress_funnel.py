"""The funnel onto a unit's leader and back (collectives/funnel.py), as tiered PowerSGD runs it.

Ranks are threads over in-memory pairs (``test_algorithms.run_ranks``, with its deadline).
Inputs are random float32, where the summation order shows in the bits: the leader's sum
must be the documented order's, bit for bit, and every rank must end with the leader's bits.
Unit sizes 1 to 5 and element counts 0, 1, fewer than the ranks, uneven and many segments,
by each schedule, then through ``compress.comm.ViewComm``, which chooses one by the cost
model; and the model's step counts against the exchanges the library makes.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradsync.cluster.topology import Topology
from gradsync.collectives import funnel, ring
from gradsync.collectives.costs import RankFabric, cheapest
from gradsync.collectives.ops import Sum, make_reducer
from gradsync.compress.comm import SUB_ALLREDUCES, ViewComm
from gradsync.simulate import compression as simulated
from test_algorithms import COUNTS, Counting, element_count, run_ok

CHUNK = 64  # bytes per segment: 16 float32, so the "multi" count spans many segments
SUM32 = make_reducer(Sum, np.float32)


def inputs(k: int, count: int) -> list[np.ndarray]:
    return [np.random.default_rng(10 * k + r).standard_normal(count).astype(np.float32)
            for r in range(k)]


def chain_sum(xs: list[np.ndarray]) -> np.ndarray:
    """(((x_1 + x_2) + x_3) + .. + x_{k-1}) + x_0 (funnel.py, "Summation order")."""
    if len(xs) == 1:
        return xs[0].copy()
    total = xs[1].copy()
    for x in xs[2:] + xs[:1]:
        total = total + x
    return total


def tree_sum(xs: list[np.ndarray]) -> np.ndarray:
    """The binomial pairing: ((x_0 + x_1) + (x_2 + x_3)) + x_4 for five."""
    partial = [x.copy() for x in xs]
    mask = 1
    while mask < len(xs):
        for v in range(0, len(xs), 2 * mask):
            if v + mask < len(xs):
                partial[v] = partial[v] + partial[v + mask]
        mask *= 2
    return partial[0]


def split_sum(xs: list[np.ndarray]) -> np.ndarray:
    """Block b (``ring.even_counts``) in the ring's order, ((x_{b+1} + x_{b+2}) + ..) + x_b."""
    k, numel = len(xs), len(xs[0])
    offsets = ring.block_offsets(ring.even_counts(numel, k), k, numel)
    out = np.empty_like(xs[0])
    for b in range(k):
        lo, hi = offsets[b], offsets[b + 1]
        order = [(b + 1 + i) % k for i in range(k)]
        total = xs[order[0]][lo:hi].copy()
        for r in order[1:]:
            total = total + xs[r][lo:hi]
        out[lo:hi] = total
    return out


ORDER = {"chain": chain_sum, "tree": tree_sum, "split": split_sum}


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("how", funnel.SCHEDULES)
def test_the_leader_gets_the_sum_in_its_order_and_every_rank_its_bits(how, k, count):
    xs = inputs(k, element_count(count, k))

    def rank_fn(comm):
        data = xs[comm.rank].copy()
        funnel.reduce(comm, data, SUM32, CHUNK, how)
        summed = data.copy()
        funnel.broadcast(comm, data, CHUNK, how)
        return summed, data

    results = run_ok(k, rank_fn)
    want = ORDER[how](xs)
    assert results[0][0].tobytes() == want.tobytes()
    for rank, (_, data) in enumerate(results):
        assert data.tobytes() == want.tobytes(), rank


class Steps:
    """A fabric whose every step costs 1 and whose folds are free: the model's formulas then
    count steps."""

    reduce_bandwidth = float("inf")

    def __init__(self, n: int):
        self.n = n

    def ring_step(self, nbytes: float) -> float:
        return 1.0


@pytest.mark.parametrize("count", [1, 40, 16 * 7 + 3])  # one segment, a few, many
@pytest.mark.parametrize("k", [2, 3, 5, 6])
@pytest.mark.parametrize("how", funnel.SCHEDULES)
def test_the_model_counts_the_steps_the_library_takes(how, k, count):
    """``reduce_time`` and ``broadcast_time`` with unit steps are the most exchanges any rank
    makes: S + k - 2 for the chain, ceil(log2 k) for the tree, (k - 1) S_b + ceil(log2 k) for
    the split (what ``gradsync simulate`` times, ``simulate/compression.funnel_time``)."""
    xs = inputs(k, count)

    def rank_fn(comm):
        counting = Counting(comm)
        data = xs[comm.rank].copy()
        funnel.reduce(counting, data, SUM32, CHUNK, how)
        down = counting.steps
        funnel.broadcast(counting, data, CHUNK, how)
        return down, counting.steps - down

    results = run_ok(k, rank_fn)
    f = Steps(k)
    assert max(r[0] for r in results) == funnel.reduce_time(how, f, 4 * count, CHUNK)
    assert max(r[1] for r in results) == funnel.broadcast_time(how, f, 4 * count, CHUNK)
    if how == "tree":
        assert max(max(r) for r in results) == (k - 1).bit_length()


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("how", funnel.SCHEDULES)
def test_the_model_counts_the_bytes_the_library_sends(how, k):
    """``mean_sent`` is the bytes the ranks send there and back, averaged (60 elements: the
    split's blocks equal for every k here)."""
    xs = inputs(k, 60)

    def rank_fn(comm):
        counting = Counting(comm)
        data = xs[comm.rank].copy()
        funnel.reduce(counting, data, SUM32, CHUNK, how)
        funnel.broadcast(counting, data, CHUNK, how)
        return counting.sent

    assert sum(run_ok(k, rank_fn)) / k == pytest.approx(funnel.mean_sent(how, k, 240))


def view_comms(k: int, chunk_bytes: int, hosts: str, spec=None):
    """(topology, ``make(comm)`` -> a ViewComm of all k ranks placed on ``hosts``, one letter
    a rank; ``spec``: a topology file's tiers)."""
    topo = Topology.from_hosts(list(hosts), spec)
    config = SimpleNamespace(chunk_bytes=chunk_bytes, small_bytes=64 << 10)
    return topo, lambda comm, view=None: ViewComm(view or comm.view(list(range(k))), config,
                                                  topo)


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("chunk_bytes", [CHUNK, 1 << 20], ids=["segments", "whole"])
def test_view_comm_funnels_by_the_schedule_the_model_chooses(chunk_bytes, k, count):
    """Through the tiered reduction's Comm: the sum of every rank in the order of the schedule
    the cost model picks on the view's ranks (the same on each), the leader's bits on all."""
    numel = element_count(count, k)
    xs = inputs(k, numel)
    topo, make = view_comms(k, chunk_bytes, "abcde"[:k])
    how = funnel.schedule(RankFabric(topo, range(k)), 4 * numel, chunk_bytes)

    def rank_fn(comm):
        view = make(comm)
        t = torch.from_numpy(xs[comm.rank].copy())
        view.reduce_to_leader_(t)
        view.broadcast_from_leader_(t)
        return view.schedule_of(4 * numel), t.numpy()

    results = run_ok(k, rank_fn)
    want = ORDER[how](xs)
    for chosen, data in results:
        assert chosen == how
        assert data.tobytes() == want.tobytes()


def test_the_model_sends_small_buckets_by_the_tree_mid_sized_split_and_large_by_the_chain():
    """Five hosts (the default tiers: 1.25 GB/s, 50 us). 4 KiB: latency decides, and the
    tree's 3 rounds each way beat the chain's 4 steps and the split's 4 + 3. 1 MiB: the
    split moves about twice the bucket each way against the tree's 3 times and the chain's
    4 steps of the whole of it (one segment). 100 MiB: the chain's pipeline is full, and
    it moves the bucket once each way."""
    topo, _ = view_comms(5, 1 << 20, "abcde")
    f = RankFabric(topo, range(5))
    assert funnel.schedule(f, 4 << 10, 1 << 20) == "tree"
    assert funnel.schedule(f, 1 << 20, 1 << 20) == "split"
    assert funnel.schedule(f, 100 << 20, 1 << 20) == "chain"
    # Two ranks: one hop either way, and the chain keeps its segments.
    assert funnel.schedule(RankFabric(topo, range(2)), 256 << 10, 1 << 20) == "chain"
    with pytest.raises(ValueError, match="funnel schedule"):
        funnel.reduce(None, np.ones(3, np.float32), SUM32, CHUNK, "star")


# Per case: the hosts' links and the algorithm the cost model must pick. Four hosts far
# apart: latency decides, recursive doubling's 2 rounds against halving-doubling's 4 and the
# ring's 6 steps. Three hosts close on slow links: bandwidth decides, and the ring's 2 x 2/3
# of the bucket beats what the other two pay for the rank beyond a power of two (the whole
# bucket in and out).
LINKS = {"far": (4, {"host": {"bandwidth": "100GB/s", "latency": "10ms"}}, "doubling", 2),
         "near": (3, {"host": {"bandwidth": "1GB/s", "latency": "1us"}}, "ring", 4)}


@pytest.mark.parametrize("links", sorted(LINKS))
def test_view_comm_allreduces_by_the_cost_model(links):
    """A tiered sub-group's allreduce of 256 KiB runs the algorithm the cost model picks on
    its ranks (a size rule ran the ring from 64 KiB on, whatever the links), told by its
    exchanges; the sum is exact (integers) and the same on every rank. The simulator times
    the same candidates (``simulate/compression.SUB_ALLREDUCES``)."""
    k, tiers, want, steps = LINKS[links]
    numel = 64 << 10
    topo, make = view_comms(k, 1 << 20, "abcd"[:k], {"tiers": tiers})
    assert cheapest(RankFabric(topo, range(k)), 4 * numel, SUB_ALLREDUCES) == want

    def rank_fn(comm):
        counting = Counting(comm.view(list(range(k))))
        t = torch.arange(numel, dtype=torch.float32) % 7 * (comm.rank + 1)
        make(comm, counting).allreduce_sum_(t)
        return counting.steps, t

    results = run_ok(k, rank_fn)
    exact = torch.arange(numel, dtype=torch.float32) % 7 * sum(range(1, k + 1))
    for taken, t in results:
        assert taken == steps
        assert torch.equal(t, exact)
    assert simulated.SUB_ALLREDUCES == SUB_ALLREDUCES
