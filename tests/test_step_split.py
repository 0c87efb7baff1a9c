"""Where a step's time and bytes go (issue 41): waits for data apart from compute, DDP's wait
inside torch's reducer, bytes per tier from the transports' counters, and ``gradsync bench
train --overhead`` (tested in tests/test_bench_train.py, within its FSDP comparison's run).

In one process: the meter and four ranks' publishers over an in-memory store on an injected
clock (as tests/test_stragglers.py does), the data loaders' hooks, torch's autograd engine
running a backward pass whose "bucket" completes on another thread, and real shared-memory
and TCP pairs of a rank with a peer on its host and one on another. The real jobs (a rank
slow for its data, a slowed rank of a DDP job) are in tests/test_stragglers.py.
"""

import logging
import os
import threading
import time
import types
import uuid

import numpy as np

from gradsync.liveness.pace import BACKWARD, Meter, metered, waiting_for_data
from gradsync.run import top
from test_stragglers import _publishers

MS = 1_000_000


class Clock:
    def __init__(self):
        self.ns = 0

    def __call__(self):
        return self.ns


def _busy(ns: int) -> None:
    """Takes ``ns`` of wall time (a batch that takes that long to come)."""
    end = time.monotonic_ns() + ns
    while time.monotonic_ns() < end:
        pass


# ----------------------------------------------------------------------------- data
def test_the_meter_takes_waits_for_data_out_of_compute():
    clock = Clock()
    meter = Meter(clock)
    meter.reset(0)
    meter.timeline = types.SimpleNamespace(marks=[])
    meter.timeline.instant = lambda name, what, args=None: meter.timeline.marks.append(args)
    for begin, end in ((0, 10 * MS), (5 * MS, 15 * MS), (20 * MS, 30 * MS)):  # 25 ms, once
        meter.waited_for_data(begin, end)
    meter.blocked(30 * MS, 33 * MS)
    clock.ns = 100 * MS
    meter.mark_step()
    (step,) = meter.steps
    assert (step[2], step[3], step[5]) == (100 * MS, 3 * MS, 25 * MS)
    assert meter.timeline.marks == [{"step": 1, "compute_ms": 72.0, "data_ms": 25.0,
                                     "blocked_ms": 3.0}]


def test_metered_and_waiting_for_data_time_the_fetch_alone():
    # On the meter's own clock (injected): each fetch takes 4 ms, the loop's own work on each
    # batch 30 ms. (Timed on the wall clock, a fetch descheduled for 80 ms on the loaded
    # machine once outweighed the loop's 90 ms, 2026-11-30.)
    clock = Clock()
    meter = Meter(clock)
    meter.reset(0)

    def slow_batches():
        for i in range(3):
            clock.ns += 4 * MS
            yield i
        clock.ns += 1 * MS  # the fetch that finds the end

    for _ in metered(slow_batches(), meter):
        clock.ns += 30 * MS  # the loop's own work on the batch: not data
    # Three fetches of 4 ms and the last one of 1 ms, and none of the loop's own time.
    assert meter.data_ns == 13 * MS
    with waiting_for_data(meter):
        clock.ns += 5 * MS
    assert meter.data_ns == 18 * MS


def test_the_loaders_next_reports_its_wait_for_a_batch():
    """gradsync.data.Loader's epoch iterator reports how long the loop's ``next()`` waited
    (here a batch that takes 20 ms to come, polled inline as from a same-host server)."""
    from gradsync.data.epoch import Epoch
    from gradsync.liveness.pace import meter

    def items():
        _busy(20 * MS)
        yield types.SimpleNamespace(ids=np.arange(2)), b"batch"

    run = object.__new__(Epoch)
    run.loader = types.SimpleNamespace(collate=None, layout=types.SimpleNamespace(
        unpack=lambda buf, n: (buf, n)))
    run.in_hand, run.delivered, run._held, run._failed = None, [], None, None
    run._queue, run._items = None, items()
    before = meter.data_ns
    assert next(run) == (b"batch", 2)
    assert meter.data_ns - before >= 20 * MS


