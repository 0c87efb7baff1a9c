"""A job that ends as most jobs do: allreduces, a barrier, a result line, ``shutdown()``.

    goodbye.py [STALL]

STALL (seconds, default 0): the store takes that long to take each rank's goodbye (the
``hb/<rank>/bye`` key its heartbeat writes when the World closes), as torch's store server
stalls for seconds when many ranks exit at once (docs/troubleshooting.md). The ranks leave the
barrier seconds apart on a crowded machine, so the first to leave is the neighbour of ranks
still waiting in it; none of them may take it for lost.

Run by tests/test_scale_goodbye.py (through tests/ranks/forked.py). Lines:

    RESULT rank=<r> ok: left                                  passed the barrier, shut down
    RESULT rank=<r> wall=<time.time()> <ErrorType>: <message>   caught an error (exit 17)

A wrong allreduce ends the rank with exit status 1 and names it.
"""

import sys
import time

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs
from gradsync.cluster import rendezvous

STALL = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
if STALL:
    write = rendezvous.Store.set

    def stalled(self, key, value):
        if key.startswith("hb/") and key.endswith("/bye"):
            time.sleep(STALL)  # the store's stall, as this rank's request sees it
        return write(self, key, value)

    rendezvous.Store.set = stalled

R = -1
try:
    gs.init(timeout=60)
    R, N = gs.rank(), gs.size()
    for count in [1, 1000, 100_000]:
        got = gs.allreduce(np.full(count, R, dtype=np.float32), op=gs.Sum)
        if not np.array_equal(got, np.full(count, N * (N - 1) / 2)):
            sys.exit(f"rank {R}: allreduce[{count}]: got {got[:6]}")
    gs.barrier()
    gs.shutdown()
    print(f"RESULT rank={R} ok: left", flush=True)
except gs.GradsyncError as exc:
    one_line = str(exc).replace("\n", " | ")
    print(f"RESULT rank={R} wall={time.time():.6f} {type(exc).__name__}: {one_line}",
          flush=True)
    sys.exit(17)
