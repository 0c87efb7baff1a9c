"""Compression on the slow tier only (gradsync/compress/tiers.py), on emulated hosts of threads.

The ranks are threads (``run_threads``, with its deadline); ``Net`` places them on hosts
(and groups of hosts) through a ``Topology``, as the World places real ranks, and every
collective of every sub-group is an exchange through shared slots that tallies, per tier,
the bytes its members send and their dtypes. The tier of a sub-group's traffic is the
slowest tier between two of its members. The front doors on real processes (shared memory
inside an emulated host, TCP between hosts) are tests/ranks/compress_tiers.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gradsync.cluster.topology import TIERS, Topology
from gradsync.compress import FP8, Int8, PowerSGD, RandomK
from gradsync.compress.comm import Comm
from gradsync.compress.tiers import subgroups
from test_compress import ThreadGroup, run_threads


class Net:
    """Threads placed on hosts: ``layout[r]`` is rank r's host; ``groups`` maps host names
    to group names (racks)."""

    def __init__(self, layout: str, groups: dict[str, str] | None = None):
        spec = None
        if groups:
            by: dict[str, list[str]] = {}
            for host, g in groups.items():
                by.setdefault(g, []).append(host)
            spec = {"groups": by}
        self.topo = Topology.from_hosts(list(layout), spec)
        self.size = len(layout)
        self.lock = threading.Lock()
        self.groups: dict[tuple, ThreadGroup] = {}
        self.bytes = dict.fromkeys(TIERS, 0)
        self.dtypes: dict[str, set] = {t: set() for t in TIERS}
        self.begun = [0] * self.size
        self.used: set[tuple] = set()  # every sub-group a collective ran in
        self.all = ThreadGroup(self.size)

    def group(self, members: tuple) -> ThreadGroup:
        with self.lock:
            if members not in self.groups:
                self.groups[members] = ThreadGroup(len(members))
            return self.groups[members]

    def tier(self, members) -> str:
        return max((self.topo.tier(a, b) for a in members for b in members),
                   key=TIERS.index, default="local")

    def abort(self) -> None:
        with self.lock:
            for g in list(self.groups.values()) + [self.all]:
                g.barrier.abort()

    def comm(self, rank: int) -> "NetComm":
        return NetComm(self, tuple(range(self.size)), rank)


class NetComm(Comm):
    """The Comm of ``members`` (global ranks) seen by member ``index``. The funnel onto a
    unit's leader and back is ``Comm``'s: one non-empty block through ``reduce_scatter_sum_``
    and ``gather_blocks_`` (the schedules of a World's are tests/test_compress_funnel.py)."""

    def __init__(self, net: Net, members: tuple, index: int):
        self.net, self.members = net, members
        self.rank, self.size = index, len(members)
        self.grp = net.all if len(members) == net.size else net.group(members)
        self.tier = net.tier(members)

    def _exchange(self, t: torch.Tensor, sent_elements: int) -> list[torch.Tensor]:
        g, net = self.grp, self.net
        with net.lock:
            net.bytes[self.tier] += sent_elements * t.element_size()
            if sent_elements:
                net.dtypes[self.tier].add(t.dtype)
        g.slots[self.rank] = t.clone()
        g.barrier.wait()
        got = list(g.slots)
        g.barrier.wait()
        return got

    # the three collectives of the flat schedule
    def allreduce_sum_(self, t):
        n = self.size
        got = self._exchange(t, 2 * (n - 1) * t.numel() // n)
        total = got[0].clone()
        for other in got[1:]:
            total += other
        t.copy_(total)

    def alltoall(self, send):
        block = send.numel() // self.size
        got = self._exchange(send, send.numel() - block)
        return torch.cat([got[s][self.rank * block:(self.rank + 1) * block]
                          for s in range(self.size)])

    def allgather(self, mine):
        return torch.cat(self._exchange(mine, (self.size - 1) * mine.numel()))

    # tiers
    def placement(self):
        return self.net.topo if len(self.members) == self.net.size else None

    def begin_tiered(self, description):
        self.net.begun[self.members[self.rank]] += 1

    def sub(self, ranks):
        with self.net.lock:
            self.net.used.add(tuple(self.members[r] for r in ranks))
        return NetComm(self.net, tuple(self.members[r] for r in ranks), ranks.index(self.rank))

    def _bounds(self, counts):
        lo = sum(counts[:self.rank])
        return lo, lo + counts[self.rank]

    def reduce_scatter_sum_(self, t, counts):
        assert t.dtype == torch.float32
        got = self._exchange(t, t.numel() - counts[self.rank])
        lo, hi = self._bounds(counts)
        total = got[0][lo:hi].clone()
        for other in got[1:]:  # member order, float32: what a test can repeat
            total += other[lo:hi]
        t[lo:hi] = total

    def gather_blocks_(self, t, counts):
        assert t.dtype == torch.float32
        got = self._exchange(t, (self.size - 1) * counts[self.rank])
        at = 0
        for j, c in enumerate(counts):
            t[at:at + c] = got[j][at:at + c]
            at += c


def run_net(net: Net, fn) -> list:
    return run_threads(net.size, lambda r: fn(net.comm(r)), net.abort)


LAYOUTS = {
    "2x2": ("aabb", None),
    "uneven": ("aaabbc", None),
    "racks": ("aabbccdd", {"a": "r0", "b": "r0", "c": "r1", "d": "r1"}),
}


def host_sums(net: Net, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each host's float32 sum of its ranks' tensors, in rank order (as NetComm sums)."""
    out = []
    for h in range(len(net.topo.hosts)):
        ranks = [r for r in range(net.size) if net.topo.host_of[r] == h]
        total = inputs[ranks[0]].clone()
        for r in ranks[1:]:
            total += inputs[r]
        out.append(total)
    return out


def cancelling(net: Net, numel: int, step: int = 0) -> list[torch.Tensor]:
    """Per rank: a small gradient, plus +-1000 v that cancels between pairs of ranks of a
    host (local ranks 2i and 2i+1). Quantizing each rank alone loses about 1000/254 on every
    element; quantizing each host's sum loses only about its own size/254."""
    out = []
    for r in range(net.size):
        h = net.topo.host_of[r]
        local = [q for q in range(net.size) if net.topo.host_of[q] == h]
        j = local.index(r)
        g = torch.randn(numel, generator=torch.Generator().manual_seed(100 * step + r))
        if j ^ 1 < len(local):
            v = torch.randn(numel, generator=torch.Generator().manual_seed(7 + h + 1000 * (j // 2)))
            g = g + (1000.0 if j % 2 == 0 else -1000.0) * v
        out.append(g)
    return out


# ----------------------------------------------------------------------------- (a) results
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("codec, qmax", [(Int8, 127.0), (FP8, 8.0)])
def test_result_is_full_precision_host_sums_quantized_between_hosts(layout, codec, qmax):
    """Result = sum over hosts of (each host's float32 sum), within one rounding of each
    host's sum plus the owner's rounding of the total; the same on every rank. Quantizing
    every rank instead misses by about 1000/qmax on these inputs (the cancelling part)."""
    net = Net(*LAYOUTS[layout])
    numel = 301
    inputs = cancelling(net, numel)
    results = run_net(net, lambda comm: codec(block=16).reduce(
        inputs[comm.members[comm.rank]], [(numel,)], comm, None, average=False))
    sums = host_sums(net, inputs)
    exact = torch.stack([s.double() for s in sums]).sum(0)
    # Each host's sum rounded once (half a step of its scale, max|sum| / qmax), then the
    # owner's total rounded once more.
    first = sum(float(s.abs().max()) for s in sums) / (2 * qmax)
    bound = first + (float(exact.abs().max()) + first) / (2 * qmax)
    for r in results:
        assert torch.equal(r, results[0])
    err = float((results[0].double() - exact).abs().max())
    assert err <= bound + 1e-4, (err, bound)
    assert all(n == 1 for n in net.begun)  # one tiered reduction, begun once on every rank


def test_powersgd_runs_between_host_leaders_on_host_sums():
    """PowerSGD is not element-wise: each host's float32 sum is reduced onto its first rank,
    the leaders run PowerSGD among themselves, and the host gets the leader's result. So the
    result equals PowerSGD over the hosts with their sums as inputs (a reference run on a
    group of one thread per host)."""
    net = Net("aaabb")
    shapes = [(8, 6), (5,)]
    inputs = [torch.randn(53, generator=torch.Generator().manual_seed(r)) for r in range(5)]
    # No key: the first Q is seeded by the key, and both runs must start from the same one.
    got = run_net(net, lambda comm: PowerSGD(rank=2, min_compression_rate=1.0).reduce(
        inputs[comm.members[comm.rank]], shapes, comm, None, average=True))
    sums = host_sums(net, inputs)
    hosts = Net("ab")  # one rank per host: nothing to split, the flat schedule
    want = run_net(hosts, lambda comm: PowerSGD(rank=2, min_compression_rate=1.0).reduce(
        sums[comm.rank], shapes, comm, None, average=False))
    for r in got:
        assert torch.equal(r, got[0])
    assert torch.allclose(got[0], want[0] / 5, atol=1e-6)
    # (Given Q, PowerSGD is linear: run by every rank it would give the same numbers. What
    # tells the schedules apart is who sends what.) Between hosts, only the 2 leaders'
    # allreduces: the bias (5) with P (8 x 2), then Q (6 x 2), each member sending 2 (m-1)/m.
    leaders = 2
    assert net.bytes["host"] == 4 * sum(leaders * (2 * (leaders - 1) * n // leaders)
                                        for n in (5 + 8 * 2, 6 * 2))
    # Inside hosts, the whole float32 sum onto the leader and back: 2 (k - 1) 53 floats.
    assert net.bytes["local"] == 4 * (2 * 2 * 53 + 2 * 1 * 53)
    assert net.dtypes == {"local": {torch.float32}, "host": {torch.float32}, "group": set()}


# ----------------------------------------------------------------------------- (b) bytes
def int8_wire_bytes(numel: int, members: int, block: int) -> int:
    """What the members of one flat int8 reduction of ``numel`` elements send together: an
    alltoall and an allgather of (4 bytes of scale per block + 1 byte per element) chunks."""
    if numel == 0:
        return 0
    per_block, blocks = Int8(block=block).layout(numel, members)
    piece = 4 * blocks + per_block * blocks
    return members * 2 * (members - 1) * piece


# Per layout, for 1000 elements: the slowest tier, the size of each piece that crosses it
# (one per block: m = ranks on the largest host, then again m' = hosts of the largest group),
# the members of each crossing (one per host, or per group), and the float32 bytes inside
# hosts (per host of k ranks a reduce-scatter and a gather, each rank sending (k - 1)/k of
# the tensor: 2 (k - 1) 1000 floats) and between the hosts of a group.
BYTES = {
    "2x2": ("host", [500, 500], 2, 2 * (2 * 1 * 1000 * 4), 0),
    "uneven": ("host", [334, 333, 333], 3, (2 * 2 + 2 * 1) * 1000 * 4, 0),
    # 4 hosts of 2 ranks: blocks of 500; the 4 owners of a block are 2 groups of 2 hosts,
    # which reduce-scatter it in float32 (250 each) and compress 4 pieces of 250 between.
    "racks": ("group", [250] * 4, 2, 4 * (2 * 1 * 1000 * 4), 2 * 2 * (2 * 1 * 500 * 4)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_slow_tier_carries_one_compressed_copy_per_host(layout):
    """The slowest tier carries the int8 bytes of each block once per host (its owner's),
    nothing else; the faster tiers only float32, the full-width reduce-scatter and gather.
    With ``tiers="all"`` every rank's int8 crosses the slow tier instead."""
    slowest, pieces, members, local, host = BYTES[layout]
    numel, block = 1000, 32
    net = Net(*LAYOUTS[layout])
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r))
              for r in range(net.size)]
    run_net(net, lambda comm: Int8(block=block).reduce(
        inputs[comm.members[comm.rank]], [(numel,)], comm, "b", average=True))
    assert net.bytes[slowest] == sum(int8_wire_bytes(n, members, block) for n in pieces)
    assert net.dtypes[slowest] == {torch.uint8}
    assert net.bytes["local"] == local and net.dtypes["local"] == {torch.float32}
    if slowest == "group":
        assert net.bytes["host"] == host and net.dtypes["host"] == {torch.float32}

    flat = Net(*LAYOUTS[layout])
    run_net(flat, lambda comm: Int8(block=block, tiers="all").reduce(
        inputs[comm.members[comm.rank]], [(numel,)], comm, "b", average=True))
    assert flat.dtypes[slowest] == {torch.uint8} and not flat.dtypes["local"]
    assert flat.bytes[slowest] == int8_wire_bytes(numel, flat.size, block)
    assert flat.bytes[slowest] > net.bytes[slowest]


# ----------------------------------------------------------------------------- (c) feedback
def grads(rank: int, step: int, numel: int) -> torch.Tensor:
    steady = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    noise = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank + 1))
    return steady + 0.5 * noise


@pytest.mark.parametrize("make", [lambda: Int8(block=16), lambda: RandomK(0.1, seed=3),
                                  lambda: PowerSGD(rank=1, min_compression_rate=1.0)],
                         ids=["int8", "randomk", "powersgd"])
@pytest.mark.parametrize("layout", ["uneven", "racks"])
def test_error_feedback_on_the_owners_makes_the_running_sum_converge(make, layout):
    """Over steps, the sum of the results follows the sum of every rank's gradients: the
    relative gap shrinks (error feedback, kept by the ranks that compress); the residuals
    are in the compressor's state under the tiered keys, on the ranks that own blocks."""
    net = Net(*LAYOUTS[layout])
    numel, steps, shapes = 96, 60, [(12, 8)]

    def given(step):
        return sum(grads(r, s, numel).double() for r in range(net.size)
                   for s in range(step + 1))

    def job(comm):
        c = make()
        sent = torch.zeros(numel, dtype=torch.float64)
        gaps = []
        for step in range(steps):
            g = grads(comm.members[comm.rank], step, numel)
            sent += c.reduce(g, shapes, comm, "bucket0", average=False).double()
            if step + 1 in (10, steps):
                gaps.append(float((sent - given(step)).norm() / given(step).norm()))
        return sent, c, gaps

    results = run_net(net, job)
    for sent, _, _ in results:
        assert torch.equal(sent, results[0][0])
    # With error feedback the gap is what the residuals hold, bounded: it shrinks like 1/T
    # (by 3.6 to 5.9 here from step 10 to 60; the runs are deterministic). Without it, int8's
    # roundings add up like sqrt(T) (2.2 to 2.4) and random-k's unsent part like T (1).
    early, late = results[0][2]
    assert late < early / 3 and late < 0.25, (early, late)
    keys = [set(c.state.tensors) for _, c, _ in results]
    assert all(all(k.startswith("bucket0@") for k in ks) for ks in keys), keys
    assert any(keys)


def test_tiered_residuals_are_the_compressors_state():
    """A run restored from ``state_dict`` continues bit for bit: the owners' residuals are
    all the state there is."""
    net = Net("aabbb")
    numel = 77

    def job(comm):
        me = comm.members[comm.rank]
        c = Int8(block=8)
        for step in range(3):
            c.reduce(grads(me, step, numel), [(numel,)], comm, "k", average=True)
        saved = c.state_dict()
        going_on = c.reduce(grads(me, 3, numel), [(numel,)], comm, "k", average=True)
        fresh = Int8(block=8)
        fresh.load_state_dict(saved)
        restored = fresh.reduce(grads(me, 3, numel), [(numel,)], comm, "k", average=True)
        return going_on, restored, saved

    for going_on, restored, saved in run_net(net, job):
        assert torch.equal(going_on, restored)
        held = saved["state"]["tensors"]
        assert held and all("@" in key for key in held), list(held)  # the owners' blocks
        assert any(t.abs().sum() > 0 for ts in held.values() for t in ts.values())


def test_tiers_option_is_checked_and_part_of_the_description():
    with pytest.raises(ValueError, match="tiers"):
        Int8(tiers="host")
    assert Int8(tiers="all").describe() != Int8().describe()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("make", [lambda: Int8(block=8),
                                  lambda: PowerSGD(rank=1, min_compression_rate=1.0)],
                         ids=["int8", "powersgd"])
def test_subgroups_lists_every_group_the_reduction_uses(layout, make):
    """``subgroups`` (what a DDP hook's ranks make ahead, all of them, in one order) is
    exactly the set of groups that the ranks' collectives run in."""
    net = Net(*LAYOUTS[layout])
    run_net(net, lambda comm: make().reduce(torch.ones(40), [(5, 8)], comm, "k", True))
    listed = subgroups(net.topo, make().shardable)
    assert len(listed) == len(set(map(tuple, listed)))
    assert net.used == set(map(tuple, listed))
