"""Allreduces of a size the planner contests, over 4 hosts of one rank (``GRADSYNC_HOSTNAME``
set per rank by the test) with the default tiers: the first ones are its trials.

    plan_trials.py CALLS

Runs CALLS float32 allreduces of 1 MiB, each checked against its exact sum, and prints the
algorithm each ran (the collective's description names it) and the one kept, which every
rank must print alike.
"""

import sys

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs
from gradsync import job

CALLS = int(sys.argv[1])
gs.init()
R, N = gs.rank(), gs.size()
world = job.world()
ran = []
for call in range(CALLS):
    x = np.full(1 << 18, float((R + 1) * (call + 1)), dtype=np.float32)
    got = gs.allreduce(x, op=gs.Sum, name="trial")
    want = N * (N + 1) // 2 * (call + 1)
    if not np.array_equal(got, np.full_like(x, want)):
        sys.exit(f"rank {R}: call {call} gave {got[:4]}..., not {want}")
    ran.append(world.comm.description.split("algorithm=")[1])
print(f"RAN {' '.join(ran)}", flush=True)
print(f"KEPT {world.plans.allreduce(1 << 20)} TRYING {world.plans.trying}", flush=True)
gs.shutdown()
