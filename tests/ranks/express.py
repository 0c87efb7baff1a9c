"""The small-allreduce fast case (the *lane*: a call prepared once, by
gradsync/pipeline/operations.prepare_allreduce, then run by the engine) against closed forms.

Run by tests/test_express.py at N ranks forked from one process (tests/forked_jobs.py; by
hand, ``gradsync run -np N`` runs it the same); argv[1] is the mode:

- ``lane``: every rank may take the lane;
- ``mixed``: rank 0 never does (its calls take the full road), the others may: both roads
  must meet in the same collectives;
- ``off``: GRADSYNC_SHM_FAST=0 is set by the test; no call may take the lane.

Every dtype of the compiled road (and one it lacks), every op, counts 0, 1, fewer than the
ranks, uneven and most of the one-step size; named and unnamed; NumPy in place and not, torch
in place and not; unnamed calls between unnamed broadcasts (which draw from the same count of
names, so a lane that drew a name too many or too few would no longer meet rank 0's full road
in ``mixed``); a call issued behind a queued asynchronous one; last, ranks that issue
different names must all raise CollectiveMismatchError. Prints "express ok <calls on the
lane>".

With argv[2] (``dtype``, ``op`` or ``count``) the script instead warms the lane with a few
unnamed calls, then issues an unnamed allreduce that differs between ranks in that respect
only, and checks that every rank raises CollectiveMismatchError naming what each issued. With
``+dtype``, ``+op`` or ``+count`` it does that after all the checks above, in a second job
of the same ranks (``shutdown()`` then ``init()``: one start-up for both; it prints "express
ok" twice).
"""

import sys

import common  # noqa: F401  (deadline)
from checks import Checks
import numpy as np
import torch

import gradsync as gs
from gradsync import job
from gradsync.transport.host_segment import ShmGroup
from gradsync.pipeline import operations
from gradsync.collectives.ops import scale

mode = sys.argv[1]
gs.init()
R, N = gs.rank(), gs.size()
taken = 0
lane_here = mode == "lane" or (mode == "mixed" and R != 0)

express_call = ShmGroup.allreduce_express
compiled_run = ShmGroup.compiled_run
compiled: list = []  # the compiled prepared runs made, each counting its own calls


def counted(self, *args):
    global taken
    taken += 1
    return express_call(self, *args)


def kept(self, *args):
    run = compiled_run(self, *args)
    if run is not None:
        compiled.append(run)
    return run


def lane_calls() -> int:
    """Calls that took the lane: through the segment's Python entry, or in a compiled
    prepared run's own C call (a named call where the module is built)."""
    return taken + sum(run.calls for run in compiled)


ShmGroup.allreduce_express = counted
ShmGroup.compiled_run = kept
if not lane_here:
    operations.prepare_allreduce = lambda *args: None  # nothing prepared: the full road


fail = Checks(R).fail


def unnamed_mismatch(what: str) -> None:
    """Even ranks and odd ranks issue an unnamed allreduce differing only in ``what``."""
    for _ in range(3):  # the lane's entry made, then taken as a steady-state call is
        x = np.full(4, R + 1, np.float32)
        gs.allreduce_(x, op=gs.Sum)
        if not (x == N * (N + 1) / 2).all():
            fail(f"warm-up gave {x}")
    odd = R % 2
    dtype = ("float32", "int32")[odd] if what == "dtype" else "float32"  # the same bytes
    op = (gs.Sum, gs.Max)[odd] if what == "op" else gs.Sum
    count = (4, 5)[odd] if what == "count" else 4
    seen = lane_calls()
    try:
        gs.allreduce_(np.ones(count, dtype), op=op)
    except gs.CollectiveMismatchError as exc:
        text = str(exc)
        words = {"dtype": ("float32[4]", "int32[4]"), "op": ("op=SUM", "op=MAX"),
                 "count": ("float32[4]", "float32[5]")}[what]
        if "allreduce.noname." not in text or not all(w in text for w in words):
            fail(f"the mismatch report does not name both unnamed calls: {text}")
    else:
        fail(f"unnamed calls differing in {what} did not raise CollectiveMismatchError")
    if lane_here and lane_calls() != seen + 1:
        fail("the mismatched unnamed call did not take the lane")
    print(f"express ok {lane_calls()}", flush=True)
    sys.exit(0)


then = None  # "+WHAT": the unnamed mismatch of WHAT after every other check, in this job
if len(sys.argv) > 2 and sys.argv[2].startswith("+"):
    then = sys.argv[2][1:]
elif len(sys.argv) > 2:
    unnamed_mismatch(sys.argv[2])


def data(count, dtype, rank):
    return (((np.arange(count) * 7 + rank * 5) % 11) - 5).astype(dtype)


OPS = {"sum": (gs.Sum, np.add), "average": (gs.Average, np.add), "min": (gs.Min, np.minimum),
       "max": (gs.Max, np.maximum), "product": (gs.Product, np.multiply)}
