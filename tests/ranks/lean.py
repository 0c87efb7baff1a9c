"""The lean path of small allreduces: the ``size() == 1`` shortcut and the per-size plans.

Run by tests/test_lean.py through ``gradsync run -np N`` (N = 1, 2, 3). At N = 1 every case
below takes the shortcut or, when it must not (scaling, async, errors), the full path; both
must give what the full path gives at any N: the closed-form sums below. Prints "lean ok".
"""

import common  # noqa: F401  (deadline)
from checks import Checks
import numpy as np
import torch

import gradsync as gs
from gradsync import job

gs.init()
R, N = gs.rank(), gs.size()
total = N * (N + 1) / 2  # sum over ranks of rank + 1


C = Checks(R)
fail = C.fail


def expect_raises(kind, fn):
    C.raises(str(fn), kind, fn)


# In place returns the caller's own object, with the reduced values.
x = np.full(1024, R + 1, np.float32)
if gs.allreduce_(x, op=gs.Sum, name="a") is not x or not (x == total).all():
    fail(f"allreduce_ numpy gave {x[:3]}")
# Out of place leaves the input alone and returns a new, contiguous array.
y = np.full((4, 6), R + 1, np.int64)[:, ::2]  # not contiguous
z = gs.allreduce(y, op=gs.Sum, name="b")
if z is y or not z.flags.c_contiguous or z.shape != (4, 3) or not (z == total).all() \
        or not (y == R + 1).all():
    fail(f"allreduce numpy gave {z}")
# Torch, in place and not, a non-contiguous view among them; Average of equal values.
t = torch.full((8, 8), float(R + 1))
if gs.allreduce_(t, op=gs.Sum, name="c") is not t or not bool((t == total).all()):
    fail(f"allreduce_ torch gave {t[0, :3]}")
v = torch.full((6, 6), 2.0).t()
out = gs.allreduce(v, name="d")  # Average
if out.data_ptr() == v.data_ptr() or not out.is_contiguous() or not bool((out == 2.0).all()):
    fail(f"allreduce torch gave {out}")
bf = torch.full((5,), float(R + 1), dtype=torch.bfloat16)
if not bool((gs.allreduce(bf, op=gs.Sum, name="e") == total).all()):
    fail("bfloat16")
# Scaling goes the full way: (R+1) * 2 summed, then * 0.5.
s = np.full(10, R + 1, np.float64)
gs.allreduce_(s, op=gs.Sum, name="f", prescale_factor=2.0, postscale_factor=0.5)
if not (s == total).all():
    fail(f"scaled allreduce gave {s[:3]}")
# Async goes through the engine.
h = gs.allreduce_async(np.full(3, R + 1, np.int32), op=gs.Sum, name="g")
if not (gs.synchronize(h) == total).all():
    fail("async")
# Errors are the full path's, on every rank alike (nothing is exchanged before them).
expect_raises(ValueError, lambda: gs.allreduce_(np.ones(3, np.float32), algorithm="nope"))
expect_raises(TypeError, lambda: gs.allreduce_(np.ones(3, np.float32), op="sum"))
expect_raises(TypeError, lambda: gs.allreduce(np.ones(3, np.complex64)))
frozen = np.ones(3, np.float32)
frozen.flags.writeable = False
expect_raises(ValueError, lambda: gs.allreduce_(frozen))
expect_raises(TypeError, lambda: gs.allreduce_([1.0, 2.0]))
# At N = 1 the plain calls never reach the engine.
if N == 1:
    engine = job.engine()
    engine.run = engine.submit = lambda *a: fail("a plain allreduce at size 1 went through "
                                                 "the engine")
    gs.allreduce_(x, op=gs.Sum)
    gs.allreduce(t, op=gs.Min)
    del engine.run, engine.submit  # the class's methods again
# The planner ran once per (size, request), not once per call.
for _ in range(50):
    gs.allreduce_(x, op=gs.Max, name="h")
plans = job.world().plans._chosen
if N > 1 and sum(1 for size, _ in plans if size == x.nbytes) != 1:
    fail(f"plans per size: {plans}")
gs.barrier()
print("lean ok", flush=True)
gs.shutdown()
