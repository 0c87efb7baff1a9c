"""Live ranks on a starved machine are never taken for silent ones (heartbeat false positives).

    oversubscribed.py SECONDS [HOLD]

Every rank runs allreduces for SECONDS with the default heartbeat settings (unless the
environment sets them), on a machine that the test crowds with more ranks than cores and
with CPU burners. Besides, between its collectives:

- rank 1 computes in Python for 4 heartbeat timeouts at a time (a long forward pass);
- rank 2 holds the GIL in one C call after another, each about HOLD seconds when measured
  (default: an eighth of a heartbeat timeout; ``sum`` over a range never lets the GIL go, and
  on a crowded machine each call takes longer), for 4 timeouts at a time;
- the others compute a little (a matrix product) per step.

Each rank prints ``RESULT rank=R steps=K no error`` at the end, or the error it caught (and
exits 17); a silent-peer false positive ends every rank with a PeerLostError.
"""

import sys
import time

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs
from gradsync import job

seconds = float(sys.argv[1])
gs.init()
R, N = gs.rank(), gs.size()
timeout = job.world().config.heartbeat_timeout


def sum_for(wanted: float) -> int:
    """The length of a range whose ``sum`` takes about ``wanted`` seconds here."""
    n, took = 1 << 16, 0.0
    while took < wanted / 4:
        n *= 2
        start = time.monotonic()
        sum(range(n))
        took = time.monotonic() - start
    return int(n * wanted / took)


hold = float(sys.argv[2]) if len(sys.argv) > 2 else timeout / 8
held = sum_for(hold) if R == 2 else 0
x = np.random.default_rng(R).random((200, 200))
end = time.monotonic() + seconds
steps, longest = 0, 0.0  # the longest hold of the GIL (rank 2)
try:
    while True:
        done = gs.broadcast_object(time.monotonic() > end, 0)  # rank 0's clock decides
        if done:
            break
        if R == 1 and steps % 20 == 5:
            stop = time.monotonic() + 4 * timeout
            while time.monotonic() < stop:
                sum(i * i for i in range(1000))
        elif R == 2 and steps % 20 == 10:
            stop = time.monotonic() + 4 * timeout
            while time.monotonic() < stop:
                start = time.monotonic()
                sum(range(held))
                longest = max(longest, time.monotonic() - start)
        else:
            x = x @ x / np.linalg.norm(x)
        gs.allreduce(np.ones(1000), name=f"step{steps}")
        steps += 1
    print(f"RESULT rank={R} steps={steps} no error", flush=True)
    if R == 2:
        print(f"HELD the GIL for up to {longest:.2f}s at a time", flush=True)
    gs.shutdown()
except gs.GradsyncError as exc:
    print(f"RESULT rank={R} {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)
    sys.exit(17)
