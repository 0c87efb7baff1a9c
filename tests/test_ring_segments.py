"""The ring's segment size over TCP, measured (``Comm.segments``): the first large allreduces
try segments of a sixteenth, a quarter and the whole of ``chunk_bytes``, in turns, and then every
rank keeps the same one, chosen from the medians of all ranks. These tests run the ring on real loopback TCP
connections, one thread per rank, with one way made slower on purpose.
"""

import logging
import time

import numpy as np
import pytest

from gradsync.collectives import ring
from gradsync.collectives.ops import ReduceOp, make_reducer
from gradsync.config import Config
from gradsync.transport import local
from gradsync.transport.comm import SEGMENT_BLOCK, Comm, Trials
from gradsync.transport.trials import SEGMENT_MARGIN, SegmentTrials
from harness import run_ranks, tcp_mesh

CHUNK = 64 << 10
SUM = make_reducer(ReduceOp.SUM, np.float64)


def test_trials_take_turns_in_blocks_and_keep_the_end_of_each_turn():
    trials = Trials(("small", "large"), rounds=2, untried="large", block=4)
    order, ends = [], []
    while True:
        way = trials.next()
        order.append(way)
        # a turn's first two runs are slow (as after a switch on some machines): not counted
        slow = len(order) % 4 in (1, 2)
        ends.append(trials.record(way, 100.0 if slow else (1.0 if way == "small" else 2.0),
                                  1 << 20))
        if ends[-1]:
            break
    assert order == ["small"] * 4 + ["large"] * 4 + ["small"] * 4 + ["large"] * 4
    assert ends == [False] * 15 + [True]
    assert trials.chosen is None  # the owner chooses, from these medians or the ranks' sum
    assert trials.medians() == [1.0 / (1 << 20), 2.0 / (1 << 20)]
    trials.choose([3.0, 2.0])
    assert trials.chosen == "large" and trials.next() == "large"
    assert not trials.record("large", 1.0, 1 << 20)  # chosen: nothing more is recorded
    assert Trials(("a", "b"), rounds=0, untried="b").chosen == "b"


def test_a_smaller_segment_is_kept_only_when_faster_by_more_than_the_margin():
    def kept(costs):
        trials = SegmentTrials((1024, 4096, 16384), rounds=1, untried=16384)
        trials.choose(costs)
        return trials.chosen

    close = 1 - SEGMENT_MARGIN / 2
    assert kept([1.0, 1.0, 1.0]) == 16384  # a tie: the largest, the least CPU
    assert kept([close, close, 1.0]) == 16384  # faster, but within the margin
    assert kept([0.9, 0.99, 1.0]) == 1024
    assert kept([0.99, 0.9, 1.0]) == 4096
    # the sixteenth beats the whole by more than the margin, but not the quarter kept before it
    assert kept([0.9 * close, 0.9, 1.0]) == 4096
    assert kept([1.0, 1.0, 2.0]) == 4096  # the tie between the smaller two: the larger
    assert kept([2.0, 1.0, 1.0 / close]) == 16384


def _slowed(monkeypatch, delays):
    """Makes ring allreduces with segments of ``size`` bytes ``delays[rank][size]`` seconds
    slower on ``rank`` (or ``delays(rank, size, vector bytes)``); returns the list of (rank,
    segment bytes) of each allreduce run."""
    allreduce, runs = ring._allreduce, []
    delay = delays if callable(delays) else (
        lambda rank, segment, nbytes: delays.get(rank, {}).get(segment, 0.0))

    def slowed(comm, data, counts, reducer, chunk_bytes, lend):
        allreduce(comm, data, counts, reducer, chunk_bytes, lend)
        segment = ring._segment_elems(data, counts, chunk_bytes) * data.itemsize
        runs.append((comm.rank, segment))
        time.sleep(delay(comm.rank, segment, data.nbytes))

    monkeypatch.setattr(ring, "_allreduce", slowed)
    return runs


class _PrefersWhole(Comm):
    """A rank whose own medians favour whole segments, whatever it measured (the ranks of a
    synchronous ring mostly measure each other's delays, so real ones rarely disagree)."""

    def segments(self, chunk_bytes, nbytes, ranks=None):
        trials = super().segments(chunk_bytes, nbytes, ranks)
        if trials is not None:
            trials.medians = lambda: [5e-8, 5e-8, 1e-8]
        return trials


