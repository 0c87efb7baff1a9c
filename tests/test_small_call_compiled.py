"""The small call's Python steps compiled (``collectives/_shmfast.c``: "The prepared run,
compiled" and "The engine's inline run, compiled") against the Python they stand for.

``Prepared``, a named prepared allreduce's run (``SmallRoad.compiled_run``): at 2 and 3 ranks
on one host, every rank compiled, every rank on the Python run (``operations.
prepare_allreduce``'s closure: the Comm's ``begin_signed``, then the segment's
``allreduce_express``), or rank 0 on the Python run beside compiled ones: results bitwise
equal to NumPy's for every dtype and op of the compiled road, and the same state left behind
(the Comm's sequence number, description and signature, the segment's piece number and
bytes moved); a peer late past the compiled wait's budget (``_fast_rest`` takes over); a
mismatch raised on every rank, after which the group refuses further calls either way; a
closed group refused.

``Inline``, ``Engine.run``'s inline path (``Engine.inline``): in one process, the record it
leaves equals the one ``Engine.run`` leaves, field by field; the pace meter's count of
operations and its steps; the ring's slot taken over from a record still in flight; a failure
of the World raised before the operation runs. The claim's halves, the drain's wake-up and
the prepared call's way through the fast case run both ways in ``tests/test_express.py``.

``Quick``, ``api._quick`` compiled: a named NumPy call taken, every other handed to
``_quick``. And the three let what they hold be collected (their ``tp_traverse``).
"""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

from gradsync import _native
from gradsync.collectives.ops import Average, Max, Min, Product, Sum
from gradsync.errors import GradsyncError, PeerLostError
from gradsync.flight_recorder import COMPLETED, FAILED, Recorder, Record
from gradsync.liveness.pace import meter
from gradsync.pipeline.engine import Engine
from gradsync.transport.comm import Comm
from gradsync.transport.host_segment import ShmGroup
from test_shm import Rank, _launch, _raises
# _compiled: the module must be buildable here (autouse), or the tests would test nothing
from test_shm_fast import _compiled, _input, _reference  # noqa: F401

_SLOT = 8192
_DTYPES = ("float32", "float64", "int32", "int64")
_OPS = {"sum": Sum, "average": Average, "min": Min, "max": Max, "product": Product}
_MODES = ("compiled", "python", "mixed")


def _prepared_run(group: ShmGroup, comm: Comm, compiled: bool, description: str,
                  signature: int, code: int, divisor: int):
    """The run ``operations.prepare_allreduce`` makes for a named call: compiled, or its
    Python closure (the same two steps)."""
    on_idle = lambda waited: None  # noqa: E731
    if compiled:
        run = group.compiled_run(comm, description, signature, code, divisor, on_idle)
        assert run is not None and type(run).__name__ == "Prepared"
        return run

    def run(data: np.ndarray) -> None:
        deadline = comm.begin_signed(description, signature)
        group.allreduce_express(data.reshape(-1), code, divisor, deadline, on_idle, signature)

    return run


def _open(ctx: Rank):
    group = ShmGroup.open(ctx.job, ctx.rank, ctx.size, ctx.barrier, slot_bytes=_SLOT,
                          small_bytes=_SLOT)
    return group, Comm(ctx.rank, ctx.size, {}, 10.0)


def _compiled_here(mode: str, rank: int) -> bool:
    return mode == "compiled" or (mode == "mixed" and rank > 0)


def _sweep(ctx: Rank, mode: str):
    group, comm = _open(ctx)
    compiled = _compiled_here(mode, ctx.rank)
    out: dict = {}
    runs = []
    for count in sorted({1, max(ctx.size - 1, 1), 37, 1001}):
        for dtype in _DTYPES:
            for opname, op in _OPS.items():
                key = (count, dtype, opname)
                description = f"allreduce {key}"
                run = _prepared_run(group, comm, compiled, description,
                                    zlib.crc32(description.encode()),
                                    group.fast_code(op, np.dtype(dtype)),
                                    ctx.size if op is Average else 0)
                runs.append(run)
                data = _input(count, dtype, ctx.rank, ctx.size).reshape(-1, 1)  # 2-d: as is
                run(data)
                out[key] = data.tobytes()
    late = np.full(10, float(ctx.rank + 1))
    run = _prepared_run(group, comm, compiled, "late", 7, group.fast_code(Sum, late.dtype), 0)
    if ctx.rank == 1:
        time.sleep(0.4)  # past the compiled wait's budget: the rest of the wait in Python
    run(late)
    out["late"] = late.tolist()
    out["state"] = (comm.seq, comm.description, comm.signature, group._seq, group.moved,
                    comm._deadline > time.monotonic())
    out["calls"] = sum(r.calls for r in runs) if compiled else None
    group.barrier(time.monotonic() + 10)
    group.close()
    return out


