"""Shared memory: the rings of ``transport/shm.py`` and the host's segment of
``transport/host_segment.py``.

Multi-process tests fork real ranks (no launcher needed); every launch has a deadline after
which its processes dump their stacks and are killed, so a hang fails the test instead of CI.
Every launch also asserts that nothing of its job is left in /dev/shm, killed ranks included.
"""

from __future__ import annotations

import faulthandler
import functools
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
import uuid
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch  # noqa: F401 - imported before forking, so float16 ranks do not each import it

from gradsync.collectives.ops import Max, Sum, make_reducer
from gradsync.transport.host_segment import ShmGroup
from gradsync.errors import CollectiveMismatchError, PeerLostError
from gradsync.transport import frame
from gradsync.transport import shm as shm_transport
from gradsync.transport.base import Expect, Recv, Send, wait_all
from gradsync.transport.comm import Comm
from gradsync.transport.shm import (ShmPair, attach_ring, create_ring, open_pairs,
                                    process_start_time, unlink_ring)

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")

_TINY_RING = 256  # bytes: every frame of more than a few bytes wraps around


def _leftovers(job: str) -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"gradsync-{job}-"))


# --- launching ranks --------------------------------------------------------------------------

@dataclass
class Rank:
    rank: int
    size: int
    job: str
    barrier: Callable[[], None]
    pids: list[int]


