"""The compiled one-step shared-memory allreduce and barrier (``collectives/_shmfast.c``) and
their fallback.

Every multi-process test runs the group three ways: every rank on the compiled road
(``fast``), every rank on the Python road (``python``, what ``GRADSYNC_SHM_FAST=0`` or a
machine without a C compiler gets), and local rank 0 on the Python road beside compiled
ones (``mixed``: the two roads speak the same protocol on the same segment). Results must
be bitwise equal to a NumPy reduction in local-rank order; failures must end in the same
errors as on the Python road. Ranks are forked by ``test_shm._launch`` (a deadline, stacks
dumped on a hang, nothing left in /dev/shm).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
import zlib

import numpy as np
import pytest

from gradsync import _native
from gradsync.collectives.ops import Average, Max, Min, Product, Sum, make_reducer
from gradsync.transport.host_segment import ShmGroup
from gradsync.config import load_config
from gradsync.collectives.ops import scale
from test_shm import Rank, _launch, _raises

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")

_SLOT = 8192  # bytes; every count below but the last fits one slot: the one-step road
_DTYPES = ("float32", "float64", "int32", "int64", "float16")  # float16: Python road always
_OPS = {"sum": (Sum, False), "average": (Average, False), "average_trunc": (Average, True),
        "min": (Min, False), "max": (Max, False), "product": (Product, False)}
_MODES = ("fast", "python", "mixed")


@pytest.fixture(scope="module", autouse=True)
def _compiled():
    """The compiled road must be buildable here, or the tests of it would test nothing."""
    if _native.load("_shmfast") is None:
        pytest.fail("the compiled shared-memory road cannot be built: install a C compiler "
                    "and Python's headers (apt-get install -y gcc python3-dev)")


def _counts(size: int) -> list[int]:
    # empty, one, fewer than the ranks, uneven, most of a slot, and two pieces (two-step road)
    return sorted({0, 1, max(size - 1, 0), 37, 1001, 3000})


def _input(count: int, dtype: str, rank: int, size: int) -> np.ndarray:
    # Small integers: sums and products are exact in every dtype, whatever the order.
    data = (((np.arange(count) * 7 + rank * 5) % 11) - 5).astype(dtype)
    if dtype in ("float32", "float64") and count > 2 and rank == size - 1:
        data[2] = np.nan  # every op propagates it, as NumPy's ufuncs do
    return data


def _reference(count: int, dtype: str, opname: str, size: int) -> bytes:
    op, trunc = _OPS[opname]
    ufunc = {Sum: np.add, Average: np.add, Min: np.minimum, Max: np.maximum,
             Product: np.multiply}[op]
    result = functools.reduce(ufunc, [_input(count, dtype, r, size) for r in range(size)])
    if op is Average and size > 1:
        if np.dtype(dtype).kind == "f":
            result = np.divide(result, size)
        else:  # exact: the values are small integers
            quotient = result.astype(np.float64) / size
            result = (np.trunc(quotient) if trunc else np.floor(quotient)).astype(dtype)
    return result.astype(dtype).tobytes()


def _uses_fast(mode: str, rank: int) -> bool:
    return mode == "fast" or (mode == "mixed" and rank > 0)


def _open(ctx: Rank, mode: str) -> ShmGroup:
    return ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT,
                         small_bytes=_SLOT, fast=_uses_fast(mode, ctx.rank))


def _allreduce(group: ShmGroup, data: np.ndarray, opname: str, deadline: float,
               signature: int = 0, on_idle=lambda waited: None) -> None:
    """As ``operations.allreduce`` calls the group: the op for the compiled road, and the
    reducer and the Average's division for the Python road."""
    op, trunc = _OPS[opname]
    average = op is Average and group.size > 1
    finish = None
    if average:
        def finish(part):
            scale(part, part.dtype, group.size, divide=True, trunc=trunc)
    group.allreduce(data, make_reducer(op, data.dtype), deadline, on_idle, signature, finish,
                    op, group.size if average else 0, trunc)


def _sweep(ctx: Rank, mode: str):
    group = _open(ctx, mode)
    out = {"fast": group.fast}
    deadline = time.monotonic() + 20
    for count in _counts(ctx.size):
        for dtype in _DTYPES:
            for opname, (op, _) in _OPS.items():
                if dtype == "float16" and op is Average:
                    continue  # torch's and NumPy's half division may round differently
                data = _input(count, dtype, ctx.rank, ctx.size)
                key = (count, dtype, opname)
                _allreduce(group, data, opname, deadline, zlib.crc32(repr(key).encode()))
                out[key] = data.tobytes()
    group.barrier(deadline)
    return out


@pytest.mark.parametrize("size,mode", [(1, "fast"), (2, "fast"), (3, "fast"), (4, "fast"),
                                       (2, "python"), (3, "python"), (4, "python"),
                                       (2, "mixed"), (3, "mixed")])
