"""The planner's predictions against measurements: probe the network, then time every
allreduce algorithm and print both (rank 0, one ``PLANCHECK {json}`` line).

Each algorithm's time is the fastest of its samples, each sample the slowest rank's. The model
predicts what the links cost; anything else on the machine (another job, a test beside this
one) can only add to a sample, never take from it, so the fastest sample is the one that
measures the links. A median counted the interference in as soon as two samples of three
were hit, which beside two CPU burners they were (doubling 1.29x its prediction, the other
algorithms 0.99-1.15x).

    plan_check.py TOPOLOGY_FILE NBYTES
"""

import json
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
measured, samples_of = {}, {}
for alg in CANDIDATES:
    gs.allreduce_(x, op=gs.Sum, algorithm=alg, name=alg)  # warm-up
    samples = []
    for _ in range(3):
        gs.barrier()
        start = time.perf_counter()
        gs.allreduce_(x, op=gs.Sum, algorithm=alg, name=alg)
        took = np.array([time.perf_counter() - start])
        samples.append(float(gs.allreduce(took, op=gs.Max, name="slowest")[0]))
    measured[alg], samples_of[alg] = min(samples), samples
if gs.rank() == 0:
    predicted = {alg: predict(alg, nbytes, world.topology) for alg in CANDIDATES}
    choice = min(predicted, key=predicted.get)
    print("PLANCHECK " + json.dumps({"measured": measured, "predicted": predicted,
                                     "choice": choice, "samples": samples_of}), flush=True)
gs.shutdown()