expected_lane = 0
for dtype in ("float32", "float64", "int32", "int64", "int16"):
    for kind, (op, ufunc) in OPS.items():
        for count in sorted({0, 1, max(N - 1, 1), 37, 1001}):
            want = data(count, dtype, 0)
            for r in range(1, N):  # in rank order, as every road folds
                want = ufunc(want, data(count, dtype, r)).astype(dtype)
            if kind == "average":
                scale(want, want.dtype, N, divide=True)
            eligible = count > 0 and dtype != "int16"
            name = f"x.{dtype}.{kind}.{count}"
            x = data(count, dtype, R)
            if gs.allreduce_(x, op=op, name=name) is not x or x.tobytes() != want.tobytes():
                fail(f"allreduce_ {name} gave {x[:4]}, want {want[:4]}")
            y = data(count, dtype, R).reshape(1, -1)
            z = gs.allreduce(y, op=op, name=name + ".copy")
            if z is y or z.shape != y.shape or z.tobytes() != want.tobytes() \
                    or y.tobytes() != data(count, dtype, R).tobytes():
                fail(f"allreduce {name} gave {z}, input now {y}")
            expected_lane += 2 * eligible
            # Unnamed, in place and not: the lane as for a name.
            x = data(count, dtype, R)
            if gs.allreduce_(x, op=op) is not x or x.tobytes() != want.tobytes():
                fail(f"unnamed allreduce_ {name} gave {x[:4]}, want {want[:4]}")
            z = gs.allreduce(y, op=op)
            if z is y or z.shape != y.shape or z.tobytes() != want.tobytes():
                fail(f"unnamed allreduce {name} gave {z}")
            expected_lane += 2 * eligible
        # An unnamed broadcast draws the next name too: both roads must stay in step.
        b = np.full(2, R, np.int64)
        if gs.broadcast_(b, 0).tolist() != [0, 0]:
            fail(f"unnamed broadcast gave {b}")
# The description each rank began its last collective with: the same on the lane and on
# the full road, the drawn name included (what a mismatch or stall report shows).
last = np.full(3, R + 1, np.float32)
gs.allreduce_(last, op=gs.Sum)
expected_lane += 1
mine = job.world().comm.description
described = gs.allgather_object(mine, name="described")
if len(set(described)) != 1 or not mine.startswith("allreduce 'allreduce.noname."):
    fail(f"ranks began an unnamed allreduce with {described}")
# torch: in place (a tensor that requires grad, as a parameter's .grad does not but a
# metric may), out of place, a non-contiguous view (full road), bfloat16 (full road).
t = torch.full((4, 8), float(R + 1), requires_grad=True)
with torch.no_grad():
    if gs.allreduce_(t, op=gs.Sum, name="t") is not t or not bool((t == N * (N + 1) / 2).all()):
        fail(f"torch allreduce_ gave {t}")
u = torch.arange(6, dtype=torch.int64) * (R + 1)
v = gs.allreduce(u, op=gs.Max, name="u")
if v.data_ptr() == u.data_ptr() or v.tolist() != [i * N for i in range(6)] \
        or u.tolist() != [i * (R + 1) for i in range(6)]:
    fail(f"torch allreduce gave {v}, input now {u}")
w = torch.full((6, 6), 2.0).t()
if not bool((gs.allreduce(w, name="w") == 2.0).all()):
    fail("torch non-contiguous")
bf = torch.full((5,), float(R + 1), dtype=torch.bfloat16)
if not bool((gs.allreduce(bf, op=gs.Sum, name="bf") == N * (N + 1) / 2).all()):
    fail("bfloat16")
expected_lane += 2
if not lane_here:
    expected_lane = 0
if lane_calls() != expected_lane:
    fail(f"{lane_calls()} calls took the lane, expected {expected_lane}")
# Behind a queued asynchronous allreduce the lane must wait its turn (the engine's order):
# while the engine is busy, the prepared call queues behind the other; either way the results
# are the closed form (whether the engine was free by then depends on timing).
big = np.full(1 << 18, R + 1, np.float32)
h = gs.allreduce_async_(big, op=gs.Sum, name="big")
small = np.full(3, R + 1, np.float32)
gs.allreduce_(small, op=gs.Sum, name="small")
if not (small == N * (N + 1) / 2).all() or not (gs.synchronize(h) == N * (N + 1) / 2).all():
    fail(f"behind an async call: {small}")
big, small = np.full(1 << 18, R + 1, np.float32), np.full(3, R + 1, np.float32)
h = gs.allreduce_async_(big, op=gs.Sum)  # unnamed both: each draws its name in issue order
gs.allreduce_(small, op=gs.Sum)
if not (small == N * (N + 1) / 2).all() or not (gs.synchronize(h) == N * (N + 1) / 2).all():
    fail(f"unnamed behind an unnamed async call: {small}")
# Different names at the same step: a mismatch on every rank, whichever road each took.
try:
    gs.allreduce_(np.ones(4, np.float32), op=gs.Sum, name=f"mismatch.{R % 2}")
except gs.CollectiveMismatchError as exc:
    if "mismatch.0" not in str(exc) or "mismatch.1" not in str(exc):
        fail(f"the mismatch report does not name both calls: {exc}")
else:
    fail("different names did not raise CollectiveMismatchError")
print(f"express ok {lane_calls()}", flush=True)
if then:  # the mismatch above failed this job (as any does): a fresh one, in these ranks
    gs.shutdown()
    gs.init()
    unnamed_mismatch(then)
