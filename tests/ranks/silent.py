"""A rank that stops (SIGSTOP) before a collective: the others must raise PeerLostError.

    silent.py VICTIM TRANSPORT stop   VICTIM stops itself; every other rank prints one RESULT
                                      line and ELAPSED (seconds from the stop to its error)
    silent.py VICTIM TRANSPORT busy   VICTIM computes in Python for 2.5 heartbeat timeouts
                                      before joining the collectives: slow is not silent
"""

import os
import signal
import sys
import time

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs

victim, transport, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
gs.init(transport=transport, timeout=120)
R, N = gs.rank(), gs.size()
gs.allreduce(np.ones(10), name="warm-up")
stopped_at = gs.broadcast_object(time.time() + 0.5, 0)  # when the victim stops, by the clock
if R == victim:
    time.sleep(max(0.0, stopped_at - time.time()))
    if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        end = time.monotonic() + 2.5 * float(os.environ["GRADSYNC_HEARTBEAT_TIMEOUT"])
        while time.monotonic() < end:
            sum(i * i for i in range(1000))
try:
    for step in range(1000 if mode == "stop" else 20):
        gs.allreduce(np.ones(1000), name=f"step{step}")
    print(f"RESULT rank={R} no error", flush=True)
except gs.GradsyncError as exc:
    print(f"ELAPSED rank={R} {time.time() - stopped_at:.2f}", flush=True)
    print(f"RESULT rank={R} {type(exc).__name__}: {exc}".replace("\n", " | "), flush=True)
    os._exit(17)