def test_allreduce_matches_numpy_on_both_roads(size, mode):
    results = _launch(size, _sweep, mode, timeout=60)
    for rank in range(size):
        assert results[rank]["fast"] == _uses_fast(mode, rank), (rank, mode)
    for count in _counts(size):
        for dtype in _DTYPES:
            for opname, (op, _) in _OPS.items():
                if dtype == "float16" and op is Average:
                    continue
                want = _reference(count, dtype, opname, size)
                for rank in range(size):  # bitwise equal to NumPy, hence across ranks
                    got = results[rank][count, dtype, opname]
                    assert got == want, (count, dtype, opname, rank,
                                         np.frombuffer(got, dtype)[:8],
                                         np.frombuffer(want, dtype)[:8])


def _killed(ctx: Rank, mode: str, then: str):
    group = _open(ctx, mode)
    data = np.ones(100, np.float32)
    deadline = time.monotonic() + 20
    for _ in range(2):
        _allreduce(group, data, "sum", deadline)
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # dies between two small allreduces
    if then == "barrier":  # and a barrier after that failure: the compiled road refuses it
        return (*_raises(group.barrier, deadline), _raises(group.barrier, deadline)[0])
    return _raises(_allreduce, group, data, "sum", deadline)


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("then", ["allreduce", "barrier"])
def test_killed_rank_raises_peer_lost_on_the_others(mode, then):
    results = _launch(3, _killed, mode, then, expect=2)
    for rank in (0, 1):
        name, message, seconds = results[rank][:3]
        assert name == "PeerLostError" and "local rank 2 (rank 2)" in message, message
        assert seconds < 3.0
        if then == "barrier" and _uses_fast(mode, rank):  # "unusable after an earlier failure"
            assert results[rank][3] == "GradsyncError", results[rank]


def _silent(ctx: Rank, mode: str):
    group = _open(ctx, mode)
    if ctx.rank == 1:
        ctx.barrier()  # stays alive but never joins the collective
        return None
    idle: list[float] = []
    result = _raises(_allreduce, group, np.ones(10, np.int64), "sum",
                     time.monotonic() + 0.3, 0, idle.append)
    ctx.barrier()
    return result, len(idle)


@pytest.mark.parametrize("mode", ["fast", "python"])
def test_silent_peer_times_out_naming_it(mode):
    results = _launch(2, _silent, mode)
    (name, message, seconds), idle_calls = results[0]
    assert name == "GradsyncTimeoutError" and "local rank(s) [1]" in message, message
    assert 0.3 <= seconds < 2.0 and idle_calls >= 3


def _mismatch(ctx: Rank, mode: str, how: str):
    group = _open(ctx, mode)
    odd = ctx.rank == 1
    data = np.ones(100 if how == "size" and odd else 50, np.float32)
    deadline = time.monotonic() + 10
    if how == "kind" and odd:
        return _raises(group.barrier, deadline, lambda waited: None, 0x1234)
    return _raises(_allreduce, group, data, "sum", deadline,
                   0xBAD if how == "signature" and odd else 0x1234)


@pytest.mark.parametrize("mode", ["fast", "mixed"])
@pytest.mark.parametrize("how", ["signature", "size", "kind"])
def test_mismatched_collectives_raise_on_every_rank(mode, how):
    results = _launch(3, _mismatch, mode, how)
    for rank in range(3):
        name, message, _ = results[rank]
        assert name == "CollectiveMismatchError", message
        assert "local rank 1 (rank 1)" in message and "0x1234" in message, message


def _late(ctx: Rank, mode: str, delays: list[float], barrier: bool = False):
    """Rank 1 arrives late by each delay: inside the compiled wait's futex phase (30 ms)
    and past its budget (300 ms, where Python takes the wait over), at an allreduce, or at
    a barrier followed by an allreduce (which shows the pieces still pair up)."""
    group = _open(ctx, mode)
    data = np.full(10, float(ctx.rank + 1))
    deadline = time.monotonic() + 10
    waited, arrived, left = [], [], []
    for delay in delays:
        if ctx.rank == 1:
            time.sleep(delay)
        arrived.append(time.monotonic())  # one clock for every process on the host
        if barrier:
            group.barrier(deadline, lambda waited: None, 0x5EED)
        else:
            _allreduce(group, data, "sum", deadline)
        left.append(time.monotonic())
        waited.append(left[-1] - arrived[-1])
        if barrier:
            _allreduce(group, data, "sum", deadline)
    return group.fast, data.tolist(), waited, arrived, left


@pytest.mark.parametrize("mode", ["fast", "mixed"])
def test_late_peer_is_waited_for_and_woken(mode):
    delays = [0.03, 0.3, 0.0]
    results = _launch(2, _late, mode, delays)
    for rank in (0, 1):
        _, data, *_ = results[rank]
        assert data == [3.0 * 2 ** (len(delays) - 1)] * 10  # 1 + 2, doubled twice more
    assert max(results[0][2]) < 2.0, results[0][2]  # no wake-up was lost for long


