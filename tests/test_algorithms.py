"""The collective algorithms, ranks as threads over in-memory pairs, against a NumPy reference.

Inputs are closed-form (rank ``r`` contributes small integers such as ``(r + 1) * (i % 7 + 1)``),
so every partial result is exact in every dtype and the reduction order cannot change the
answer; ``test_same_bits_on_every_rank`` uses random floats, where it would. A small
``chunk_bytes`` makes short vectors take the multi-segment paths.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import traceback

import numpy as np
import pytest
import torch

from gradsync.collectives import allgather, alltoall, doubling, halving_doubling, ring, tree
from gradsync.collectives.ops import BFLOAT16, Max, Min, Product, Sum, make_reducer
from gradsync.errors import PeerLostError, ProtocolError
from gradsync.transport.local import local_comms

SIZES = [1, 2, 3, 4, 5, 7, 8]
CHUNK = 64  # bytes per segment: 16 float32 elements, so "multi" vectors span many segments
COMM_TIMEOUT = 5.0  # a rank waiting on a live but silent peer raises after this
DEADLINE = 15.0  # a test whose ranks are not all done by then fails with their stacks

ALLREDUCES = {
    "ring": lambda comm, data, reducer: ring.allreduce(comm, data, reducer, CHUNK),
    "doubling": doubling.allreduce,
    "halving_doubling": halving_doubling.allreduce,
}
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8, np.float16, np.bool_, BFLOAT16]
OPS = [Sum, Min, Max, Product]
_UFUNCS = {Sum: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply}


def element_count(kind: str, n: int) -> int:
    """The element counts every algorithm is swept over, for world size ``n``."""
    return {"zero": 0, "one": 1, "fewer": max(n - 1, 1), "uneven": 3 * n + 1,
            "multi": 16 * 3 * n + 5}[kind]


COUNTS = ["zero", "one", "fewer", "uneven", "multi"]


def run_ranks(n: int, fn, deadline: float = DEADLINE):
    """Runs ``fn(comm)`` on ``n`` threads, one per rank, each after ``comm.begin``.

    Returns ``(results, errors)``, one entry per rank. A rank that raises closes its comm, as a
    dying process closes its sockets, so its peers fail fast instead of waiting it out. A rank
    still running at the deadline fails the test with every stuck thread's stack.
    """
    comms = local_comms(n, timeout=COMM_TIMEOUT)
    results: list = [None] * n
    errors: list = [None] * n

    def body(rank: int) -> None:
        try:
            comms[rank].begin("test collective")
            results[rank] = fn(comms[rank])
        except BaseException as exc:  # noqa: BLE001 - handed to the test to judge
            errors[rank] = exc
            comms[rank].close()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank-{r}", daemon=True)
               for r in range(n)]
    for thread in threads:
        thread.start()
    end = time.monotonic() + deadline
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    stuck = [t for t in threads if t.is_alive()]
    if stuck:
        frames = sys._current_frames()
        dump = "\n".join(f"{t.name}:\n" + "".join(traceback.format_stack(frames[t.ident]))
                         for t in stuck if t.ident in frames)
        pytest.fail(f"{len(stuck)} rank(s) still running after {deadline}s:\n{dump}")
    for comm in comms:
        comm.close()
    return results, errors


def run_ok(n: int, fn) -> list:
    """``run_ranks`` for runs that must succeed: re-raises the first rank's error."""
    results, errors = run_ranks(n, fn)
    for rank, exc in enumerate(errors):
        if exc is not None:
            raise AssertionError(f"rank {rank} raised {exc!r}") from exc
    return results


# --- inputs and reference ---------------------------------------------------------------

def storage(dtype):
    """The NumPy dtype that carries ``dtype``."""
    return np.dtype(np.uint16) if dtype == BFLOAT16 else np.dtype(dtype)


def cast(values: np.ndarray, dtype) -> np.ndarray:
    """``values`` in ``dtype``; bfloat16 as its uint16 bit patterns."""
    if dtype == BFLOAT16:
        bf16 = torch.from_numpy(np.asarray(values, dtype=np.float32)).to(torch.bfloat16)
        return bf16.view(torch.int16).numpy().view(np.uint16).copy()
    return np.asarray(values).astype(dtype)


