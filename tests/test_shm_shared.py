"""Allreduces on shared buffers (``ShmGroup.shared_buffer``): the road without slots.

Each rank allocates its buffers itself (a memfd), or adopts memory that lives in a shared
file already (``ShmGroup.adopt``: the torch backend's DDP buckets); the others map them at the
first allreduce that needs them. From a slot's size on, the ranks agree whether every one
passed a shared buffer, and otherwise meet on the slots. Results must be bitwise equal to a
NumPy reduction in the order the owner of each sub-slice folds (its own value first, then the
others by local rank) on every rank, for world sizes 1-4, several dtypes, uneven and
multi-piece counts, interleaved with the slots' collectives; failures must end in the group's usual errors. Ranks are forked by
``test_shm._launch`` (a deadline, stacks dumped on a hang, nothing left in /dev/shm).
"""

from __future__ import annotations

import mmap
import os
import signal
import time

import numpy as np
import pytest

from gradsync.collectives.ops import Max, Sum, make_reducer
from gradsync.errors import GradsyncError
from gradsync.transport import segment_shared as shm
from gradsync.transport.host_segment import ShmGroup
from test_shm import Rank, _launch, _raises, assert_rank_2_lost

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create")

_SLOT = 256  # bytes: the shared road folds in pieces of one slot, so 1001 elements take many
_DTYPES = ("float32", "int64", "float16")
_OPS = {"sum": (Sum, np.add), "max": (Max, np.maximum)}


def _counts(size: int) -> list[int]:
    # one, fewer than the ranks, uneven, many pieces (and not a whole number of them)
    return sorted({1, max(size - 1, 1), 37, 1001})


def _input(count: int, dtype: str, rank: int, salt: int) -> np.ndarray:
    # Small integers: every sum is exact in float16, whatever the order of the reduction.
    return (((np.arange(count) * 7 + rank * 5 + salt) % 11) - 5).astype(dtype)


def _expected(count: int, dtype: str, ufunc, size: int, salt: int) -> bytes:
    inputs = [_input(count, dtype, r, salt) for r in range(size)]
    out = inputs[0].copy()
    for x in inputs[1:]:
        out = ufunc(out, x)
    return out.tobytes()


def _sweep(ctx: Rank):
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT)
    taken = []
    shared_road = group._fold_shared
    group._fold_shared = lambda *a: (taken.append(1), shared_road(*a))
    deadline = time.monotonic() + 20
    # Two buffers, used in turn, each for allreduces of several sizes and dtypes.
    buffers = [group.shared_buffer(1001 * 8) for _ in range(2)]
    if ctx.size == 1:
        return {"buffers": buffers}
    out = {"zeros": [bytes(b) == bytes(len(b)) for b in buffers]}
    salt = 0
    for count in _counts(ctx.size):
        for dtype in _DTYPES:
            for name, (op, _) in _OPS.items():
                salt += 1
                raw = buffers[salt % 2]
                data = raw[:count * np.dtype(dtype).itemsize].view(dtype)
                data[...] = _input(count, dtype, ctx.rank, salt)
                assert group.is_shared(data)
                group.allreduce(data, make_reducer(op, np.dtype(dtype)), deadline,
                                signature=salt)
                out[count, dtype, name] = (salt, data.tobytes())
        plain = _input(count, "float32", ctx.rank, 0)  # the slots' roads, between shared ones
        group.allreduce(plain, make_reducer(Sum, plain.dtype), deadline)
        out[count, "plain"] = plain.tobytes()
        group.broadcast(plain, 0, deadline)
    average = buffers[0][:37 * 4].view(np.float32)
    average[...] = np.arange(37) * (ctx.rank + 1)
    group.allreduce(average, make_reducer(Sum, average.dtype), deadline,
                    finish=lambda x: np.divide(x, ctx.size, out=x))
    out["average"] = average.tobytes()
    out["taken"] = len(taken)
    group.barrier(deadline)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shared_allreduce_matches_numpy(size):
    results = _launch(size, _sweep, timeout=40)
    if size == 1:  # nothing to share with: the caller keeps ordinary memory
        assert results[0]["buffers"] == [None, None]
        return
    for rank in range(size):
        got = results[rank]
        assert got["zeros"] == [True, True]
        for count in _counts(size):
            for dtype in _DTYPES:
                for name, (_, ufunc) in _OPS.items():
                    salt, data = got[count, dtype, name]
                    assert data == _expected(count, dtype, ufunc, size, salt), \
                        (rank, count, dtype, name)
            plain = _expected(count, "float32", np.add, size, 0)
            assert got[count, "plain"] == plain
        want = (np.arange(37) * sum(range(1, size + 1)) / np.float32(size)).astype(np.float32)
        assert np.frombuffer(got["average"], np.float32).tolist() == want.tolist()
        assert got["taken"] == len(_counts(size)) * len(_DTYPES) * len(_OPS) + 1


