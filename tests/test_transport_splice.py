"""Lent sends over TCP (vmsplice + splice): the pages go by reference, so a sender that writes
into them before the receiver has read them corrupts what arrives. These tests run the ring on
real loopback TCP connections, one thread per rank, and check that ``settle`` closes the window.
"""

import threading
import time

import numpy as np
import pytest

from gradsync.collectives import ring
from gradsync.collectives.ops import ReduceOp, make_reducer
from gradsync.transport import splice, trials
from gradsync.transport.comm import LEND_MIN_BYTES, Comm, Lending
from harness import run_ranks, tcp_mesh

pytestmark = pytest.mark.skipif(not splice.available(), reason="lending needs Linux vmsplice")


@pytest.fixture(autouse=True)
def _lend_small_vectors(monkeypatch):
    # The ring lends only above LEND_ABOVE_BYTES (32 MiB); these tests lend megabytes, from
    # the first allreduce on (no trials of copying against lending, but in the last tests).
    monkeypatch.setattr(ring, "LEND_ABOVE_BYTES", 0)
    monkeypatch.setattr(trials, "LEND_TRIALS", 0)

CHUNK = LEND_MIN_BYTES  # every ring segment is large enough to be lent
SUM = make_reducer(ReduceOp.SUM, np.float64)


def _mesh(n, **kwargs):
    """Connected ranks whose ring cuts segments of ``CHUNK`` always: the segment-size trials
    (``Comm.segments``) would cut smaller ones, too small to be lent."""
    return tcp_mesh(n, segment_trials=0, **kwargs)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_lent_ring_allreduce_back_to_back_with_writes_in_between(n):
    # Uneven blocks of several segments each; every rank writes next round's input into the
    # buffer the moment allreduce returns, so a lent page still unread would carry it.
    length = 3 * n * CHUNK // 8 + 5

    def fn(comm):
        data = np.empty(length, np.float64)
        got = []
        for it in range(4):
            data[:] = np.arange(length) * (comm.rank + 1) + it
            comm.begin(f"allreduce {it}")
            ring.allreduce(comm, data, SUM, CHUNK)
            got.append(data.copy())
        return got, [p.lends for p in comm.pairs.values()]

    results = run_ranks(_mesh(n), fn)
    ranks_sum = n * (n + 1) // 2
    for got, lends in results:
        assert all(lends)
        for it, out in enumerate(got):
            np.testing.assert_array_equal(out, np.arange(length) * ranks_sum + n * it)


@pytest.mark.parametrize("n", [1, 3])
def test_lent_reduce_scatter_and_allgather(n):
    counts = [CHUNK // 8 * 2 + r for r in range(n)]  # two segments a block, uneven
    offsets = np.cumsum([0] + counts)

    def fn(comm):
        data = np.full(sum(counts), comm.rank + 1.0)
        comm.begin("reduce_scatter")
        ring.reduce_scatter(comm, data, counts, SUM, CHUNK)
        mine = data[offsets[comm.rank]:offsets[comm.rank + 1]].copy()
        data[:] = -1  # right after return: must not reach anyone
        data[offsets[comm.rank]:offsets[comm.rank + 1]] = comm.rank
        comm.begin("allgather")
        ring.allgather(comm, data, counts, CHUNK)
        gathered = data.copy()
        data[:] = -2
        return mine, gathered

    for mine, gathered in run_ranks(_mesh(n), fn):
        assert (mine == n * (n + 1) / 2).all()
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(n, dtype=float), counts))