def contribution(rank: int, count: int, dtype, op) -> np.ndarray:
    """Rank ``rank``'s input: small integers, so every partial result is exact."""
    i = np.arange(count)
    if dtype == np.bool_:
        return cast((i >> rank) & 1, np.bool_)  # AND and OR over ranks both vary with i
    if op is Product:
        return cast(1 + (i + rank) % 2, dtype)  # powers of two: exact, and uint8 wraps alike
    if op in (Min, Max):
        return cast((i * 5 + rank * 3) % 11 + 1, dtype)  # the extreme moves between ranks
    return cast((rank + 1) * (i % 7 + 1), dtype)


def reference(inputs: list[np.ndarray], dtype, op) -> np.ndarray:
    if dtype == np.bool_:
        ufunc = np.logical_and if op in (Product, Min) else np.logical_or
        return functools.reduce(ufunc, inputs)
    if dtype == BFLOAT16:
        wide = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).double().numpy()
                for x in inputs]
        return cast(functools.reduce(_UFUNCS[op], wide), BFLOAT16)
    return functools.reduce(_UFUNCS[op], inputs)


def uneven_counts(total: int, n: int) -> list[int]:
    """Near-even counts with block 1 emptied into block 0: zeros and unequal blocks."""
    counts = ring.even_counts(total, n)
    if n > 1:
        counts[0], counts[1] = counts[0] + counts[1], 0
    return counts


def assert_same_everywhere(results: list[np.ndarray], expected: np.ndarray) -> None:
    for rank, got in enumerate(results):
        assert got.dtype == expected.dtype
        assert got.tobytes() == expected.tobytes(), f"rank {rank}: {got} != {expected}"


# --- allreduce, reduce-scatter, reduce ---------------------------------------------------

def allreduce_case(algorithm: str, n: int, count: int, dtype, op) -> None:
    inputs = [contribution(r, count, dtype, op) for r in range(n)]
    reducer = make_reducer(op, dtype)

    def rank_fn(comm):
        data = inputs[comm.rank].copy()
        ALLREDUCES[algorithm](comm, data, reducer)
        return data

    assert_same_everywhere(run_ok(n, rank_fn), reference(inputs, dtype, op))


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
def test_allreduce_sweep(algorithm, n, count):
    allreduce_case(algorithm, n, element_count(count, n), np.float32, Sum)


@pytest.mark.parametrize("op", OPS, ids=repr)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name if d != BFLOAT16 else d)
@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
def test_allreduce_dtypes_and_ops(algorithm, dtype, op):
    allreduce_case(algorithm, 5, element_count("multi", 5), dtype, op)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BFLOAT16],
                         ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [3, 4, 5, 8])
@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
def test_same_bits_on_every_rank(algorithm, n, dtype):
    # Random floats: here the reduction order changes the rounding, so equal bits on every
    # rank are a property of the algorithm, not of the inputs.
    rng = np.random.default_rng(n)
    inputs = [cast(rng.standard_normal(element_count("multi", n)), dtype) for _ in range(n)]
    reducer = make_reducer(Sum, dtype)

    def rank_fn(comm):
        data = inputs[comm.rank].copy()
        ALLREDUCES[algorithm](comm, data, reducer)
        return data

    results = run_ok(n, rank_fn)
    assert all(r.tobytes() == results[0].tobytes() for r in results)
    as_float = (lambda x: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).double().numpy()
                ) if dtype == BFLOAT16 else (lambda x: x.astype(np.float64))
    exact = sum(as_float(x) for x in inputs)
    np.testing.assert_allclose(as_float(results[0]), exact, rtol=0.05, atol=0.1 * n)