def _mixed(ctx: Rank):
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT)
    raw = group.shared_buffer(200)  # below a slot: every rank shares, or it is a mismatch
    data = np.ones(50, np.float32) if ctx.rank == 1 else raw.view(np.float32)
    return _raises(group.allreduce, data, make_reducer(Sum, data.dtype),
                   time.monotonic() + 10, lambda waited: None, 0x1234)


@pytest.mark.multiprocess
def test_a_rank_without_a_shared_buffer_below_a_slot_is_a_mismatch_on_every_rank():
    results = _launch(3, _mixed)
    for rank in range(3):
        name, message, _ = results[rank]
        assert name == "CollectiveMismatchError", message
        assert "on shared buffers" in message and "local rank 1 (rank 1) allreduce of" in message


def _offered(ctx: Rank, plain_ranks: tuple):
    """Allreduces of a slot or more where the ranks in ``plain_ranks`` pass private arrays and
    the others shared buffers, then one where all share; counts the shared folds."""
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT)
    taken = []
    shared_road = group._fold_shared
    group._fold_shared = lambda *a: (taken.append(1), shared_road(*a))
    deadline = time.monotonic() + 20
    raw = group.shared_buffer(1001 * 4)
    out = []
    for salt, count in enumerate((_SLOT // 4, 1001)):  # exactly a slot; many pieces
        data = (np.empty(count, np.float32) if ctx.rank in plain_ranks
                else raw[:count * 4].view(np.float32))
        data[...] = _input(count, "float32", ctx.rank, salt)
        group.allreduce(data, make_reducer(Sum, data.dtype), deadline, signature=salt)
        out.append((salt, count, data.tobytes()))
    mixed = len(taken)
    data = raw.view(np.float32)
    data[...] = _input(1001, "float32", ctx.rank, 9)
    group.allreduce(data, make_reducer(Sum, data.dtype), deadline, signature=9)
    out.append((9, 1001, data.tobytes()))
    group.barrier(deadline)
    return out, mixed, len(taken) - mixed


@pytest.mark.multiprocess
@pytest.mark.parametrize("size,plain", [(2, (1,)), (3, (0,)), (3, (0, 2)), (4, (3,))])
def test_from_a_slot_on_a_rank_without_a_shared_buffer_meets_the_others_on_the_slots(size,
                                                                                    plain):
    results = _launch(size, _offered, plain)
    for rank in range(size):
        out, mixed, shared = results[rank]
        assert mixed == 0 and shared == 1, (rank, mixed, shared)
        for salt, count, data in out:
            assert data == _expected(count, "float32", np.add, size, salt), (rank, count)


def _killed(ctx: Rank):
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT)
    data = group.shared_buffer(4000).view(np.float32)
    data[...] = 1
    deadline = time.monotonic() + 20
    group.allreduce(data, make_reducer(Sum, data.dtype), deadline)  # maps the others' buffers
    if ctx.rank == 2:  # dies after arriving at the second, before folding its part
        group._peer_buffer = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    return _raises(group.allreduce, data, make_reducer(Sum, data.dtype), deadline)


@pytest.mark.multiprocess
def test_a_rank_killed_in_a_shared_allreduce_is_lost_on_the_others():
    assert_rank_2_lost(_launch(3, _killed, expect=2))


def _released(ctx: Rank):
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT)
    deadline = time.monotonic() + 20
    kept = []
    for i in range(shm._MAPPED_KEPT + 4):  # more than the mappings kept of each peer
        data = group.shared_buffer(4096).view(np.int64)
        data[...] = ctx.rank + i
        group.allreduce(data, make_reducer(Sum, data.dtype), deadline)
        kept.append(data)
    sums = [int(d[0]) for d in kept]
    mapped = len(group._mapped)
    fds = {group._shared[d.ctypes.data][0]: os.readlink(
        f"/proc/self/fd/{group._shared[d.ctypes.data][0]}") for d in kept}
    first = kept[0]
    group.release(first.ctypes.data)
    after = group.is_shared(first)
    group.allreduce(first, make_reducer(Sum, first.dtype), deadline)  # now on the slots
    for d in kept[1:]:
        group.release(d.ctypes.data)
    still_open = [fd for fd, target in fds.items() if _target(fd) == target]
    group.barrier(deadline)  # every rank has released all of its buffers
    fresh = group.shared_buffer(4096).view(np.int64)
    fresh[...] = 1
    group.allreduce(fresh, make_reducer(Sum, fresh.dtype), deadline)
    left = len(group._mapped)  # the released buffers' mappings are gone; the new one stays
    group.barrier(deadline)
    return sums, mapped, after, int(first[0]), len(fds), still_open, left, int(fresh[0])


def _target(fd: int) -> "str | None":
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


@pytest.mark.multiprocess
def test_released_buffers_close_and_peers_drop_them_and_keep_a_bounded_number():
    results = _launch(2, _released)
    for rank in (0, 1):
        sums, mapped, shared_after, first, fds, still_open, left, fresh = results[rank]
        assert sums == [1 + 2 * i for i in range(shm._MAPPED_KEPT + 4)]
        assert mapped == shm._MAPPED_KEPT  # one peer
        assert shared_after is False and first == 2 * 1
        assert fds == shm._MAPPED_KEPT + 4 and still_open == []  # released: closed
        assert left == 1 and fresh == 2