@pytest.mark.parametrize("size,mode", [(2, "compiled"), (3, "compiled"), (2, "python"),
                                       (3, "mixed")])
def test_the_compiled_run_matches_numpy_and_leaves_what_the_python_leaves(size, mode):
    results = _launch(size, _sweep, mode, timeout=60)
    calls = 0
    for key, got in results[0].items():
        if not isinstance(key, tuple):
            continue
        calls += 1
        want = _reference(*key, size)
        for rank in range(size):
            assert results[rank][key] == want, (key, rank)
    for rank in range(size):
        assert results[rank]["late"] == [size * (size + 1) / 2] * 10
        seq, description, signature, pieces, moved, ahead = results[rank]["state"]
        # one begin and one piece per call, the last one's words, both ways
        assert (seq, description, signature, pieces) == (calls + 1, "late", 7, calls + 1)
        assert moved == results[0]["state"][4] and ahead
        if _compiled_here(mode, rank):
            assert results[rank]["calls"] == calls  # each made the kernel's call in C


def _mismatch(ctx: Rank, mode: str):
    group, comm = _open(ctx)
    compiled = _compiled_here(mode, ctx.rank)
    code = group.fast_code(Sum, np.dtype(np.float32))
    good = _prepared_run(group, comm, compiled, "same", 0x1234, code, 0)
    good(np.ones(8, np.float32))
    odd = _prepared_run(group, comm, compiled, "differs", 0xBAD if ctx.rank == 1 else 0x1234,
                        code, 0)
    first = _raises(odd, np.ones(8, np.float32))
    failed = group._failed is not None
    then = _raises(good, np.ones(8, np.float32))
    group.close()
    closed = _raises(good, np.ones(8, np.float32))
    return first, failed, then, closed


@pytest.mark.parametrize("mode", ["compiled", "mixed"])
def test_a_mismatch_raises_on_every_rank_and_the_group_refuses_what_follows(mode):
    results = _launch(3, _mismatch, mode)
    for rank in range(3):
        first, failed, then, closed = results[rank]
        assert first[0] == "CollectiveMismatchError" and "0x1234" in first[1], first
        assert failed  # the segment's _fail ran, on either run
        assert then[0] == "GradsyncError" and "unusable after an earlier failure" in then[1]
        assert closed[0] in ("GradsyncError", "ValueError"), closed


# --- Inline, in one process -----------------------------------------------------------------

class _World:
    failure = None

    def fail(self, exc):
        if self.failure is None:
            self.failure = exc
        return self.failure


def _engine(recorder: Recorder) -> Engine:
    engine = Engine(_World(), recorder.track("numpy:inline", "numpy API", [0, 1], "numpy",
                                             60.0, None))
    assert engine.inline is not None, "Engine.inline was not made"
    return engine


def _fields(rec: Record) -> dict:
    return {name: getattr(rec, name) for name in Record.__slots__}


def test_the_inline_run_leaves_the_record_engine_run_leaves():
    recorder = Recorder(8)
    engine = _engine(recorder)
    shape, dtype = (2, 3), np.dtype(np.float32)
    seen = []
    assert engine.run(seen.append, "w", "all_reduce", shape, dtype, None, "call 1") is None
    python = _fields(recorder.newest())
    assert engine.inline(seen.append, "w", shape, dtype, "call 2") is None
    compiled = _fields(recorder.newest())
    assert seen == ["call 1", "call 2"]
    assert compiled["record_id"] == python["record_id"] + 1
    assert compiled["seq"] == python["seq"] + 1
    assert compiled["created_ns"] == compiled["started_ns"] <= compiled["ended_ns"]
    assert python["created_ns"] == python["started_ns"] <= python["ended_ns"]
    assert compiled["ended_ns"] >= python["ended_ns"]
    for name in ("record_id", "seq", "created_ns", "started_ns", "ended_ns"):
        del compiled[name], python[name]
    assert compiled == python and compiled["state"] == COMPLETED
    assert compiled["track"] is engine.track and compiled["shape"] == shape
    engine.stop()