@pytest.mark.parametrize("n", [2, 3])
def test_lent_reduce_scatter_from_a_source(n):
    # The block sent first goes out of ``source``, lent: writing it right after the return
    # must not reach anyone, and the source itself is never written.
    counts = [CHUNK // 8 * 2 + r for r in range(n)]
    offsets = np.cumsum([0] + counts)

    def fn(comm):
        source = np.full(sum(counts), comm.rank + 1.0)
        data = np.full(sum(counts), np.nan)
        comm.begin("reduce_scatter")
        ring.reduce_scatter(comm, data, counts, SUM, CHUNK, source=source)
        untouched = bool((source == comm.rank + 1.0).all())
        source[:] = -1
        return data[offsets[comm.rank]:offsets[comm.rank + 1]].copy(), untouched, \
            [p.lends for p in comm.pairs.values()]

    for mine, untouched, lends in run_ranks(_mesh(n), fn):
        assert all(lends) and untouched
        assert (mine == n * (n + 1) / 2).all()


class _LateReader(Comm):
    """Rank 1 of the race below: sends its last segment, then holds back its last receive
    until rank 0 has returned from allreduce and overwritten its buffer (``rank0_done``), or
    until ``grace`` seconds passed. With ``settle`` working, rank 0 cannot return before rank 1
    has read its last segment, so the event never comes and the grace period runs out; without
    it, rank 0 returns at once and rank 1 reads the overwritten pages."""

    last = 0
    rank0_done = None
    grace = 0.3
    calls = 0

    def exchange(self, sends=(), recvs=(), lend=False):
        type(self).calls += 1
        if type(self).calls != self.last:
            return super().exchange(sends, recvs, lend)
        super().exchange(sends, (), lend)
        self.rank0_done.wait(self.grace)
        super().exchange((), recvs, lend)


def _race(monkeypatch=None):
    """Rank 0 overwrites its buffer right after allreduce; rank 1 reads late. Returns rank 1's
    result and the value it should be."""
    # Two blocks of two segments: 3 exchanges on each rank (the allgather's stream one behind
    # the reduce-scatter's), the last one the allgather's alone.
    length = 4 * CHUNK // 8
    _LateReader.last, _LateReader.calls = 3, 0
    _LateReader.rank0_done = threading.Event()

    def fn(comm):
        data = np.full(length, comm.rank + 1.0)
        comm.begin("allreduce")
        ring.allreduce(comm, data, SUM, CHUNK)
        if comm.rank == 0:
            data[:] = -1.0
            _LateReader.rank0_done.set()
        return data.copy()

    comms = _mesh(2, comm_class=lambda r: _LateReader if r == 1 else Comm)
    results = run_ranks(comms, fn)
    assert _LateReader.calls == 3
    return results[1]


def test_settle_keeps_a_late_reader_from_seeing_a_reused_buffer():
    assert (_race() == 3.0).all()


def test_without_settle_the_late_reader_sees_the_reused_buffer(monkeypatch):
    # The guard off: proves the pages really travel by reference, and that the race above
    # catches a sender that writes too early.
    monkeypatch.setattr(Comm, "settle", lambda self: None)
    out = _race()
    assert (out == -1.0).any(), "the lent segment was copied after all"


def test_vectors_up_to_the_threshold_are_copied(monkeypatch):
    # The race without the guard again, but at the shipped threshold: nothing is lent, so the
    # late reader gets the sum although rank 0 rewrote its buffer first.
    monkeypatch.undo()
    assert ring.LEND_ABOVE_BYTES >= 4 * CHUNK
    monkeypatch.setattr(Comm, "settle", lambda self: None)
    assert (_race() == 3.0).all()


def _two_rank_sums(comms):
    """Each of 2 ranks allreduces (rank + 1) over two segments; returns per rank its result
    and whether its pair lends."""
    length = 2 * CHUNK // 8

    def fn(comm):
        data = np.full(length, comm.rank + 1.0)
        comm.begin("allreduce")
        ring.allreduce(comm, data, SUM, CHUNK)
        return data.copy(), comm.pairs[1 - comm.rank].lends

    return run_ranks(comms, fn)


def test_a_copying_rank_and_a_lending_rank_meet():
    # Rank 1 copies (GRADSYNC_TCP_SPLICE=0 on its side) but still acknowledges rank 0's
    # lent frames; rank 0 lends.
    (d0, l0), (d1, l1) = _two_rank_sums(_mesh(2, splice_on=lambda r: r == 0))
    assert (l0, l1) == (True, False)
    assert (d0 == 3.0).all() and (d1 == 3.0).all()


def test_a_failing_vmsplice_falls_back_to_copies(monkeypatch, caplog):
    def refuse(self, address, nbytes):
        raise OSError(1, "vmsplice: Operation not permitted")

    monkeypatch.setattr(splice.Splicer, "push", refuse)
    for data, lends in _two_rank_sums(_mesh(2)):
        assert (data == 3.0).all() and not lends
    assert "sending copies from now on" in caplog.text


def test_lending_alternates_its_trials_then_keeps_the_faster_way():
    for lend_faster in (True, False):
        choice = Lending(3)
        tried = []
        while choice.chosen is None:
            lent = choice.next()
            tried.append(lent)
            choice.record(lent, 1.0 if lent == lend_faster else 2.0, 1 << 20)
        assert tried == [False, True] * 3  # copying first, in turn, three of each
        assert choice.chosen is lend_faster and choice.next() is lend_faster
    assert Lending(0).chosen is True  # no trials: lends from the start


class _Counting(Comm):
    """Counts the exchanges posted with ``lend`` on, per allreduce (``begin``)."""

    def begin(self, description, check=True):
        self.lent_calls = getattr(self, "lent_calls", []) + [0]
        super().begin(description, check)

    def exchange(self, sends=(), recvs=(), lend=False):
        self.lent_calls[-1] += bool(lend and sends)
        return super().exchange(sends, recvs, lend)


@pytest.mark.parametrize("lend_faster", [True, False])
def test_the_ring_measures_lending_and_copying_and_keeps_the_faster(monkeypatch, lend_faster):
    # Two trials of each way, the slower way made 50 ms slower, then the chosen way for the
    # rest; every allreduce reduces right, lent or copied.
    monkeypatch.setattr(trials, "LEND_TRIALS", 2)
    allreduce = ring._allreduce

    def slowed(comm, data, counts, reducer, chunk_bytes, lend):
        allreduce(comm, data, counts, reducer, chunk_bytes, lend)
        if lend != lend_faster:
            time.sleep(0.05)

    monkeypatch.setattr(ring, "_allreduce", slowed)
    length = 4 * CHUNK // 8

    def fn(comm):
        data = np.empty(length, np.float64)
        for it in range(7):
            data[:] = comm.rank + 1.0 + it
            comm.begin(f"allreduce {it}")
            ring.allreduce(comm, data, SUM, CHUNK)
            assert (data == 3.0 + 2 * it).all()
        return comm.lent_calls, comm.lending.chosen

    for lent_calls, chosen in run_ranks(_mesh(2, comm_class=lambda r: _Counting), fn):
        assert chosen is lend_faster
        assert [bool(k) for k in lent_calls] == [False, True, False, True] + [lend_faster] * 3
