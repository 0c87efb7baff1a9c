"""Live ranks on a starved machine are never taken for silent ones (heartbeat false positives).

    oversubscribed.py SECONDS [HOLD]

Every rank runs allreduces for SECONDS with the default heartbeat settings (unless the
environment sets them), on a machine that the test crowds with more ranks than cores and
with CPU burners. Besides, between its collectives, at the same time, before step 5's
allreduce and every 20 steps after:

- rank 1 computes in Python for 4 heartbeat timeouts (a long forward pass);
- rank 2 holds the GIL in one C call after another, each about HOLD seconds when measured
  (default: an eighth of a heartbeat timeout; ``sum`` over a range never lets the GIL go, and
  on a crowded machine each call takes longer), for 4 timeouts;
- the others compute a little (a matrix product) per step, and wait for ranks 1 and 2.

The job goes on for at least 2 timeouts after step 5's allreduce, whatever SECONDS (0: just
that, tests/test_heartbeat.py): a watcher that took rank 1 or 2 for silent would have posted
the loss by then, and it would end the steps after. (Until issue 39 rank 2's starvations came
10 steps after rank 1's, and the test ran for 20 s: three starvations in 26 s, where one of
each at once, 8 s, meets the same two events.)

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
starved: float | None = None  # 2 timeouts after step 5's allreduce (rank 0's clock decides)
steps, longest = 0, 0.0  # the longest hold of the GIL (rank 2)
try:
    while True:
        done = gs.broadcast_object(starved is not None and time.monotonic() > max(end, starved),
                                   0)
        if done:
            break
        if R == 1 and steps % 20 == 5:
            stop = time.monotonic() + 4 * timeout
            while time.monotonic() < stop:
                sum(i * i for i in range(1000))
        elif R == 2 and steps % 20 == 5:
            stop = time.monotonic() + 4 * timeout
            while time.monotonic() < stop:
                start = time.monotonic()
                sum(range(held))
                longest = max(longest, time.monotonic() - start)
        else:
            x = x @ x / np.linalg.norm(x)
        gs.allreduce(np.ones(1000), name=f"step{steps}")
        if steps == 5:
            starved = time.monotonic() + 2 * timeout
        steps += 1
    print(f"RESULT rank={R} steps={steps} no error", flush=True)
    if R == 2:
        print(f"HELD the GIL for up to {longest:.2f}s at a time", flush=True)
    gs.shutdown()
except gs.GradsyncError as exc:
    print(f"RESULT rank={R} {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)
    sys.exit(17)
