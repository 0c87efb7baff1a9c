"""The fusion stage on its own (gradsync/pipeline/fusion.py): how ready operations are cut into
batches (key, threshold, order), and a batch run by ranks as threads over in-memory pairs
(``transport.local``): one collective per batch, under the head's name, and every member's own
reduction unpacked into its own memory. The Horovod API's jobs (tests/test_negotiation.py)
run it through the controller."""

import collections
import threading
import types

import numpy as np
import pytest

from gradsync.collectives import planner
from gradsync.collectives.adasum import combine
from gradsync.config import load_config
from gradsync.pipeline.fusion import Fusion
from gradsync.pipeline.negotiation import Request
from gradsync.transport.local import local_comms


def allreduce(name: str, data, op: str = "SUM", scale=(1.0, 1.0), shared: bool = False,
              counts=None) -> Request:
    """A request of the negotiation, what the controller hands the stage."""
    flat = np.ascontiguousarray(data).reshape(-1)
    return Request(name, "allreduce", flat.dtype.name, flat.shape, op=op, scale=scale,
                   flat=flat, dtype_tag=flat.dtype, shared=shared, counts=counts)


def names(batches) -> list[list[str]]:
    return [[q.name for q in batch] for batch in batches]


def test_the_docstrings_example_cuts_by_key_and_threshold_in_order():
    stats = collections.Counter()
    fusion = Fusion(None, 64, stats)
    ready = [allreduce("a", np.zeros(4, np.float32)), allreduce("b", np.zeros(8, np.float32)),
             allreduce("c", np.zeros(2, np.int64)), allreduce("d", np.zeros(8, np.float32)),
             allreduce("e", np.zeros(20, np.float32))]  # e: 80 bytes, over the threshold alone
    assert names(fusion.batches(ready)) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert stats == {}  # cutting counts nothing; running a batch of several does


def test_only_allreduces_of_one_key_fuse_and_each_batch_keeps_their_order():
    f4 = lambda: np.zeros(4, np.float32)  # noqa: E731  (16 bytes)
    ready = [allreduce("s1", f4()),
             Request("bc", "broadcast", "float32", (4,), root=0, run=lambda w: None),
             allreduce("max", f4(), op="MAX"),
             allreduce("s2", f4()),
             allreduce("scaled", f4(), scale=(0.5, 1.0)),
             allreduce("post", f4(), scale=(1.0, 2.0)),
             allreduce("f64", np.zeros(2, np.float64)),
             allreduce("shm", f4(), shared=True),  # reduced in the host's buffer, where it is
             allreduce("s3", f4()),
             allreduce("max2", f4(), op="MAX"),
             allreduce("s4", f4())]
    assert names(Fusion(None, 48, collections.Counter()).batches(ready)) == [
        ["s1", "s2", "s3"],  # 48 bytes: a batch may fill the threshold exactly
        ["bc"], ["max", "max2"], ["scaled"], ["post"], ["f64"], ["shm"],
        ["s4"]]  # past the threshold: the next batch of the key, after the others' heads
    # A threshold of 0 fuses nothing (but tensors of no bytes, which cost nothing to fuse).
    assert names(Fusion(None, 0, collections.Counter()).batches(ready[:4])) == [
        ["s1"], ["bc"], ["max"], ["s2"]]


class Recording:
    """A Comm that records the description of each collective it begins."""

    def __init__(self, comm):
        self._comm = comm
        self.begun: list[str] = []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def begin_signed(self, description, signature):
        self.begun.append(description)
        self._comm.begin_signed(description, signature)


class Timeline:
    """What the stage writes to a timeline: ``(name, "B" or "E", phase, args)`` in order."""

    def __init__(self):
        self.events: list[tuple] = []

    def begin(self, name, phase, args=None):
        self.events.append((name, "B", phase, args))

    def end(self, name, phase=None):
        self.events.append((name, "E", phase, None))

    def phases(self, name) -> list[tuple]:
        return [(kind, phase, args) for n, kind, phase, args in self.events if n == name]