def test_the_inline_run_counts_operations_and_marks_steps_as_record_done_does():
    recorder = Recorder(8)
    engine = _engine(recorder)
    try:
        for way in ("python", "compiled"):
            meter.reset(3, on=True)
            for _ in range(7):
                if way == "python":
                    engine.run(lambda call: None, "s", "all_reduce", None, None, None, 0)
                else:
                    engine.inline(lambda call: None, "s", None, None, 0)
            assert (meter.ops, meter.step, meter.next_mark) == (7, 2, 9), way
            assert meter.blocked_ns > 0 and meter.blocked_until > 0
        meter.reset(3, on=False)  # off: nothing counted
        engine.inline(lambda call: None, "s", None, None, 0)
        assert meter.ops == 0
    finally:
        meter.reset(0, on=False)
        engine.stop()


def test_the_inline_run_takes_the_slot_of_a_record_still_in_flight_with_a_new_one():
    recorder = Recorder(1)
    engine = _engine(recorder)
    other = recorder.track("numpy:other", "numpy API", [0, 1], "numpy", 60.0, None)
    held = other.issue("all_reduce", "held")  # scheduled, its holder keeps it
    engine.inline(lambda call: None, "next", None, None, 0)
    ring, _ = recorder._slots
    assert ring[0] is not held and ring[0].name == "next" and ring[0].state == COMPLETED
    assert held.name == "held" and held.record_id >= 0  # untouched
    recorder.resize(0)  # no ring: a record of its own, kept by nobody
    engine.inline(lambda call: None, "alone", None, None, 0)
    assert recorder.newest() is None
    engine.stop()


def test_the_inline_run_raises_the_worlds_failure_before_the_operation_runs():
    recorder = Recorder(8)
    engine = _engine(recorder)
    ran = []
    engine.world.failure = lost = PeerLostError("rank 1 is gone")
    with pytest.raises(PeerLostError, match="rank 1 is gone"):
        engine.inline(ran.append, "f", None, None, 0)
    assert ran == [] and recorder.newest().state == FAILED
    engine.world.failure = None
    broken = GradsyncError("the operation broke")

    def breaks(call):
        raise broken

    with pytest.raises(GradsyncError, match="the operation broke"):
        engine.inline(breaks, "g", None, None, 0)
    assert engine.world.failure is broken and lost is not broken  # World.fail, as _failed does
    newest = recorder.newest()
    assert newest.state == FAILED and newest.error == "the operation broke"
    assert not engine.busy()  # released either way
    engine.stop()


# --- Quick, in one process ------------------------------------------------------------------

class _OneHost:
    """A World on one host, as ``api._quick`` reads it (the rest is never reached here)."""

    shares_host, size, failure = True, 2, None


def test_quick_takes_a_named_numpy_call_and_hands_anything_else_to_python(monkeypatch):
    from gradsync import job
    from gradsync.collectives.ops import ReduceOp
    from gradsync.pipeline import operations

    module = _native.load("_shmfast", build=False)
    recorder = Recorder(8)
    engine = Engine(_OneHost(), recorder.track("numpy:quick", "numpy API", [0, 1], "numpy",
                                               60.0, None))
    current = job.Job.__new__(job.Job)  # a job's slots, without a start
    current.world, current.engine, current.pace = engine.world, engine, None
    monkeypatch.setattr(job, "_job", current)
    ran: list[np.ndarray] = []

    def run(data):  # the prepared run: doubles, as a sum of two equal ranks would
        ran.append(data)
        data *= 2

    f32 = np.dtype(np.float32)
    engine.prepared[("q", f32, (2, 2), Sum._value_, "auto")] = operations.Prepared(
        "allreduce 'q'", 1, run, None)
    handed: list[tuple] = []

    def python(*args):
        handed.append(args)
        return "python"

    quick = module.Quick(job, np.ndarray, ReduceOp, python)
    x = np.ones((2, 2), np.float32)
    assert quick(x, Sum, "q", "auto", True) is x and (x == 2).all() and ran[-1] is x
    y = quick(x, Sum, "q", "auto", False)  # out of place: a copy reduced, x left as it is
    assert y is not x and (y == 4).all() and (x == 2).all() and ran[-1] is y
    readonly = np.ones((2, 2), np.float32)
    readonly.flags.writeable = False
    assert (quick(readonly, Sum, "q", "auto", False) == 2).all()  # read, never written
    newest = recorder.newest()
    assert (newest.name, newest.shape, newest.dtype, newest.state) == ("q", (2, 2), f32,
                                                                      COMPLETED)
    assert not handed and len(ran) == 3
    others = [  # each is _quick's: not a named call on a C-contiguous NumPy array it can take
        (x, Sum, None, "auto", True),  # unnamed
        (np.ones((4, 4), np.float32)[::2, ::2], Sum, "q", "auto", True),  # not contiguous
        (readonly, Sum, "q", "auto", True),  # read-only, in place
        (np.ones((2, 2), np.float64), Sum, "q", "auto", True),  # not prepared (yet)
        (np.ones((2, 2), np.float32), Max, "q", "auto", True),  # another op: not prepared
        (np.ones(4, np.float32), Sum, "q", "auto", True),  # another shape
        (x, Sum, "q", "ring", True),  # another algorithm
        (x.tolist(), Sum, "q", "auto", True),  # not an array
        (x, "sum", "q", "auto", True),  # not a ReduceOp
    ]
    for args in others:
        assert quick(*args) == "python"
    assert len(handed) == len(others) and len(ran) == 3
    key = ("q", f32, (2, 2), Sum._value_, "auto")
    kept, world, inline = engine.prepared, current.world, engine.inline
    # (A key's entry never changes in its memory, nor a World's host sharing: a change here
    # is a new memory or World, as a new engine or job has.)
    for change in ("cannot be prepared", "not on one host", "no compiled inline run", "no job"):
        if change == "cannot be prepared":
            engine.prepared = {key: None}
        elif change == "not on one host":
            current.world = _OneHost()
            current.world.shares_host = False
        elif change == "no compiled inline run":
            engine.inline = None
        else:
            monkeypatch.setattr(job, "_job", None)
        assert quick(x, Sum, "q", "auto", True) == "python", change
        engine.prepared, current.world, engine.inline = kept, world, inline
        monkeypatch.setattr(job, "_job", current)
    assert quick(x, Sum, "q", "auto", True) is x and len(ran) == 4  # back on the C road
    engine.stop()