def _child(fn, rank, size, job, barrier, pids, results, timeout, args):
    # A hung rank prints where it hangs and exits before the parent gives up on it.
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        pids[rank] = os.getpid()
        barrier.wait(timeout)
        ctx = Rank(rank, size, job, functools.partial(barrier.wait, timeout), list(pids))
        results.put((rank, "ok", fn(ctx, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "crash", traceback.format_exc()))


def _launch(size: int, fn, *args, timeout: float = 15.0, expect: "int | None" = None) -> dict:
    """Runs ``fn(Rank, *args)`` in ``size`` forked processes; returns {rank: fn's result}.

    ``expect`` results are awaited (fewer when a test kills a rank on purpose).
    """
    ctx = mp.get_context("fork")
    job = f"t{uuid.uuid4().hex[:10]}"
    barrier, results, pids = ctx.Barrier(size), ctx.Queue(), ctx.Array("q", size)
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(fn, r, size, job, barrier, pids, results, timeout, args))
             for r in range(size)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + timeout + 3
    try:
        while len(got) < (size if expect is None else expect):
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"ranks {sorted(set(range(size)) - set(got))} did not finish "
                            f"within {timeout}s (their stacks are above)")
            try:
                rank, status, value = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if status == "crash":
                pytest.fail(f"rank {rank} raised:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
    assert _leftovers(job) == [], "segments left in /dev/shm"
    return got


def _raises(fn, *args) -> tuple[str, str, float]:
    """Calls fn; returns (exception class name, message, seconds until it raised)."""
    start = time.monotonic()
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects what came out
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "nothing", "", time.monotonic() - start


# --- ShmPair -------------------------------------------------------------------------------

def _pattern(nbytes: int, seed: int) -> np.ndarray:
    return ((np.arange(nbytes, dtype=np.int64) * 31 + seed * 7) % 251).astype(np.uint8)


def _loopback(capacity: int = _TINY_RING):
    """Both ends of a ring pair in this process: a sends to b."""
    job = f"t{uuid.uuid4().hex[:10]}"
    a_in, b_in = create_ring(job, 0, 1, capacity), create_ring(job, 1, 0, capacity)
    a_out, b_out = attach_ring(job, 1, 0), attach_ring(job, 0, 1)
    unlink_ring(job, 0, 1)
    unlink_ring(job, 1, 0)
    assert _leftovers(job) == []
    return ShmPair(1, os.getpid(), a_in, a_out), ShmPair(0, os.getpid(), b_in, b_out)


def _frame(sender: ShmPair, receiver: ShmPair, payload: np.ndarray, out: np.ndarray,
           signature: int = 5, expected_signature: int = 5) -> None:
    header = frame.pack(frame.Kind.DATA, 1, 0, signature, payload.nbytes)
    ops = [Send(sender, header, memoryview(payload)),
           Recv(receiver, Expect(1, 0, expected_signature, lambda: "test"), memoryview(out))]
    wait_all(ops, time.monotonic() + 5, lambda waited: None, lambda: "test frame")


def test_pair_frames_wrap_around_a_tiny_ring():
    a, b = _loopback()
    sizes = [0, 1, 7, 40, 215, 216, 217, 255, 256, 257, 1000, 3 * _TINY_RING + 13, 0, 1]
    for i, size in enumerate(sizes):  # consecutive frames start at every ring offset
        out = np.zeros(size, np.uint8)
        _frame(a, b, _pattern(size, i), out)
        np.testing.assert_array_equal(out, _pattern(size, i), err_msg=f"frame of {size} bytes")


def test_pair_checks_header_before_any_payload_lands():
    a, b = _loopback()
    out = np.zeros(100, np.uint8)
    with pytest.raises(CollectiveMismatchError, match="signature 0x6"):
        _frame(a, b, _pattern(100, 1), out, signature=6)
    assert not out.any()


def test_pair_peeks_at_a_whole_header_without_taking_it():
    a, b = _loopback()
    assert b.peek_header() is None  # nothing sent
    header = frame.pack(frame.Kind.DATA, 4, 0, 9, 3)
    # Write the header in two pieces: half of it is not yet a header to look at.
    a._out.put(memoryview(header)[:10])
    a._out.ctl[shm_transport._WRITE] = a._out.pos  # published
    assert b.peek_header() is None
    a._out.put(memoryview(bytes(header[10:]) + b"xyz"))
    a._out.ctl[shm_transport._WRITE] = a._out.pos
    for _ in range(2):  # looking twice sees the same, and takes nothing
        h = b.peek_header()
        assert (h.kind, h.seq, h.signature, h.length) == (frame.Kind.DATA, 4, 9, 3)
    out = np.zeros(3, np.uint8)
    wait_all([Recv(b, Expect(4, 0, 9, lambda: "test"), memoryview(out))],
             time.monotonic() + 5, lambda waited: None, lambda: "test frame")
    assert out.tobytes() == b"xyz" and b.peek_header() is None


def test_pair_close_is_seen_by_the_peer():
    a, b = _loopback()  # a: rank 0's pair to rank 1; b: rank 1's pair to rank 0
    a.close()
    with pytest.raises(PeerLostError, match="rank 0 .* closed") as info:
        b.check_alive()
    assert info.value.peer == 0


def test_pair_counts_nothing_once_closed():
    # The pace thread reads ``moved`` (liveness/traffic.py) and may come after the pair's
    # World closed; the old code raised AttributeError there, and the pace round with it.
    a, b = _loopback()
    _frame(a, b, _pattern(40, 0), np.zeros(40, np.uint8))
    assert a.moved() == b.moved() == frame.HEADER_SIZE + 40
    a.close()
    assert a.moved() == 0
    assert b.moved() == frame.HEADER_SIZE + 40


def _pair_exchange(ctx: Rank, sizes: list[int]):
    peer = 1 - ctx.rank
    pairs = open_pairs(ctx.job, ctx.rank, {peer: ctx.pids[peer]}, ctx.barrier, _TINY_RING)
    ctx.barrier()  # both ranks have unlinked their segments
    leftover = _leftovers(ctx.job)
    comm = Comm(ctx.rank, 2, pairs, timeout=10)
    for size in sizes:
        comm.begin(f"exchange {size}")
        inbox = np.empty(size, np.uint8)
        # Both ranks send more than the ring holds while receiving: only works if sends and
        # receives are advanced together.
        comm.exchange(sends=[(peer, _pattern(size, ctx.rank))], recvs=[(peer, inbox)])
        np.testing.assert_array_equal(inbox, _pattern(size, peer))
    # Several frames to one peer in one exchange (the ring's allreduce posts two each way),
    # the first larger than the ring: each lands whole in its own buffer, in posting order.
    comm.begin("several")
    frames = sizes[::-1]  # the largest first
    inboxes = [np.empty(size, np.uint8) for size in frames]
    outgoing = [(peer, _pattern(size, ctx.rank + 2 * i)) for i, size in enumerate(frames)]
    comm.exchange(sends=outgoing, recvs=[(peer, inbox) for inbox in inboxes])
    for i, (size, inbox) in enumerate(zip(frames, inboxes)):
        np.testing.assert_array_equal(inbox, _pattern(size, peer + 2 * i), err_msg=f"frame {i}")
    return leftover


def test_pair_between_processes_exchanges_frames_both_ways():
    results = _launch(2, _pair_exchange, [0, 1, 255, 4099, 50_000])
    assert results == {0: [], 1: []}  # nothing in /dev/shm once open_pairs returned


def _pair_peer_killed(ctx: Rank):
    peer = 1 - ctx.rank
    pairs = open_pairs(ctx.job, ctx.rank, {peer: ctx.pids[peer]}, ctx.barrier, _TINY_RING)
    ctx.barrier()  # rank 0 holds its pair before rank 1 dies (open_pairs checks the peer runs)
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm = Comm(0, 2, pairs, timeout=20)
    comm.begin("send to the dead")
    sent = _raises(comm.exchange, [(1, np.zeros(10_000, np.uint8))], ())
    comm.begin("receive from the dead")
    received = _raises(comm.exchange, (), [(1, np.zeros(10, np.uint8))])
    return sent, received


def test_pair_killed_peer_raises_peer_lost_quickly():
    results = _launch(2, _pair_peer_killed, expect=1)
    for name, message, seconds in results[0]:
        assert name == "PeerLostError" and "rank 1" in message, message
        assert seconds < 2.0


def test_process_start_time_tells_dead_from_alive():
    assert process_start_time(os.getpid()) not in (None, -1)
    child = mp.get_context("fork").Process(target=os._exit, args=(0,))
    child.start()
    while child.exitcode is None and process_start_time(child.pid) is not None:
        time.sleep(0.01)
    assert process_start_time(child.pid) is None  # a zombie, or reaped
    child.join()


# --- ShmGroup ------------------------------------------------------------------------------

_SLOT = 256  # bytes: 64 float32 or 32 int64 per piece, so 1000 elements take many pieces
_DTYPES = (np.float32, np.int64, np.float16)
_OPS = {"sum": (Sum, np.add), "max": (Max, np.maximum)}


def _counts(size: int) -> list[int]:
    # empty, one, fewer than the ranks, uneven, many pieces (and not a whole number of them)
    return sorted({0, 1, max(size - 1, 0), 37, 1001})


def _input(count: int, dtype, rank: int) -> np.ndarray:
    # Small integers: every sum is exact in float16, whatever the order of the reduction.
    return (((np.arange(count) * 7 + rank * 5) % 11) - 5).astype(dtype)


def _group_sweep(ctx: Rank, small_bytes: int = 1 << 15, sleep: str = "auto",
                 stream: str = "auto"):
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT,
                          small_bytes=small_bytes, sleep=sleep, stream=stream)
    ctx.barrier()  # every rank is past open(): the segment must be gone by now
    out = {"leftover": _leftovers(ctx.job)}
    deadline = time.monotonic() + 10
    for count in _counts(ctx.size):
        for dtype in _DTYPES:
            for name, (op, _) in _OPS.items():
                data = _input(count, dtype, ctx.rank)
                group.allreduce(data, make_reducer(op, dtype), deadline, signature=count)
                out[count, np.dtype(dtype).name, name] = data.tobytes()
        data = _input(count, np.float32, ctx.rank)
        group.broadcast(data, ctx.size - 1, deadline)  # interleaved with the allreduces
        out[count, "broadcast"] = data.tobytes()
    group.barrier(deadline)
    return out