def on_ranks(n: int, work):
    """Runs ``work(rank, fusion, comm)`` on ``n`` ranks as threads, each with its World (what
    ``operations.allreduce`` reads of one, across hosts) and its stage (threshold 1 KiB);
    returns each rank's return value."""
    comms = [Recording(c) for c in local_comms(n, timeout=60.0)]
    config = load_config({}, environ={})
    results: list = [None] * n
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        world = types.SimpleNamespace(rank=r, size=n, comm=comms[r], config=config,
                                      plans=planner.Plans(n, config, False, None),
                                      descriptions={}, shares_host=False, hierarchical=False)
        try:
            results[r] = work(r, Fusion(world, 1024, collections.Counter()), comms[r])
        except BaseException as exc:  # noqa: BLE001  (raised again on the test's thread)
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def test_a_batch_is_one_collective_and_each_member_gets_its_own_reduction():
    n, sizes = 3, [5, 0, 7, 3]  # a tensor of no elements rides along too

    def work(r, fusion, comm):
        # Element i of tensor k on rank r: (r + 1) * (100 k + i) - distinct everywhere, so a
        # member unpacked from another member's offset gets another's sums.
        members = [allreduce(f"t{k}", (r + 1) * (100.0 * k + np.arange(size, dtype=np.float32)))
                   for k, size in enumerate(sizes)]
        ints = [allreduce("i0", np.array([-7 * (r + 1), 5], np.int64), op="AVERAGE"),
                allreduce("i1", np.array([r - 3], np.int64), op="AVERAGE")]
        timeline = Timeline()
        batches = fusion.batches(members + ints)
        assert names(batches) == [["t0", "t1", "t2", "t3"], ["i0", "i1"]]
        originals = [q.flat for q in members + ints]
        for batch in batches:
            fusion.run(batch, timeline)
        assert [q.flat for q in members + ints] == originals  # reduced in the callers' memory
        buffer = fusion._buffers[np.dtype(np.float32)]
        fusion.run(fusion.batches(members)[0], None)  # the next step: the same buffer
        assert fusion._buffers[np.dtype(np.float32)] is buffer
        single = allreduce("alone", np.full(3, r + 1.0, np.float32))
        fusion.run([single], timeline)
        return members, ints, single, timeline, fusion.stats, comm.begun

    for members, ints, single, timeline, stats, begun in on_ranks(n, work):
        # The sum over r of (r + 1) is 6; the second run summed 3 ranks' sums: 18.
        for k, q in enumerate(members):
            np.testing.assert_array_equal(q.flat, 18 * (100.0 * k + np.arange(sizes[k])))
        # Averages: -42 / 3, 15 / 3 and (-3 - 2 - 1) / 3 (their rounding is tested below).
        np.testing.assert_array_equal(ints[0].flat, [-14, 5])
        np.testing.assert_array_equal(ints[1].flat, [-2])
        np.testing.assert_array_equal(single.flat, [6.0, 6.0, 6.0])
        assert stats == {"fused_batches": 3, "fused_tensors": 10}
        # One collective per batch, named after its head and how many ride with it.
        assert len(begun) == 4, begun
        assert begun[0].startswith("allreduce 't0+3' float32[15] op=SUM "), begun
        assert begun[1].startswith("allreduce 'i0+1' int64[3] op=AVERAGE "), begun
        assert begun[3].startswith("allreduce 'alone' float32[3] op=SUM "), begun
        # Horovod's phases on each member's row; a batch of one only reduces.
        fused = {"fused": 4, "bytes": 60}
        assert timeline.phases("t2") == [
            ("B", "MEMCPY_IN_FUSION_BUFFER", None), ("E", "MEMCPY_IN_FUSION_BUFFER", None),
            ("B", "ALLREDUCE", fused), ("E", "ALLREDUCE", None),
            ("B", "MEMCPY_OUT_FUSION_BUFFER", None), ("E", "MEMCPY_OUT_FUSION_BUFFER", None)]
        assert timeline.phases("alone") == [("B", "ALLREDUCE", {"fused": 1, "bytes": 12}),
                                            ("E", "ALLREDUCE", None)]


def test_an_integer_average_of_a_batch_rounds_toward_zero():
    def work(r, fusion, comm):
        batch = [allreduce("x", np.array([[-1, -2, -4][r]], np.int64), op="AVERAGE"),
                 allreduce("y", np.array([1, 2], np.int64), op="AVERAGE")]
        fusion.run(batch, None)
        return [q.flat.tolist() for q in batch]

    # -7 / 3 is -2 toward zero (-3 rounded down); 3 / 3 and 6 / 3 are exact.
    assert on_ranks(3, work) == [[[-2], [1, 2]]] * 3


@pytest.mark.parametrize("fused", [False, True])
def test_adasum_gives_each_member_its_own_dot_products(fused):
    # Rank 0 holds a = (1, 0) and b = (0, 2); rank 1 a = (1, 1) and b = (0, 2). Alone,
    # Adasum(a) = (1.25, 0.75) (adasum.py's worked pair) and Adasum(b) = (0, 2) (equal
    # vectors); one vector over the concatenation would give neither.
    def work(r, fusion, comm):
        batch = [allreduce("a", np.array([1.0, float(r)]), op="ADASUM"),
                 allreduce("b", np.array([0.0, 2.0]), op="ADASUM")]
        if fused:
            fusion.run(batch, None)
        else:
            for q in batch:
                fusion.run([q], None)
        return [q.flat.tolist() for q in batch]

    assert on_ranks(2, work) == [[[1.25, 0.75], [0.0, 2.0]]] * 2
    whole = np.array([1.0, 0.0, 0.0, 2.0])
    combine(whole, np.array([1.0, 1.0, 0.0, 2.0]), whole.dtype)
    assert whole[:2].tolist() != [1.25, 0.75]  # so the test would see a lost layout