def _quick_job(monkeypatch, label: str):
    """The compiled module, the ``job`` module and an engine on a one-host World made the
    current job's (a job's slots, without a start)."""
    from gradsync import job

    module = _native.load("_shmfast", build=False)
    engine = Engine(_OneHost(), Recorder(8).track(label, "numpy API", [0, 1], "numpy", 60.0,
                                                  None))
    current = job.Job.__new__(job.Job)
    current.world, current.engine, current.pace = engine.world, engine, None
    monkeypatch.setattr(job, "_job", current)
    return module, job, engine, current


def test_quick_remembers_each_names_last_call_and_only_that(monkeypatch):
    # Quick's memo by name (_shmfast.c, "The memo, by name"): a call that its name's entry
    # remembers (the same memory, World, dtype, op, algorithm and shape) skips the key's
    # look-up; any other is looked up as before.
    from gradsync.collectives.ops import ReduceOp
    from gradsync.pipeline import operations

    module, job, engine, current = _quick_job(monkeypatch, "numpy:memo")
    ran: list[str] = []

    def prepare(name, dtype, shape, op=Sum, algorithm="auto"):
        def run(data):
            ran.append(f"{name} {dtype} {shape} {op.name} {algorithm}")
        engine.prepared[(name, np.dtype(dtype), shape, op._value_, algorithm)] = \
            operations.Prepared(f"allreduce '{name}'", 1, run, None)

    prepare("grad.q", "float32", (2, 2))
    prepare("grad.r", "float32", (4,))
    prepare("grad.q", "float32", (1, 4))  # the same name, ndim and size: another shape
    prepare("grad.q", "float64", (2, 2))
    prepare("grad.q", "float32", (2, 2), Max)
    prepare("grad.q", "float32", (2, 2), Sum, "ring")
    handed = []
    quick = module.Quick(job, np.ndarray, ReduceOp, lambda *args: handed.append(args))
    q, r = "grad.q", "grad.r"
    calls = [(q, np.float32, (2, 2), Sum, "auto"), (r, np.float32, (4,), Sum, "auto"),
             (q, np.float32, (1, 4), Sum, "auto"), (q, np.float64, (2, 2), Sum, "auto"),
             (q, np.float32, (2, 2), Max, "auto"), (q, np.float32, (2, 2), Sum, "ring")]
    for _ in range(3):  # each call of a name after another of it: the entry's or a look-up
        for name, dtype, shape, op, algorithm in calls:
            quick(np.ones(shape, dtype), op, "grad." + name[5:], algorithm, True)  # a new str
    expected = [f"{n} {np.dtype(d)} {s} {o.name} {a}" for n, d, s, o, a in calls]
    assert ran == expected * 3 and not handed
    # What the memory held: emptied (as at PREPARED_KEPT), the entry (q's last call) still
    # runs its call; another call is looked up; another memory (another engine's) or World
    # is never the entry's.
    engine.prepared.clear()
    quick(np.ones((2, 2), np.float32), Sum, "grad.q", "ring", True)
    assert ran[-1] == "grad.q float32 (2, 2) SUM ring" and not handed
    quick(np.ones((2, 2), np.float32), Max, "grad.q", "auto", True)  # not prepared any more
    assert len(handed) == 1
    engine.prepared = {}
    quick(np.ones((2, 2), np.float32), Sum, "grad.q", "ring", True)  # not the entry's memory
    assert len(handed) == 2
    engine.prepared, ran[:] = {}, []
    prepare("grad.q", "float32", (2, 2), Sum, "ring")
    quick(np.ones((2, 2), np.float32), Sum, "grad.q", "ring", True)  # looked up, remembered
    current.world = _OneHost()
    current.world.shares_host = False
    quick(np.ones((2, 2), np.float32), Sum, "grad.q", "ring", True)  # another World: looked at
    assert len(handed) == 3 and ran == ["grad.q float32 (2, 2) SUM ring"]
    engine.stop()