# small_bytes 0: every allreduce takes the two-step road; else those of at most one slot
# (counts 0, 1, size - 1 and 37 of 4-byte elements) take the one-step road. Waits sleep on
# futexes or nap. The two-step road's slots written by the streaming copy ("always") or not.
@pytest.mark.parametrize("size,small_bytes,sleep,stream", [
    (1, 1 << 15, "auto", "auto"), (2, 1 << 15, "futex", "auto"), (3, 1 << 15, "nap", "auto"),
    (4, 1 << 15, "futex", "always"), (2, 0, "nap", "never"), (3, 0, "futex", "always"),
    (4, 0, "futex", "always")])
def test_group_allreduce_and_broadcast_match_numpy(size, small_bytes, sleep, stream):
    results = _launch(size, _group_sweep, small_bytes, sleep, stream)
    for rank in range(size):
        assert results[rank]["leftover"] == []
    for count in _counts(size):
        for dtype in _DTYPES:
            for name, (_, ufunc) in _OPS.items():
                inputs = [_input(count, dtype, r) for r in range(size)]
                want = functools.reduce(lambda x, y: ufunc(x, y), inputs).tobytes()
                for rank in range(size):  # bitwise equal to NumPy, hence across ranks
                    assert results[rank][count, np.dtype(dtype).name, name] == want, \
                        (count, np.dtype(dtype).name, name, rank)
        root = _input(count, np.float32, size - 1).tobytes()
        assert all(results[r][count, "broadcast"] == root for r in range(size))


