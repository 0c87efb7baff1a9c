"""Sub-worlds: even and odd ranks each form a World of their own and run collectives on it
from a second thread while the main thread runs collectives on the whole job.

    subworld.py [tcp]

``tcp``: every pair over TCP (``init(transport="tcp")``; the job's environment is shared by
the scripts of a tests/small_jobs.py job).
"""

import common  # noqa: F401  (deadline)

import sys
import threading

import numpy as np

import gradsync as gs
from gradsync import job
from gradsync.collectives.ops import Sum
from gradsync.pipeline import operations

gs.init(**({"transport": "tcp"} if sys.argv[1:] == ["tcp"] else {}))
world, r, n = job.world(), gs.rank(), gs.size()
members = [q for q in range(n) if q % 2 == r % 2]
sub = world.subworld(members, f"parity{r % 2}")
assert (sub.rank, sub.size) == (members.index(r), len(members)), (sub.rank, sub.size)

errors = []


def on_sub():
    try:
        for i in range(50):
            x = np.full(1000 + i, r + i, dtype=np.float64)
            operations.allreduce(sub, x, x.dtype, Sum, name=f"sub{i}", shape=x.shape)
            expected = sum(q + i for q in members)
            assert (x == expected).all(), (i, x[:3], expected)
    except BaseException as exc:  # reported by the main thread
        errors.append(exc)


t = threading.Thread(target=on_sub)
t.start()
for i in range(50):
    y = gs.allreduce(np.full(3000, r * i, dtype=np.int64), op=gs.Sum, name=f"global{i}")
    assert (y == i * n * (n - 1) // 2).all(), (i, y[:3])
t.join()
if errors:
    raise errors[0]
sub.close()
print("subworld ok", r, sub.size)
gs.shutdown()