def test_the_compiled_objects_let_what_they_hold_be_collected():
    # Each holds what it runs on (Inline its engine, which holds it back; a Prepared its
    # segment and Comm): the collector must see through them (their tp_traverse), or every
    # job's engine, World and segment would outlive it.
    import gc
    import weakref

    engine = _engine(Recorder(8))
    engine.inline(lambda call: None, "x", None, None, 0)
    engine.stop()
    segment = ShmGroup.__new__(ShmGroup)  # its slots alone: never opened, nothing mapped
    segment._failed = segment._fast_group = None
    segment._segment, segment.moved, segment._seq = None, 0, 0
    comm = Comm(0, 2, {}, 10.0)
    module = _native.load("_shmfast", build=False)
    segment.held = module.Prepared(segment, comm, "d", 1, 0, 0, lambda waited: None)
    comm.held = segment  # a cycle through the Comm too
    held = [weakref.ref(engine), weakref.ref(segment), weakref.ref(comm)]
    del engine, segment, comm
    gc.collect()
    assert [ref() for ref in held] == [None, None, None]


def test_quicks_memo_lets_what_it_remembers_be_collected(monkeypatch):
    # The memo holds the World and the engine's memory of each name it remembers: a World
    # that holds the Quick back (a cycle through the memo) must still be collected.
    import gc
    import weakref

    from gradsync.collectives.ops import ReduceOp
    from gradsync.pipeline import operations

    module, job, engine, current = _quick_job(monkeypatch, "numpy:gc")
    ran = []
    engine.prepared[("m", np.dtype(np.float32), (2,), Sum._value_, "auto")] = \
        operations.Prepared("allreduce 'm'", 1, ran.append, None)
    quick = module.Quick(job, np.ndarray, ReduceOp, lambda *args: None)
    quick(np.ones(2, np.float32), Sum, "m", "auto", True)  # remembered
    assert len(ran) == 1
    engine.world.quick = quick
    held = [weakref.ref(engine.world), weakref.ref(engine)]
    engine.stop()
    monkeypatch.undo()  # (it holds what it replaced)
    del engine, current, quick
    gc.collect()
    assert [ref() for ref in held] == [None, None]


@pytest.mark.parametrize("how", ["a call on another job", "forget"])
def test_quick_holds_no_world_past_its_job(monkeypatch, how):
    # Remembered calls hold their World: the first call on another job's memory drops them,
    # as does forget() (api.shutdown calls it), so a closed World is not kept alive.
    import gc
    import weakref

    from gradsync.collectives.ops import ReduceOp
    from gradsync.pipeline import operations

    module, job, engine, current = _quick_job(monkeypatch, "numpy:old")
    engine.prepared[("m", np.dtype(np.float32), (2,), Sum._value_, "auto")] = \
        operations.Prepared("allreduce 'm'", 1, lambda data: None, None)
    handed = []
    quick = module.Quick(job, np.ndarray, ReduceOp, lambda *args: handed.append(args))
    quick(np.ones(2, np.float32), Sum, "m", "auto", True)  # remembered
    assert not handed
    old = weakref.ref(engine.world)
    engine.stop()
    monkeypatch.undo()
    del engine, current
    gc.collect()
    assert old() is not None  # the memo holds it
    if how == "forget":
        quick.forget()
    else:
        _, _, engine, _ = _quick_job(monkeypatch, "numpy:new")
        quick(np.ones(2, np.float32), Sum, "other", "auto", True)  # another job's memory
        assert len(handed) == 1
        engine.stop()
    gc.collect()
    assert old() is None