def test_a_rank_slow_for_its_data_is_named_with_its_time_under_data(caplog):
    """Rank 2 waits 30 ms for each batch before 100 ms of compute: it is late by 30 ms, as a
    rank slowed in compute would be, and its warning, its numbers and top say data 30 ms,
    compute 100 ms."""
    base, clock, meters, publishers = _publishers()

    def steps(data_ms, count):
        for n in range(count):
            start = clock.ns
            arrivals = [start + (d + 100) * MS for d in data_ms]
            clock.ns = max(arrivals) + 2 * MS  # then all meet in a collective of 2 ms
            for meter, d, arrived in zip(meters, data_ms, arrivals):
                meter.waited_for_data(start, start + d * MS)
                meter.blocked(arrived, clock.ns)
                meter.mark_step()
            if n % 5 == 4:
                for p in publishers[1:] + publishers[:1]:
                    p.round()

    with caplog.at_level(logging.WARNING, logger="gradsync"):
        steps([0, 0, 0, 0], 10)
        steps([0, 0, 30, 0], 20)
    report = publishers[0].report
    assert [p.rank for p in report.named] == [2], report
    (slow,) = report.named
    assert (slow.compute_ms, slow.data_ms, slow.wait_ms, slow.comm_ms) == (100, 30, 0, 2)
    (warning,) = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert "compute 100.0 ms, data 30.0 ms, waiting 0.0 ms, communication 2.0 ms" in warning
    current, posts, verdict = top.read(base)
    lines = top.table(current, posts, verdict).splitlines()
    names = lines[1].split()  # ("step ms" is two words)
    assert names[7:11] == ["compute", "data", "wait", "comm"], lines
    assert [row.split()[6:8] for row in lines[2:]] == [["100.0", "0.0"]] * 2 + [
        ["100.0", "30.0"], ["100.0", "0.0"]], lines


# ----------------------------------------------------------------------------- DDP's wait
def test_a_backward_pass_that_issues_collectives_reports_its_final_wait_and_marks_a_step():
    """As DDP does: a gradient hook launches a "bucket" (here completed by another thread)
    and queues the reducer's finalize, which waits for it in the engine's final callbacks.
    The wait is blocked time from the end of the backward pass to the bucket's completion,
    and each such backward pass is a step."""
    import torch

    from gradsync.liveness.pace import meter
    from gradsync.torch.backend.backward import backward

    meter.reset(0)
    try:
        for step in (1, 2):
            finalizing, done = threading.Event(), threading.Event()

            def complete():  # the bucket's allreduce: done once the finalize waits for it
                finalizing.wait(10)
                backward.done_ns = time.monotonic_ns()
                done.set()

            def finalize():  # the reducer's finalize: waits in C++ where Python sees nothing
                finalizing.set()
                done.wait(10)

            def hook(grad):
                backward.issued()  # what the group's collective does when DDP calls it
                threading.Thread(target=complete, daemon=True).start()
                torch.autograd.Variable._execution_engine.queue_callback(finalize)
                return grad

            w = torch.ones(3, requires_grad=True)
            w.register_hook(hook)
            before = meter.blocked_ns
            (w * 2).sum().backward()
            assert done.is_set()
            waited = backward.done_ns - backward._began
            assert waited > 0 and meter.blocked_ns - before == waited
            assert meter.level == BACKWARD and meter.step == step
            assert meter.steps[-1][3] == waited
        # Outside a backward pass a collective queues nothing (a plain dist.all_reduce).
        backward.issued()
        assert backward.task == -1
    finally:
        meter.reset(0, on=False)


def test_marks_of_the_user_win_over_backward_passes_and_those_over_operations():
    meter = Meter(Clock())
    meter.reset(2)
    for _ in range(4):
        meter.op_done()
    assert meter.step == 2 and meter.level == 0
    meter.mark_step(BACKWARD)  # steps numbered from 1 again
    meter.mark_step(BACKWARD)
    assert meter.step == 2 and meter.level == BACKWARD
    meter.mark_step()
    meter.mark_step(BACKWARD)  # ignored from now on
    meter.op_done()
    assert meter.step == 1 and meter.explicit


# ----------------------------------------------------------------------------- bytes per tier
def _tcp_pair():
    from gradsync.transport.tcp import Listener, TcpPair, connect

    listener = Listener("127.0.0.1", 0, b"s" * 32, "job", {1})
    theirs = connect("127.0.0.1", listener.port, 1, 0, b"s" * 32, "job", time.monotonic() + 5)
    mine = listener.wait_for({1}, time.monotonic() + 5)[1]
    return listener, TcpPair(2, mine), TcpPair(1, theirs)