def test_a_peer_buffer_that_is_not_the_one_published_is_refused():
    fd = os.memfd_create("something-else")
    try:
        os.ftruncate(fd, 64)
        other = shm._identity(os.fstat(fd)) ^ 1
        with pytest.raises(GradsyncError, match="descriptor .* is another file than the shared"):
            shm._map_peer_buffer(os.getpid(), fd, other, 3)
        assert shm._map_peer_buffer(os.getpid(), fd, shm._identity(os.fstat(fd)), 3).size == 64
    finally:
        os.close(fd)
    with pytest.raises(GradsyncError, match="cannot map rank 3's shared buffer"):
        shm._map_peer_buffer(os.getpid(), 10**6, 7, 3)


def _adopted(ctx: Rank):
    """Each rank adopts a mapping of a file it opened itself (as torch's ``_share_fd_cpu_``
    leaves one), reduces on it, then closes that file and reduces again at the same address."""
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT)
    taken = []
    shared_road = group._fold_shared
    group._fold_shared = lambda *a: (taken.append(1), shared_road(*a))
    deadline = time.monotonic() + 20
    fd = os.memfd_create("owned-by-the-caller")
    os.ftruncate(fd, 1001 * 4)
    data = np.frombuffer(mmap.mmap(fd, 1001 * 4), np.float32)
    adopted = group.adopt(data.ctypes.data, fd, data.nbytes)
    again = group.adopt(data.ctypes.data, fd, data.nbytes)  # already held: nothing changes
    too_small = group.adopt(data.ctypes.data, fd, data.nbytes + 1)
    data[...] = _input(1001, "float32", ctx.rank, 1)
    group.allreduce(data, make_reducer(Sum, data.dtype), deadline, signature=1)
    first = data.tobytes()
    group.release(data.ctypes.data)  # forgotten, not closed: the caller owns the descriptor
    still_open = _target(fd) is not None
    group.adopt(data.ctypes.data, fd, data.nbytes)
    os.close(fd)  # the owner frees it; the address still holds memory (the mapping)
    stale = group.is_shared(data)  # looked at again: no longer the file adopted
    data[...] = _input(1001, "float32", ctx.rank, 2)
    group.allreduce(data, make_reducer(Sum, data.dtype), deadline, signature=2)
    group.barrier(deadline)
    return adopted, again, too_small, first, still_open, stale, data.tobytes(), len(taken)


@pytest.mark.multiprocess
def test_adopted_buffers_take_the_shared_road_and_are_forgotten_once_their_file_is_gone():
    results = _launch(3, _adopted)
    for rank in range(3):
        adopted, again, too_small, first, still_open, stale, second, taken = results[rank]
        assert (adopted, again, too_small) == (True, True, False)
        assert first == _expected(1001, "float32", np.add, 3, 1)
        assert still_open and stale is False
        assert second == _expected(1001, "float32", np.add, 3, 2)
        assert taken == 1  # the first allreduce; the second ran on the slots


def test_adopting_needs_a_group_of_several_ranks():
    job = f"t{os.getpid()}adopt"
    group = ShmGroup.open(job, 0, 1, lambda: None, slot_bytes=_SLOT)
    try:
        fd = os.memfd_create("one-rank")
        os.ftruncate(fd, 4096)
        assert group.adopt(12345, fd, 4096) is False
        os.close(fd)
    finally:
        group.close()


def _adopted_head(ctx: Rank):
    """Rank 0 alone adopts a buffer; every rank then reduces the buffer's first bytes (fewer
    than a slot, as a gradient viewing a DDP bucket's start) and the whole of it."""
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT)
    deadline = time.monotonic() + 20
    fd = os.memfd_create("a-bucket")
    os.ftruncate(fd, 1001 * 4)
    data = np.frombuffer(mmap.mmap(fd, 1001 * 4), np.float32)
    if ctx.rank == 0:
        assert group.adopt(data.ctypes.data, fd, data.nbytes)
    head = data[:10]
    head[...] = _input(10, "float32", ctx.rank, 3)
    group.allreduce(head, make_reducer(Sum, head.dtype), deadline, signature=3)
    reduced_head = head.tobytes()
    data[...] = _input(1001, "float32", ctx.rank, 4)
    group.allreduce(data, make_reducer(Sum, data.dtype), deadline, signature=4)
    group.barrier(deadline)
    return reduced_head, data.tobytes()


@pytest.mark.multiprocess
def test_an_allreduce_below_a_slot_at_an_adopted_buffer_takes_the_slots_whoever_adopted():
    results = _launch(3, _adopted_head)
    for rank in range(3):
        head, whole = results[rank]
        assert head == _expected(10, "float32", np.add, 3, 3), rank
        assert whole == _expected(1001, "float32", np.add, 3, 4), rank