def _group_stores(ctx: Rank, modes: list[str], calls: int):
    # Pieces of 256 bytes: 40 of float32 per call (39 timed: the first is not), whole, so the
    # measured ranks finish a trial (2 x 16 pieces) in the first call and another in the 14th.
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT,
                          small_bytes=0, stream=modes[ctx.rank])
    deadline, out = time.monotonic() + 10, []
    for i in range(calls):
        data = _input(40 * 64, np.float32, ctx.rank + i)
        group.allreduce(data, make_reducer(Sum, np.float32), deadline)
        out.append(data.tobytes())
    group.barrier(deadline)
    s = group.stores
    return out, s.measuring, s.streaming, list(s.trials), s.copy is not None


# Each rank writes its slots its own way (measured, streamed, or not), so the ranks need not
# agree; the bytes are the same whatever each chose.
@pytest.mark.parametrize("modes", [["auto", "auto"], ["always", "never", "auto"]])
def test_group_pieces_written_either_way_sum_to_the_same_bytes(modes):
    results = _launch(len(modes), _group_stores, modes, 20)
    for i in range(20):
        inputs = [_input(40 * 64, np.float32, r + i) for r in range(len(modes))]
        want = functools.reduce(np.add, inputs).tobytes()
        assert all(results[r][0][i] == want for r in range(len(modes))), i
    for r, mode in enumerate(modes):
        _, measuring, streaming, trials, copies = results[r]
        assert copies == (mode != "never") and measuring == (mode == "auto")
        if mode == "auto":  # two trials of 16 pieces each way, whichever won
            assert len(trials) == 2 and all(t[0] > 0 and t[1] > 0 for t in trials)
        else:
            assert streaming == (mode == "always") and trials == []


def _group_mismatch(ctx: Rank, how: str):
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT)
    odd = ctx.rank == 1
    data = np.ones(100 if how == "size" and odd else 50, np.float32)
    deadline = time.monotonic() + 10
    if how == "kind" and odd:
        return _raises(group.barrier, deadline, lambda waited: None, 0x1234)
    return _raises(group.allreduce, data, make_reducer(Sum, data.dtype), deadline,
                   lambda waited: None, 0xBAD if how == "signature" and odd else 0x1234)


@pytest.mark.parametrize("how", ["signature", "size", "kind"])
def test_group_mismatched_collectives_raise_on_every_rank(how):
    results = _launch(3, _group_mismatch, how)
    for rank in range(3):
        name, message, _ = results[rank]
        assert name == "CollectiveMismatchError", message
        assert "local rank 1 (rank 1)" in message and "0x1234" in message, message
        if how == "signature":
            assert "0xbad" in message


def _die_in_third_reduce(group: ShmGroup) -> None:
    """Kills this rank in the middle of the third piece: after arriving, before reducing."""
    reduce, calls = group._reduce, [0]

    def reduce_or_die(*args):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        reduce(*args)

    group._reduce = reduce_or_die


def _group_rank_killed(ctx: Rank):
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT)
    if ctx.rank == 2:
        _die_in_third_reduce(group)
    data = np.ones(1000, np.float32)
    return _raises(group.allreduce, data, make_reducer(Sum, data.dtype),
                   time.monotonic() + 20)


def assert_rank_2_lost(results: dict) -> None:
    """Ranks 0 and 1 raised PeerLostError naming local rank 2 within 3 s (``_raises``)."""
    for rank in (0, 1):
        name, message, seconds = results[rank]
        assert name == "PeerLostError" and "local rank 2 (rank 2)" in message, message
        assert seconds < 3.0


def test_group_killed_rank_raises_peer_lost_on_the_others():
    assert_rank_2_lost(_launch(3, _group_rank_killed, expect=2))


