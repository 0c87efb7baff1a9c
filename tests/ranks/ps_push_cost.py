"""Time of one ``push`` (median over PUSHES, after a warm-up): ``ps_push_cost.py MODE N``.

The replication cost measurement of docs/ps.md ("Failures"): run it under
``--servers R --ps-replicas R`` for R = 1 and 2 in the same shell loop and compare. The
model has N float32 parameters (one Linear layer); every worker pushes the same gradient
each step (the servers' work does not depend on its values).
"""

import os
import statistics
import sys
import time

import numpy as np
import torch

import gradsync as gs
import gradsync.ps

WARMUP, PUSHES = 20, 200


def main(mode: str, n: int) -> None:
    side = int(n ** 0.5)
    model = torch.nn.Linear(side, side, bias=False)
    ps = gradsync.ps.ParameterClient(model, optimizer="sgd", lr=1e-6, mode=mode)
    times = []
    for step in range(WARMUP + PUSHES):
        model.weight.grad = torch.full_like(model.weight, 1e-3)
        start = time.perf_counter()
        ps.push()
        times.append(time.perf_counter() - start)
        ps.pull()
    median = statistics.median(times[WARMUP:]) * 1e6
    medians = gs.allgather(np.array([median]))
    if ps.rank == 0:
        print(f"replicas={os.environ.get('GRADSYNC_PS_REPLICAS', '1')} mode={mode} "
              f"params={side * side} push_median_us={np.median(medians):.0f} "
              f"workers={[round(float(m)) for m in medians]}", flush=True)
    ps.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