@pytest.mark.parametrize("n", [2, 3])
def test_the_ranks_keep_the_segment_that_is_faster_over_all_of_them(monkeypatch, caplog, n):
    # Whole and sixteenth segments are made 100 ms slower an allreduce on rank 0; rank 1's
    # medians say whole segments are faster. Alone they would choose differently; together they
    # must keep the same one, the quarter (the lower sum), or their segments would no longer
    # match.
    caplog.set_level(logging.INFO, logger="gradsync")
    runs = _slowed(monkeypatch, {0: {CHUNK: 0.1, CHUNK // 16: 0.1}})
    length = (1 << 20) // 8 + 3 * n  # uneven blocks, several segments each
    allreduces = 2 * 3 * SEGMENT_BLOCK + 3

    def fn(comm):
        data = np.empty(length, np.float64)
        sizing = comm.segments(CHUNK, data.nbytes)
        for it in range(allreduces):
            data[:] = np.arange(length) % 7 + comm.rank + it
            comm.begin(f"allreduce {it}")
            ring.allreduce(comm, data, SUM, CHUNK)
            want = n * (np.arange(length) % 7) + n * (n - 1) / 2 + n * it
            assert (data == want).all()
        return sizing.chosen, sizing.medians()

    comms = tcp_mesh(n, comm_class=lambda r: _PrefersWhole if r == 1 else Comm)
    results = run_ranks(comms, fn)
    assert [chosen for chosen, _ in results] == [CHUNK // 4] * n
    sixteenth, quarter, whole = results[0][1]
    assert quarter * 2 < min(sixteenth, whole)  # rank 0 measured its delays
    # The trials take turns of SEGMENT_BLOCK allreduces, the smallest segments first; the
    # agreement's own tiny allreduce of three float64 (in segments of one block, 16 or 8
    # bytes) ends the trials; then the chosen size.
    ranks0 = [segment for rank, segment in runs if rank == 0]
    turns = [CHUNK // 16] * SEGMENT_BLOCK + [CHUNK // 4] * SEGMENT_BLOCK + [CHUNK] * SEGMENT_BLOCK
    assert ranks0 == turns * 2 + [8 * -(-3 // n)] + [CHUNK // 4] * 3
    # rank 0 says what it measured and kept, once
    said = [r.getMessage() for r in caplog.records if "segments of" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        f"ring allreduces of about {length * 8} bytes over {n} ranks: segments of "
        f"{CHUNK // 16}, {CHUNK // 4}, {CHUNK} bytes measured, ") and said[0].endswith(
        f"(medians summed over the ranks): {CHUNK // 4} kept"), said


def test_each_power_of_4_of_sizes_chooses_on_its_own(monkeypatch):
    # Interleaved allreduces of two sizes: at the smaller, whole and sixteenth segments are made
    # slower; at the larger (four times as large), quarter and sixteenth ones. Each size keeps
    # its own faster segment.
    small, large = (1 << 20) // 8, (4 << 20) // 8
    slow = {small * 8: (CHUNK, CHUNK // 16), large * 8: (CHUNK // 4, CHUNK // 16)}
    _slowed(monkeypatch, lambda rank, segment, nbytes: 0.05 * (segment in slow.get(nbytes, ())))

    def fn(comm):
        assert comm.segments(CHUNK, small * 8) is comm.segments(CHUNK, small * 8 + 4096)
        assert comm.segments(CHUNK, small * 8) is not comm.segments(CHUNK, large * 8)
        for it in range(2 * 3 * SEGMENT_BLOCK + 1):
            for length in (small, large):
                data = np.full(length, comm.rank + 1.0)
                comm.begin(f"allreduce {it} of {length}")
                ring.allreduce(comm, data, SUM, CHUNK)
                assert (data == 3.0).all()
        return [comm.segments(CHUNK, n * 8).chosen for n in (small, large)]

    assert run_ranks(tcp_mesh(2), fn) == [[CHUNK // 4, CHUNK]] * 2


def test_no_trials_below_the_threshold_without_sockets_or_when_off(monkeypatch):
    runs = _slowed(monkeypatch, {})
    small = np.ones((ring.TUNE_FROM_BYTES - 8) // 8)

    def fn(comm):
        comm.begin("small")
        ring.allreduce(comm, small.copy(), SUM, CHUNK)
        return comm.segments(CHUNK, small.nbytes) is not None

    # over TCP there are trials, but a vector below TUNE_FROM_BYTES always cuts chunk_bytes
    assert run_ranks(tcp_mesh(2), fn) == [True, True]
    assert {segment for _, segment in runs} == {CHUNK}
    # no socket among the pairs (in-process pairs here; shared memory alike): no trials
    assert [comm.segments(CHUNK, 64 << 20) for comm in local.local_comms(3, 10.0)] == [None] * 3
    # GRADSYNC_TUNE_SEGMENTS=0 gives the Comm no trials
    assert run_ranks(tcp_mesh(2, segment_trials=0), fn) == [False, False]
    assert Config(tune_segments=False).tune_segments is False