def _group_silent_peer(ctx: Rank):
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier)
    if ctx.rank == 1:
        ctx.barrier()  # stays alive but never joins the collective
        return None
    idle: list[float] = []
    result = _raises(group.allreduce, np.ones(10, np.int64), make_reducer(Sum, np.int64),
                     time.monotonic() + 0.3, idle.append)
    ctx.barrier()
    return result, len(idle)


def test_group_times_out_naming_the_missing_rank():
    results = _launch(2, _group_silent_peer)
    (name, message, seconds), idle_calls = results[0]
    assert name == "GradsyncTimeoutError" and "local rank(s) [1]" in message, message
    assert 0.3 <= seconds < 2.0 and idle_calls >= 3


def _group_late_peer(ctx: Rank, sleep: str):
    """Rank 1 joins 0.3 s late, so rank 0's wait outlasts its spin and must sleep."""
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, sleep=sleep)
    sleeps = []
    sleep_on = group._sleep_on
    group._sleep_on = lambda *a: (sleeps.append(a), sleep_on(*a))
    data = np.full(1000, ctx.rank + 1, np.float64)
    deadline = time.monotonic() + 10
    for _ in range(3):  # the one-step road, then the two-step road, then a barrier
        if ctx.rank == 1:
            time.sleep(0.3)
        group.allreduce(data[:10], make_reducer(Sum, data.dtype), deadline)
    group.small_bytes = 0
    group.allreduce(data, make_reducer(Sum, data.dtype), deadline)
    group.barrier(deadline)
    return data.tolist(), len(sleeps)


@pytest.mark.parametrize("sleep", ["futex", "nap"])
def test_group_waits_sleep_and_are_woken(sleep):
    results = _launch(2, _group_late_peer, sleep)
    for rank in (0, 1):
        data, sleeps = results[rank]
        # 1 + 2, doubled twice more by the small allreduces, doubled by the last; 1 + 2.
        assert data[:10] == [24.0] * 10 and data[10:] == [3.0] * 990
    assert (results[0][1] > 0) == (sleep == "futex")  # rank 0 slept on futexes, or napped


def _until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def _in_futex_wait(tid: int, address: int) -> bool:
    """Whether thread ``tid`` of this process is asleep in the futex system call on
    ``address`` (/proc's ``syscall`` file: the call's number, then its arguments)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/self/task/{tid}/syscall") as f:
            call = f.read().split()
    except OSError:
        return False
    return state == "S" and len(call) > 1 and call[0] == "202" and int(call[1], 16) == address


def test_futex_wait_returns_on_change_wake_or_timeout():
    import mmap
    import threading

    from gradsync.transport.futex import Futex

    seg = mmap.mmap(-1, 4096)
    futex = Futex.open(seg)
    assert futex is not None
    words = memoryview(seg).cast("Q")
    words[1] = 5
    start = time.monotonic()
    assert futex.wait(8, 4, 5.0)  # the word is not 4: returns at once
    slept = time.monotonic()
    assert futex.wait(8, 5, 0.05)  # times out
    assert 0.04 < time.monotonic() - slept and time.monotonic() - start < 2.0
    woke = []
    sleeper = threading.Thread(target=lambda: woke.append(futex.wait(8, 5, 10.0)))
    sleeper.start()
    # Only a sleeper known to be in the kernel's queue tests the wake (a word changed before
    # it slept returns at once): wait until its thread is blocked in futex() on this word.
    assert _until(lambda: _in_futex_wait(sleeper.native_id, futex._address + 8)), \
        f"the sleeper never slept on the word (returned {woke})"
    assert not woke
    words[1] = 6
    futex.wake(8)
    sleeper.join(5.0)  # without the wake it would sleep out its 10 s
    assert woke == [True] and not sleeper.is_alive()
    with pytest.raises(ValueError, match="futex offset 4094"):
        futex.wake(4094)
    words.release()
    seg.close()  # Futex.open released its export of the mapping


def test_group_split_covers_every_element_once():
    group = object.__new__(ShmGroup)
    for size in (1, 2, 3, 4, 7):
        group.size = size
        for count in (0, 1, 5, 16, 17, 1000):
            for align in (1, 4, 16):
                bounds = group._split(count, align)
                assert bounds[0] == 0 and bounds[-1] == count and len(bounds) == size + 1
                assert all(x <= y for x, y in zip(bounds, bounds[1:]))
                assert all(b % align == 0 for b in bounds[:-1])