def test_bytes_per_tier_come_from_the_transports_own_counters():
    """Rank 1 of three: rank 0 on its host (a shared-memory pair, and the host's segment),
    rank 2 on another (TCP). What each moved shows under its tier: local and host."""
    from gradsync.cluster.topology import Topology
    from gradsync.liveness.traffic import Traffic
    from gradsync.transport import frame
    from gradsync.transport.base import Expect, Recv, Send, wait_all
    from gradsync.transport.shm import ShmPair, attach_ring, create_ring, unlink_ring

    job = f"t{uuid.uuid4().hex[:10]}"
    a_in, b_in = create_ring(job, 0, 1, 1 << 16), create_ring(job, 1, 0, 1 << 16)
    a_out, b_out = attach_ring(job, 1, 0), attach_ring(job, 0, 1)
    unlink_ring(job, 0, 1)
    unlink_ring(job, 1, 0)
    to_0, at_0 = ShmPair(0, os.getpid(), a_in, a_out), ShmPair(1, os.getpid(), b_in, b_out)
    listener, to_2, at_2 = _tcp_pair()
    try:
        segment = types.SimpleNamespace(moved=0)
        world = types.SimpleNamespace(rank=1, topology=Topology.from_hosts(["a", "a", "b"]),
                                      comm=types.SimpleNamespace(pairs={0: to_0, 2: to_2}),
                                      host_traffic=lambda: (id(segment), segment.moved))
        clock = types.SimpleNamespace(t=0.0)
        traffic = Traffic(world, clock=lambda: clock.t)

        def move(sender, receiver, nbytes):
            data, out = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
            header = frame.pack(frame.Kind.DATA, 1, 0, 5, nbytes)
            wait_all([Send(sender, header, memoryview(data)),
                      Recv(receiver, Expect(1, 0, 5, lambda: "test"), memoryview(out))],
                     time.monotonic() + 10, lambda waited: None, lambda: "test frame")

        # The peer's kernel acknowledges the handshake's last bytes late (delayed ACK), with
        # its first data: a frame first, so that the baseline holds every handshake byte.
        move(at_2, to_2, 16)
        traffic.rates()  # the counts so far are the baseline

        move(to_0, at_0, 300_000)  # rank 1 sends to rank 0 through shared memory
        move(at_2, to_2, 1_000_000)  # rank 2 sends to rank 1 over TCP
        segment.moved += 50_000  # a collective of the host's segment
        clock.t = 2.0
        rates = traffic.rates()
        wire = frame.HEADER_SIZE
        assert rates == {"local": (300_000 + wire + 50_000) // 2,
                         "host": (1_000_000 + wire) // 2}, rates
        clock.t = 3.0
        assert traffic.rates() == {"local": 0, "host": 0}
    finally:
        for pair in (to_0, at_0, to_2, at_2):
            pair.close()
        listener.close()


def test_bytes_of_sub_worlds_count_with_their_roots_and_a_shared_segment_once():
    """The Horovod API's process sets run on sub-worlds (``World.subworld``), each with pairs
    and a shared segment of its own: their bytes are the rank's too (a real 2-rank job's
    DistributedOptimizer showed 0 MB/s on every tier while the root World alone was read)."""
    from gradsync.cluster.topology import Topology
    from gradsync.liveness.traffic import Traffic

    def stand_in(rank, hosts, pairs, group, subworlds=()):
        # World.host_traffic: the segment's key (the same in every World holding it), its bytes
        return types.SimpleNamespace(rank=rank, topology=Topology.from_hosts(hosts),
                                     comm=types.SimpleNamespace(pairs=pairs), group=group,
                                     host_traffic=lambda: (id(group), group.moved),
                                     subworlds=list(subworlds))

    shared = types.SimpleNamespace(moved=0)  # a segment both Worlds hold
    pair = types.SimpleNamespace(n=0, moved=lambda: pair.n)  # the sub-world's TCP pair
    nested = stand_in(0, ["a", "b"], {}, types.SimpleNamespace(moved=0))
    sub = stand_in(0, ["a", "b"], {1: pair}, shared, [nested])
    root = stand_in(1, ["a", "a", "b"], {}, shared, [sub])
    clock = types.SimpleNamespace(t=0.0)
    traffic = Traffic(root, clock=lambda: clock.t)
    traffic.rates()
    pair.n, shared.moved, nested.group.moved = 4_000, 2_000, 6_000
    clock.t = 2.0
    assert traffic.rates() == {"local": (2_000 + 6_000) // 2, "host": 4_000 // 2}


def test_top_shows_a_column_per_tier_and_the_group_tier_where_the_topology_has_one():
    from gradsync.cluster.topology import Topology
    from gradsync.liveness.traffic import Traffic

    grouped = Topology.from_hosts(["a", "b", "c"], {"groups": {"r0": ["a", "b"], "r1": ["c"]}})
    world = types.SimpleNamespace(rank=0, topology=grouped, comm=None,
                                  host_traffic=lambda: None)
    assert Traffic(world).tiers == ["local", "host", "group"]
    current = {"job": "job", "size": 2}
    posts = [{"rank": r, "host": f"host{r}", "generation": -1, "step": 1, "ops": 9,
              "bytes_s": 1_000_000, "steps": [[1, 100 * MS, 2 * MS, 0]], "last": None,
              "tiers": {"local": 3_000_000, "host": 500_000 * r, "group": 250_000}}
             for r in range(2)]
    lines = top.table(current, posts, {}).splitlines()
    assert lines[1].split()[11:18] == ["ops", "MB/s", "local", "MB/s", "host", "MB/s",
                                       "group"], lines  # ("step ms" is two words)
    assert [row.split()[10:14] for row in lines[2:]] == [
        ["1.00", "3.00", "0.00", "0.25"], ["1.00", "3.00", "0.50", "0.25"]], lines