@pytest.mark.parametrize("mode", _MODES)
def test_barrier_waits_for_the_last_rank_on_both_roads(mode):
    delays = [0.03, 0.3, 0.0]
    results = _launch(3, _late, mode, delays, True)
    late_arrived = results[1][3]
    for rank in range(3):
        fast, data, waited, _, left = results[rank]
        assert fast == _uses_fast(mode, rank), (rank, mode)
        assert data == [6.0 * 3 ** (len(delays) - 1)] * 10  # 1 + 2 + 3, tripled twice more
        assert max(waited) < 2.0, waited  # no wake-up was lost for long
        # No one leaves before the late rank came: compared on the host's one monotonic
        # clock, not as a wait of at least the delay (a rank that itself came late to the
        # round waits less than the delay, and rightly).
        assert all(out >= came for out, came in zip(left, late_arrived)), (rank, left, late_arrived)


def test_the_compiled_call_refuses_a_barrier_with_data_or_an_unknown_kind():
    module = _native.load("_shmfast")
    segment = bytearray(4096 + 2 * 2 * 1024)  # control lines, then two slots per rank
    group = module.open(segment, 0, 2, 1024, 4096, False, 0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="a barrier takes none"):
        module.call(group, np.ones(4, np.float32), 1, 0, 0, 0, False, 3)
    with pytest.raises(ValueError, match="kind 9"):
        module.call(group, np.ones(4, np.float32), 1, 0, 0, 0, False, 9)
    with pytest.raises(TypeError, match="7 or 8 arguments"):
        module.call(group, np.ones(4, np.float32), 1, 0, 0, 0)


# --- the fallback ------------------------------------------------------------------------------

@pytest.fixture
def no_installed(monkeypatch):
    """Hides a module built at install time (an editable install builds one beside the
    source), so that the cache's first-use build and its failures are what these tests see;
    forked ranks inherit it. tests/test_native_build.py tests the installed module."""
    monkeypatch.setattr(_native, "_installed", lambda name: None)
    monkeypatch.setattr(_native, "_warned", set())  # each test counts its own warnings


def test_no_compiler_gives_none_and_one_warning(caplog, no_installed):
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        assert _native.load("_shmfast", compiler="/nonexistent/cc") is None
        assert _native.load("_shmfast", compiler="/nonexistent/cc") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no C compiler" in lines[0] and "Python path" in lines[0], lines
    assert "apt-get install gcc python3-dev" in lines[0], lines  # the fix, named


def test_missing_python_headers_are_named(caplog, no_installed, tmp_path, monkeypatch):
    # A compiler that fails as gcc does without python3-dev.
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho \"_shmfast.c:1:10: fatal error: Python.h: No such file or "
                  "directory\" >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="gradsync"):
        assert _native.load("_shmfast", compiler=str(cc)) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "Python's headers are missing" in lines[0], lines
    assert "python3-dev" in lines[0] and "gradsync build-native" in lines[0], lines


def _fallback(ctx: Rank):
    group = _open(ctx, "fast")  # asks for the compiled road: not built, and a group never builds
    data = np.arange(20, dtype=np.float32) * (ctx.rank + 1)
    _allreduce(group, data, "average", time.monotonic() + 10)
    return group.fast, data.tolist()


def test_without_a_compiler_groups_take_the_python_road(monkeypatch, tmp_path, no_installed):
    # The ranks fork from here: they inherit a bad $CC, an empty cache and no loaded module.
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(_native, "_loaded", {})
    results = _launch(3, _fallback)
    for rank in range(3):
        fast, data = results[rank]
        assert fast is False and data == [2.0 * i for i in range(20)]  # (1 + 2 + 3) / 3


def test_the_module_is_built_once_into_the_cache(monkeypatch, tmp_path, no_installed):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(_native, "_loaded", {})
    compiles = []
    run = _native.subprocess.run
    monkeypatch.setattr(_native.subprocess, "run",
                        lambda *a, **kw: (compiles.append(a), run(*a, **kw))[1])
    module = _native.load("_shmfast")
    assert module is not None and module.__file__.startswith(str(tmp_path / "gradsync"))
    built = [f for f in os.listdir(tmp_path / "gradsync") if f.endswith(".so")]
    assert len(built) == 1 and len(compiles) == 1
    first = os.stat(module.__file__)
    monkeypatch.setattr(_native, "_loaded", {})  # a new process, as far as load can tell
    assert _native.load("_shmfast").__file__ == module.__file__
    # loaded, not rebuilt: no compile, and the same file (a rebuild moves a new one into place)
    again = os.stat(module.__file__)
    assert len(compiles) == 1, compiles
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)


def test_config_switches_the_compiled_road_off():
    assert load_config(environ={}).shm_fast is True
    assert load_config(environ={"GRADSYNC_SHM_FAST": "0"}).shm_fast is False


def test_close_unmaps_the_segment_once_the_compiled_road_lets_go():
    # The compiled group holds a buffer export of the segment (no call can outlive the
    # mapping); close() drops it first, so the mapping really goes.
    group = ShmGroup.open(f"t{os.getpid()}x", 0, 1, lambda: None, slot_bytes=_SLOT)
    segment = group._segment
    assert group.fast and not segment.closed
    group.close()
    assert segment.closed
