"""The planner's predictions against measurements: probe the network, then time every
allreduce algorithm and print both (rank 0, one ``PLANCHECK {json}`` line).

    plan_check.py TOPOLOGY_FILE NBYTES
"""

import json
import statistics
import sys
import time

import common  # noqa: F401  (deadline)
import numpy as np

import gradsync as gs
from gradsync import job
from gradsync.bench import probe
from gradsync.collectives.planner import CANDIDATES, predict

path, nbytes = sys.argv[1], int(sys.argv[2])
probe.main(["--out", path, "--pings", "20", "--streams", "2"])
gs.init(topology=path)
world = job.world()
x = np.zeros(nbytes // 4, dtype=np.float32)
measured = {}
for alg in CANDIDATES:
    gs.allreduce_(x, op=gs.Sum, algorithm=alg, name=alg)  # warm-up
    samples = []
    for _ in range(3):
        gs.barrier()
        start = time.perf_counter()
        gs.allreduce_(x, op=gs.Sum, algorithm=alg, name=alg)
        took = np.array([time.perf_counter() - start])
        samples.append(float(gs.allreduce(took, op=gs.Max, name="slowest")[0]))
    measured[alg] = statistics.median(samples)
if gs.rank() == 0:
    predicted = {alg: predict(alg, nbytes, world.topology) for alg in CANDIDATES}
    choice = min(predicted, key=predicted.get)
    print("PLANCHECK " + json.dumps({"measured": measured, "predicted": predicted,
                                     "choice": choice}), flush=True)
gs.shutdown()