@pytest.mark.parametrize("into_own", [False, True], ids=["", "into_own"])
@pytest.mark.parametrize("from_source", [False, True], ids=["in_place", "from_source"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter(n, count, from_source, into_own):
    counts = uneven_counts(element_count(count, n), n)
    offsets = ring.block_offsets(counts, n, sum(counts))
    inputs = [contribution(r, sum(counts), np.float32, Sum) for r in range(n)]
    expected = reference(inputs, np.float32, Sum)
    reducer = make_reducer(Sum, np.float32)
    sentinel = np.float32(-7.5)  # no sum of the contributions

    def rank_fn(comm):
        # ``own``: this rank's block of the result goes there, not into ``data``.
        own = np.full(counts[comm.rank], sentinel, np.float32) if into_own else None
        if not from_source:
            data = inputs[comm.rank].copy()
            ring.reduce_scatter(comm, data, counts, reducer, CHUNK, own=own)
            return data, None, own
        # The contribution is read from ``source`` and only written into ``data``.
        source = inputs[comm.rank].copy()
        data = np.full_like(source, sentinel)
        ring.reduce_scatter(comm, data, counts, reducer, CHUNK, source=source, own=own)
        return data, source, own

    for rank, (got, source, own) in enumerate(run_ok(n, rank_fn)):
        block = slice(offsets[rank], offsets[rank + 1])
        if into_own:
            np.testing.assert_array_equal(own, expected[block])
            if n > 1 and from_source:  # folded into ``own`` only
                assert (got[block] == sentinel).all()
        else:
            np.testing.assert_array_equal(got[block], expected[block])
        if from_source:
            np.testing.assert_array_equal(source, inputs[rank])  # left unwritten
            if n > 1:  # the block sent first goes out of source, unfolded, and is not copied
                first = (rank - 1) % n
                assert (got[offsets[first]:offsets[first + 1]] == sentinel).all()


@pytest.mark.parametrize("dtype", [np.int64, np.float16, BFLOAT16],
                         ids=["int64", "float16", "bfloat16"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("n", SIZES)
def test_tree_reduce(n, count, dtype):
    total = element_count(count, n)
    inputs = [contribution(r, total, dtype, Sum) for r in range(n)]
    expected = reference(inputs, dtype, Sum)
    reducer = make_reducer(Sum, dtype)

    for root in sorted({0, n // 2, n - 1}):
        def rank_fn(comm):
            data = inputs[comm.rank].copy()
            tree.reduce(comm, data, root, reducer)
            return data

        got = run_ok(n, rank_fn)[root]
        assert got.tobytes() == expected.tobytes(), f"root {root}"


# --- allgather, broadcast, alltoall -----------------------------------------------------

def labelled(total: int, dtype) -> list[np.ndarray]:
    """One distinct vector per rank (a rank's own blocks are told apart by value)."""
    return [cast((np.arange(total) * 7 + 3 * r) % 251, dtype) for r in range(8)]


@pytest.mark.parametrize("dtype", [np.float32, np.uint8, np.float64], ids=["f32", "u8", "f64"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("n", SIZES)
def test_allgather(n, count, dtype):
    counts = uneven_counts(element_count(count, n), n)
    offsets = ring.block_offsets(counts, n, sum(counts))
    expected = labelled(sum(counts), dtype)[0]

    def rank_fn(comm):
        data = np.zeros_like(expected)
        own = slice(offsets[comm.rank], offsets[comm.rank + 1])
        data[own] = expected[own]
        ring.allgather(comm, data, counts, CHUNK)
        return data

    assert_same_everywhere(run_ok(n, rank_fn), expected)


@pytest.mark.parametrize("dtype", [np.uint8, np.float32], ids=["u8", "f32"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("n", range(1, 9))
def test_bruck_allgather_is_the_rings(n, count, dtype):
    """Bruck's allgather of equal blocks (0, 1, n - 1, 3n + 1 and 48n + 5 elements: the ring's
    segments are 16 float32) leaves the bytes ``ring.allgather`` leaves, every rank's block in
    rank order, in ceil(log2 n) steps that send n - 1 blocks."""
    block = {"zero": 0, "one": 1, "fewer": n - 1, "uneven": 3 * n + 1, "multi": 48 * n + 5}[count]
    expected = labelled(n * block, dtype)[0]

    def rank_fn(comm):
        own = slice(comm.rank * block, (comm.rank + 1) * block)
        by = {}
        for algorithm in allgather.ALGORITHMS:
            data = np.zeros_like(expected)
            data[own] = expected[own]
            counting = Counting(comm)
            allgather.uniform(counting, data, algorithm, CHUNK)
            by[algorithm] = data, counting
        return by

    for r, by in enumerate(run_ok(n, rank_fn)):
        (bruck, counted), (ringed, _) = by["bruck"], by["ring"]
        assert ringed.tobytes() == expected.tobytes(), f"rank {r}"
        assert bruck.tobytes() == ringed.tobytes(), f"rank {r}: {bruck} != {ringed}"
        assert (counted.steps, counted.sent) == ((n - 1).bit_length(),
                                                 (n - 1) * block * expected.itemsize)


@pytest.mark.parametrize("dtype", [np.float32, np.bool_, np.float16], ids=["f32", "bool", "f16"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("n", SIZES)
def test_broadcast(n, count, dtype):
    vectors = labelled(element_count(count, n), dtype)
    for root in sorted({0, n // 2, n - 1}):
        def rank_fn(comm):
            data = vectors[root].copy() if comm.rank == root else np.zeros_like(vectors[0])
            tree.broadcast(comm, data, root, CHUNK)
            return data

        assert_same_everywhere(run_ok(n, rank_fn), vectors[root])


def pair_count(src: int, dst: int, base: int) -> int:
    """Elements ``src`` sends ``dst``: uneven, and zero for some pairs when ``base`` is 0."""
    return base + (src * 3 + dst) % 4 if base else (src + dst) % 2


@pytest.mark.parametrize("base", [0, 1, 40])
@pytest.mark.parametrize("n", SIZES)
def test_alltoall(n, base):
    def block(src: int, dst: int) -> np.ndarray:
        return np.arange(pair_count(src, dst, base), dtype=np.int32) + 1000 * src + 100 * dst

    def rank_fn(comm):
        r = comm.rank
        send_counts = [pair_count(r, d, base) for d in range(n)]
        recv_counts = [pair_count(s, r, base) for s in range(n)]
        send = np.concatenate([block(r, d) for d in range(n)])
        recv = np.full(sum(recv_counts), -1, dtype=np.int32)
        alltoall.alltoall(comm, send, send_counts, recv, recv_counts)
        return recv

    for r, got in enumerate(run_ok(n, rank_fn)):
        np.testing.assert_array_equal(got, np.concatenate([block(s, r) for s in range(n)]))


def uniform_block(src: int, dst: int, count: int, dtype) -> np.ndarray:
    """Rank ``src``'s block for rank ``dst``: distinct for every pair (mod 251, so uint8 too)."""
    return cast((np.arange(count) * 7 + 3 * src + 11 * dst) % 251, dtype)


class Counting:
    """A communicator that counts its exchanges (the steps a rank takes) and the bytes it
    sends, and passes them on."""

    def __init__(self, comm):
        self._comm, self.steps, self.sent = comm, 0, 0

    def exchange(self, sends=(), recvs=(), lend=False):
        self.steps += 1
        self.sent += sum(memoryview(buf).nbytes for _, buf in sends)
        self._comm.exchange(sends, recvs, lend)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def uniform_case(algorithm: str, n: int, block: int, dtype) -> list[int]:
    """Runs ``alltoall.uniform`` and checks every rank's blocks; returns each rank's steps."""
    def rank_fn(comm):
        r = comm.rank
        send = np.concatenate([uniform_block(r, d, block, dtype) for d in range(n)])
        recv = np.zeros_like(send)
        counting = Counting(comm)
        alltoall.uniform(counting, send, recv, algorithm)
        return recv, counting.steps

    steps = []
    for r, (got, taken) in enumerate(run_ok(n, rank_fn)):
        want = np.concatenate([uniform_block(s, r, block, dtype) for s in range(n)])
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes(), f"rank {r}: {got} != {want}"
        steps.append(taken)
    return steps


@pytest.mark.parametrize("dtype", [np.uint8, np.float32, np.int64], ids=["u8", "f32", "i64"])
@pytest.mark.parametrize("count", ["zero", "one", "uneven", "multi"])
@pytest.mark.parametrize("n", SIZES)
def test_bruck_alltoall(n, count, dtype):
    """Every rank gets each rank's block for it, in ceil(log2 n) steps (odd n and non powers
    of two too); a block of 0, 1, 3n + 1 and 48n + 5 elements."""
    steps = uniform_case("bruck", n, element_count(count, n), dtype)
    assert steps == [(n - 1).bit_length()] * n


@pytest.mark.parametrize("algorithm", alltoall.ALGORITHMS)
def test_uniform_alltoall_runs_the_algorithm_named(algorithm):
    """Six ranks: Bruck's 3 steps, of 3, 2 and 2 blocks (``moving_blocks``), or the pairwise
    exchange's 5 of one block."""
    assert uniform_case(algorithm, 6, 5, np.float32) == [3 if algorithm == "bruck" else 5] * 6
    assert [alltoall.moving_blocks(6, d) for d in (1, 2, 4)] == [3, 2, 2]
    assert [alltoall.moving_blocks(5, d) for d in (1, 2, 4)] == [2, 2, 1]


# --- failures end in errors, not hangs ---------------------------------------------------

@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
def test_mismatched_lengths_raise(algorithm):
    reducer = make_reducer(Sum, np.float32)

    def rank_fn(comm):
        data = np.ones(10 if comm.rank == 0 else 12, dtype=np.float32)
        ALLREDUCES[algorithm](comm, data, reducer)

    started = time.monotonic()
    _, errors = run_ranks(3, rank_fn)
    assert any(isinstance(e, ProtocolError) for e in errors), errors
    assert all(e is None or isinstance(e, (ProtocolError, PeerLostError)) for e in errors), errors
    assert time.monotonic() - started < COMM_TIMEOUT, "a rank waited out its deadline"


@pytest.mark.parametrize("algorithm", sorted(ALLREDUCES))
def test_failing_step_propagates(algorithm):
    reduce = make_reducer(Sum, np.float32)

    def failing(dst, src):
        raise RuntimeError("reducer failed")

    def rank_fn(comm):
        data = np.ones(element_count("multi", 4), dtype=np.float32)
        ALLREDUCES[algorithm](comm, data, failing if comm.rank == 1 else reduce)
        return data

    started = time.monotonic()
    results, errors = run_ranks(4, rank_fn)
    assert isinstance(errors[1], RuntimeError) and "reducer failed" in str(errors[1])
    for rank in (0, 2, 3):
        # A peer of the failed rank learns of it from the closed connection, well before its
        # deadline; a rank that never needed rank 1 again may finish.
        assert errors[rank] is None or isinstance(errors[rank], PeerLostError), errors[rank]
    assert any(isinstance(e, PeerLostError) for e in errors), errors
    assert time.monotonic() - started < COMM_TIMEOUT, "a rank waited out its deadline"


def test_bad_arguments_raise_value_error():
    comm = local_comms(1)[0]
    comm.begin("bad arguments")
    data = np.zeros(4, dtype=np.float32)
    with pytest.raises(ValueError, match="sum to"):
        ring.reduce_scatter(comm, data, [3], make_reducer(Sum, np.float32), CHUNK)
    with pytest.raises(ValueError, match="must match"):
        ring.reduce_scatter(comm, data, [4], make_reducer(Sum, np.float32), CHUNK,
                            source=np.zeros(4, dtype=np.float64))
    with pytest.raises(ValueError, match="this rank's block"):
        ring.reduce_scatter(comm, data, [4], make_reducer(Sum, np.float32), CHUNK,
                            own=np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="counts for"):
        ring.allgather(comm, data, [2, 2], CHUNK)
    with pytest.raises(ValueError, match="chunk_bytes"):
        ring.allreduce(comm, data, make_reducer(Sum, np.float32), 0)
    with pytest.raises(ValueError, match="root"):
        tree.broadcast(comm, data, 1, CHUNK)
    with pytest.raises(ValueError, match="sends itself"):
        alltoall.alltoall(comm, data, [4], np.zeros(3, dtype=np.float32), [3])
    with pytest.raises(ValueError, match="equal length"):
        alltoall.bruck(comm, data, np.zeros(3, dtype=np.float32))
    with pytest.raises(ValueError, match="receives float64"):
        alltoall.bruck(comm, data, np.zeros(4, dtype=np.float64))
    with pytest.raises(ValueError, match="no alltoall 'star'"):
        alltoall.uniform(comm, data, data.copy(), "star")
    with pytest.raises(ValueError, match="no allgather 'star'"):
        allgather.uniform(comm, data, "star", CHUNK)
    with pytest.raises(ValueError, match="contiguous 1-D"):
        allgather.bruck(comm, data.reshape(2, 2))

